"""All-or-nothing by order (``replicator/guarantees/_ordered_writes.py``): writes wait for the ops that can fail.

The reference is the state before a failed call, every component of every
variable; and, where nothing needs keeping, the step's own kept list: a step
whose writes can all wait keeps no copy (its cost is the step's alone).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import replicator
from replicator.guarantees import _ordered_writes
from replicator.state import _variables


def _op(fn, *specs):
  graph = tf.function(fn, autograph=False).get_concrete_function(*specs).graph
  return [op for op in graph.get_operations() if op.type not in ("Placeholder", "Identity", "NoOp")][-1]


@pytest.mark.parametrize("fn, specs, fails", [
    (lambda a, b: a @ b, [tf.TensorSpec([2, 3]), tf.TensorSpec([3, 4])], False),
    (lambda a, b: a @ b, [tf.TensorSpec([None, 3]), tf.TensorSpec([3, 4])], True),  # shapes checked at run time
    (lambda a, b: a // b, [tf.TensorSpec([2], tf.int32), tf.TensorSpec([2], tf.int32)], True),  # by zero
    (lambda a, b: a // b, [tf.TensorSpec([2]), tf.TensorSpec([2])], False),
    (lambda a, i: tf.gather(a, i), [tf.TensorSpec([5, 2]), tf.TensorSpec([3], tf.int32)], True),  # out of range
    (lambda a: tf.debugging.check_numerics(a, "x"), [tf.TensorSpec([2])], True),
    (lambda a, i: a[i], [tf.TensorSpec([5]), tf.TensorSpec([], tf.int32)], True),  # a computed bound
    (lambda a: a[1:3], [tf.TensorSpec([5])], False),
    (lambda a: tf.reduce_mean(tf.nn.relu(a), axis=0), [tf.TensorSpec([4, 3])], False),
    (lambda a: tf.argmax(a, axis=0), [tf.TensorSpec([4, 3])], False),
    (lambda a: tf.argmax(a, axis=0), [tf.TensorSpec([0, 3])], True),  # an empty axis
])
def test_which_ops_can_fail(fn, specs, fails):
  assert _ordered_writes.can_fail(_op(fn, *specs)) is fails


def _kept(repl, step_fn, dataset):
  compiled, _ = repl._views["local"].step(step_fn, dataset, None)  # pylint: disable=protected-access
  return compiled.snapshot.kept


def _state(variables):
  return [[c.numpy() for c in _variables.underlying(v).components] for v in variables]


def _assert_same(before, after):
  for i, (b, a) in enumerate(zip(before, after)):
    for device, (x, y) in enumerate(zip(b, a)):
      np.testing.assert_array_equal(x, y, err_msg=f"variable {i} on device {device}")


def test_an_embedding_step_keeps_no_copy_and_an_out_of_range_token_writes_nothing():
  # Keeping the table for all-or-nothing copied it and both of Adam's slots every step (50k x 128: 1.23 of
  # atomic=False's step); the updates wait for the lookups, which is where a bad token fails.
  repl = replicator.Replicator(devices=cpus(4))
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.1))

  def step(batch):
    tokens, labels = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, model(tokens), from_logits=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  tokens = np.random.RandomState(0).randint(0, 50, (24, 6)).astype(np.int32)
  tokens[13, 2] = 99  # the second batch, on the third replica
  labels = np.random.RandomState(1).randint(0, 2, (24,)).astype(np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(8, drop_remainder=True)
  repl.run(step, dataset)
  assert _kept(repl, step, dataset) is None
  variables = model.variables + optimizer.variables
  before = _state(variables)
  with pytest.raises(replicator.StepFailedError, match=r"No variable was written"):
    repl.run(step, dataset)
  _assert_same(before, _state(variables))
  repl.run(step, dataset)
  assert int(optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("view", ["local", "global"])
def test_a_check_of_the_new_values_keeps_them_and_a_failure_restores_them(view):
  # A write before an op that reads what it wrote and can fail cannot wait for it: that variable is kept.
  repl = replicator.Replicator(devices=cpus(4), view=view)
  with repl.context():
    weights = tf.Variable(tf.ones([4]))
    seen = tf.Variable(0.0, trainable=False)
    limit = tf.Variable(100.0, trainable=False)

  def step(x):
    seen.assign_add(1.0)  # waits for the check: nothing reads it after
    weights.assign_add(tf.ones([4]))
    tf.debugging.assert_less(tf.reduce_sum(weights), limit, message="weights too large")
    return tf.reduce_sum(weights) + tf.reduce_sum(x)

  dataset = tf.data.Dataset.from_tensors(tf.ones([8])).repeat()
  repl.run(step, dataset)
  if view == "local":
    kept = _kept(repl, step, dataset)
    assert kept is not None and len(kept._group_of) == 4  # pylint: disable=protected-access  (the weights' copies)
  limit.assign(0.0)
  before = _state([weights, seen])
  with pytest.raises(replicator.StepFailedError, match="weights too large"):
    repl.run(step, dataset)
  _assert_same(before, _state([weights, seen]))
  limit.assign(100.0)
  repl.run(step, dataset)
  np.testing.assert_array_equal(tf.convert_to_tensor(weights).numpy(), np.full([4], 3.0))
  assert float(tf.convert_to_tensor(seen).numpy()) == 2.0


def _ancestors(nodes: dict, name: str) -> set[str]:
  """The names of the nodes ``name`` depends on (data and control inputs) in one function's ``nodes``."""
  seen, frontier = set(), [name]
  while frontier:
    for ref in nodes[frontier.pop()].input:
      parent = ref.lstrip("^").split(":")[0]
      if parent in nodes and parent not in seen:
        seen.add(parent)
        frontier.append(parent)
  return seen


def test_a_write_that_needs_no_input_waits_for_the_input():
  # The counter's update reads no input: it must still wait for the step's inputs, whose ops (taking the
  # batch from the iterator, splitting it) run in the same call and may fail there (a global batch whose
  # parts do not match: 8 rows of x, 7 of y).
  repl = replicator.Replicator(devices=cpus(2))
  with repl.context():
    counter = tf.Variable(0, trainable=False)

  def step(batch):
    counter.assign_add(1)
    return batch  # no op of the step reads the input: only the wait for the inputs orders the write

  def rows():
    yield tf.ones([8]), tf.ones([8])
    while True:
      yield tf.ones([8]), tf.ones([7])

  spec = tf.TensorSpec([None], tf.float32)
  dataset = tf.data.Dataset.from_generator(rows, output_signature=(spec, spec))
  repl.run(step, dataset)
  compiled, _ = repl._views["local"].step(step, dataset, None)  # pylint: disable=protected-access
  graph_def = compiled._build(1, False).graph.as_graph_def()  # pylint: disable=protected-access
  (body,) = [f for f in [graph_def.node] + [f.node_def for f in graph_def.library.function]
             if any(n.op == "AssignAddVariableOp" for n in f)]  # the function's, or a branch's if it has one
  nodes = {node.name: node for node in body}
  writes = [name for name, node in nodes.items() if node.op == "AssignAddVariableOp"]
  assert len(writes) == 2
  for write in writes:
    waits_for = {nodes[name].op for name in _ancestors(nodes, write)}
    assert {"IteratorGetNext", "SplitV"} <= waits_for, write
  for _ in range(3):
    with pytest.raises(replicator.StepFailedError, match="No variable was written"):
      repl.run(step, dataset)
    assert [int(c.numpy()) for c in _variables.underlying(counter).components] == [1, 1]
