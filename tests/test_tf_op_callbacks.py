"""``core/_tf_op_callbacks.py``: a trace's random draws and variable reads, replayed in a second trace."""

import pytest
import tensorflow as tf

import replicator
from replicator.core import _tf_op_callbacks


def _trace(state, generator):
  seed = state.read_value()
  state.assign_add([0, 1])
  return [tf.random.uniform([3], seed=1), tf.random.stateless_uniform([3], seed=seed), generator.normal([3]),
          seed, state.read_value()]


def test_a_second_trace_takes_the_first_traces_draws_and_reads():
  state = tf.Variable([7, 0], dtype=tf.int64)
  generator = tf.random.Generator.from_seed(3)
  weight = tf.Variable(2.0)

  @tf.function
  def twice():
    graph = tf.compat.v1.get_default_graph()
    with _tf_op_callbacks.recording("twice", graph) as record:
      first = _trace(state, generator) + [weight.read_value()]
    with _tf_op_callbacks.replaying(record, graph):
      second = _trace(state, generator) + [weight.read_value()]
    return first, second, [handle.name for handle, _ in record.written_variables()]

  first, second, written = twice()
  for a, b in zip(first, second):
    tf.debugging.assert_equal(a, b)
  assert len(written) == 2  # the seed state, and the generator's state (as its op writes it)
  assert int(state.numpy()[1]) == 2  # the second trace's writes happened (remat restores them after)


def test_a_trace_that_draws_differently_the_second_time_is_refused():
  @tf.function
  def twice():
    graph = tf.compat.v1.get_default_graph()
    with _tf_op_callbacks.recording("f", graph) as record:
      tf.random.uniform([2])
    with _tf_op_callbacks.replaying(record, graph):
      tf.random.normal([2])

  with pytest.raises(replicator.UnsupportedError, match=r"replicator.remat\(f\): computing the function again .* "
                     r"created random op 0 of type RandomStandardNormal, where its first call created RandomUniform"):
    twice()


def test_a_draw_inside_control_flow_is_recorded_as_not_replayable():
  @tf.function
  def trace(x):
    graph = tf.compat.v1.get_default_graph()
    with _tf_op_callbacks.recording("f", graph) as record:
      tf.cond(x > 0, lambda: tf.random.uniform([]), lambda: 0.0)
    record.check()

  with pytest.raises(replicator.UnsupportedError, match=r"a random op \(RandomUniform .*\) is inside a tf.cond"):
    trace(tf.constant(1.0))
  assert _tf_op_callbacks.available()
