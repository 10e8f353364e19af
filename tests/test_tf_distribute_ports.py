"""TensorFlow's custom-training-loop input tests that call ``strategy.run`` inside a ``tf.function``, ported.

From ``tensorflow/python/distribute/custom_training_loop_input_test.py``
(TF 2.21), each test that runs steps or iterates distributed input inside a
``tf.function`` and applies to two replicas on CPUs, rewritten for this library
(``strategy.run(fn, args=(x,))`` -> ``repl.run(fn, inputs=x)``,
``experimental_local_results(v)`` -> ``v.values``, ``strategy.reduce`` ->
``repl.reduce``, ``experimental_distribute_dataset`` ->
``repl.distribute_dataset``) with the same inputs and expected values. Left
out: TPU-only options, tests of ``distribute_datasets_from_function`` on
unbatched data (``distribute_dataset`` splits batches), and the tests whose
steps run eagerly (``tests/test_distributed_dataset.py`` covers those idioms).
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import replicator


@pytest.fixture
def repl():
  return replicator.Replicator(cpus(2))


def _values(per_replica):
  return [np.asarray(v).tolist() for v in per_replica.values]


def test_constant_numpy_input(repl):
  run = tf.function(lambda x: repl.run(tf.square, inputs=x).values)
  assert [float(v) for v in run(2.0)] == [4.0, 4.0]


def test_a_stateful_run_executes_though_its_output_is_unused(repl):
  with repl.context():
    v = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)

  @tf.function
  def run():
    repl.run(lambda: v.assign_add(1.0))
    return tf.zeros([])

  run()
  assert float(v.read_value()) == 1.0


def test_get_next_as_optional(repl):
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0, 6.0, 7.0, 8.0]).batch(2)))
  run = tf.function(lambda: repl.run(tf.square, inputs=iterator.get_next_as_optional().get_value()).values)
  assert [[float(v[0]) for v in run()]] == [[25.0, 36.0]]


def test_get_next_as_optional_in_a_loop_that_breaks_at_the_end(repl):
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.range(8, output_type=tf.int32).batch(2)))
  with repl.context():
    total = tf.Variable(0, aggregation=tf.VariableAggregation.SUM)

  @tf.function
  def run():
    for _ in tf.range(6):
      optional = iterator.get_next_as_optional()
      if not optional.has_value():
        break
      repl.run(lambda x: total.assign_add(tf.reduce_sum(x)), inputs=optional.get_value())

  run()  # 4 batches: the fifth pass breaks
  assert int(total.read_value()) == sum(range(8))


def test_nested_output(repl):
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([0, 1, 2, 3]).batch(2)))

  @tf.function
  def run():
    out = repl.run(lambda x: [{"a": x - 1, "b": x + 1}], inputs=next(iterator))
    return tf.nest.map_structure(lambda v: v.values, out)  # a PerReplica is one leaf of tf.nest

  results = run()
  assert [np.asarray(v).tolist() for v in results[0]["a"]] == [[-1], [0]]
  assert [np.asarray(v).tolist() for v in results[0]["b"]] == [[1], [2]]


def test_dataset_iteration_in_function(repl):
  with repl.context():
    a = tf.Variable(1.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
  dist = repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0, 6.0, 7.0, 8.0]).batch(2))

  @tf.function
  def f(dist):
    n, p = 0.0, 2.0
    for x in dist:
      n += 1.0
      p *= repl.reduce(tf.distribute.ReduceOp.MEAN, x, axis=0)
    for y in dist:
      repl.run(lambda _: a.assign_add(1.0), inputs=y)
    return n, p

  n, p = f(dist)
  assert float(n) == 2.0 and abs(float(p) - 2 * 5.5 * 7.5) < 1e-3 and float(a.read_value()) == 3.0


def test_dataset_assert_with_dynamic_batch(repl):
  # GitHub issue 33517 in TensorFlow: an assertion in a step whose last batch is partial.
  dist = repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0, 6.0, 7.0]).batch(2))

  def step(d):
    with tf.control_dependencies([tf.debugging.Assert(tf.reduce_max(d) <= 100.0, [d])]):
      return tf.square(d)

  @tf.function
  def train(dist):
    iterator = iter(dist)
    return [repl.run(step, inputs=next(iterator)).values for _ in range(2)]

  assert [[np.asarray(v).tolist() for v in step_values] for step_values in train(dist)] == [
      [[25.0], [36.0]], [[49.0], []]]


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_dynamic_shapes(repl, where):
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0, 6.0, 7.0]).batch(4)))
  if where == "inside":
    run = tf.function(lambda: repl.run(tf.reduce_mean, inputs=next(iterator)).values)
    assert [float(v) for v in run()] == [5.5, 7.0]
  else:  # next() from Python, the PerReplica of parts of different sizes passed in
    run = tf.function(lambda x: repl.run(tf.size, inputs=x).values)
    assert [int(v) for v in run(next(iterator))] == [2, 1]


def test_dynamic_outputs_with_int64(repl):
  dataset = tf.data.Dataset.from_tensor_slices([5]).map(lambda x: tf.cast(x, tf.int64)).batch(2)
  iterator = iter(repl.distribute_dataset(dataset))
  run = tf.function(lambda: repl.run(lambda x: x + x, inputs=next(iterator)).values)
  assert [np.asarray(v).tolist() for v in run()] == [[10], []]


@pytest.mark.parametrize("rows, expected", [([5.0, 6.0, 7.0], 6.0), ([[1.0, 1.0]] * 3, [1.0, 1.0])])
def test_strategy_reduce_with_dynamic_shapes(repl, rows, expected):
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.from_tensor_slices(rows).batch(4)))
  run = tf.function(lambda: repl.reduce(tf.distribute.ReduceOp.MEAN, next(iterator), axis=0))
  np.testing.assert_allclose(run(), expected)


def test_a_partial_batch_with_mixed_outputs(repl):
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0]).batch(2)))
  run = tf.function(lambda: repl.run(lambda x: (tf.zeros([3]), tf.square(x)), inputs=next(iterator)))
  zeros, squares = run()
  assert _values(zeros) == [[0.0, 0.0, 0.0]] * 2 and _values(squares) == [[25.0], []]


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_iteration_inside_and_outside_the_function(repl, where):
  dist = repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0, 6.0, 7.0, 8.0]).batch(2))
  step = tf.function(lambda x: repl.run(tf.square, inputs=x).values)
  if where == "inside":

    @tf.function
    def train(dist):
      iterator = iter(dist)
      return [repl.run(tf.square, inputs=next(iterator)).values for _ in range(2)]

    results = train(dist)
  else:
    iterator = iter(dist)
    results = [step(next(iterator)) for _ in range(2)]
  assert [[float(v[0]) for v in r] for r in results] == [[25.0, 36.0], [49.0, 64.0]]


def test_multi_device_data_captured_function(repl):
  with repl.context():
    var = tf.Variable(1.0)
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([2.0, 3.0]).repeat(5).batch(2)))

  @tf.function
  def run():
    out = repl.run(lambda x: tf.square(x) + var, inputs=next(iterator))
    mean = repl.reduce(tf.distribute.ReduceOp.MEAN, out, axis=None)
    for _ in tf.range(1):
      out = repl.run(lambda x: tf.square(x) + var, inputs=next(iterator))
      mean = repl.reduce(tf.distribute.ReduceOp.MEAN, out, axis=None)
    return mean

  np.testing.assert_allclose(run(), [7.5])  # ((2*2 + 1) + (3*3 + 1)) / 2


def test_dataset_out_of_range(repl):
  with repl.context():
    a = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM)
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0, 6.0, 7.0, 8.0]).batch(2)))

  @tf.function
  def f(iterator):
    repl.run(lambda v: a.assign_add(tf.reduce_sum(v)), inputs=next(iterator))
    return a.read_value()

  with pytest.raises(tf.errors.OutOfRangeError):
    for _ in range(100):
      f(iterator)
  assert float(a.read_value()) == 26.0
