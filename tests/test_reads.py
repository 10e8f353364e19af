"""Tests for rewrite._reads: a step's reads that no execution could tell apart are one read."""

import collections

import keras
import numpy as np
import tensorflow as tf
from conftest import cpus

import replicator
import rewrite
from replicator.state import _variables


def _reads(graph_def):
  return [n for n in graph_def.node if n.op == "ReadVariableOp"]


def _run(graph_def, handle_name, handle, outputs):
  @tf.function(autograph=False)
  def call():
    return tf.graph_util.import_graph_def(graph_def, input_map={handle_name: tf.identity(handle)},
                                         return_elements=outputs)

  return [t.numpy() for t in call()]


def test_reads_between_the_same_writes_are_merged_and_a_read_after_a_write_is_not():
  v = tf.Variable(3.0)

  @tf.function(autograph=False)
  def step():
    a = v + 1.0  # read 1
    b = v * 2.0  # read 2: the same inputs as read 1
    with tf.control_dependencies([a, b]):
      v.assign(10.0)
    c = v * 1.0  # read 3: waits for the write (automatic control dependencies)
    return a, b, c

  concrete = step.get_concrete_function()
  graph_def = concrete.graph.as_graph_def()
  (handle_name,) = [internal.name for _, internal in concrete.graph.captures]
  outputs = [t.name for t in concrete.graph.outputs]
  assert len(_reads(graph_def)) == 3
  merged = rewrite.merge_reads(graph_def, lambda name: True)
  assert len(merged) == 1 and len(_reads(graph_def)) == 2
  (kept,) = set(merged.values())
  assert kept in {n.name for n in _reads(graph_def)}
  got = _run(graph_def, handle_name, v.handle, [rewrite.renamed_tensor(o, merged) for o in outputs])
  np.testing.assert_array_equal(got, [4.0, 6.0, 10.0])  # the read after the write sees the new value
  assert float(v.numpy()) == 10.0


def test_colocation_with_a_removed_read_follows_the_kept_read_and_outputs_are_renamed():
  v = tf.Variable([1.0, 2.0])

  @tf.function(autograph=False)
  def step():
    first = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)
    second = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)
    with tf.compat.v1.colocate_with(second.op):
      doubled = second * 2.0
    return first, second, doubled

  concrete = step.get_concrete_function()
  graph_def = concrete.graph.as_graph_def()
  (handle_name,) = [internal.name for _, internal in concrete.graph.captures]
  second = concrete.graph.outputs[1].op.inputs[0].op.name  # the second read (through the output's Identity)
  merged = rewrite.merge_reads(graph_def, lambda name: True)
  assert list(merged) == [second]
  (colocated,) = [n for n in graph_def.node if n.op == "Mul"]
  assert list(colocated.attr["_class"].list.s) == [f"loc:@{merged[second]}".encode()]
  assert rewrite.renamed_tensor(f"{second}:0", merged) == f"{merged[second]}:0"
  assert rewrite.renamed_tensor(f"^{second}", merged) == f"^{merged[second]}"
  got = _run(graph_def, handle_name, v.handle, [t.name for t in concrete.graph.outputs])
  np.testing.assert_array_equal(got, [[1.0, 2.0], [1.0, 2.0], [2.0, 4.0]])


def test_reads_on_other_devices_or_as_other_dtypes_are_kept_apart():
  graph = tf.Graph()
  with graph.as_default():
    handle = tf.compat.v1.placeholder(tf.resource, [], name="handle")
    for i, device in enumerate(["/device:CPU:0", "/device:CPU:0", "/device:CPU:1"]):
      with tf.device(device):
        tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32, name=f"read_{i}")
    tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float64, name="read_f64")
  graph_def = graph.as_graph_def()
  assert rewrite.merge_reads(graph_def, lambda name: True) == {"read_1": "read_0"}
  assert sorted(n.name for n in _reads(graph_def)) == ["read_0", "read_2", "read_f64"]


def test_a_keras_adam_step_reads_its_counter_once_a_device_and_equals_one_device():
  # Keras's Adam reads the step counter and the learning rate for every variable it updates; each device's
  # step keeps one read of each (with a float32 truth from one device: the folded scalar chains are the same).
  n, widths = 4, (16, 16, 3)
  x = np.random.RandomState(1).randn(8, 6).astype(np.float32)

  def train(repl):
    with repl.context() if repl else tf.device("/cpu:0"):
      keras.utils.set_random_seed(0)
      model = keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(w, activation="tanh") for w in widths])
      base = keras.optimizers.Adam(0.05)
      optimizer = repl.wrap_optimizer(base) if repl else base

    def step(x):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
      optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
      return loss

    for _ in range(3):
      if repl is None:
        tf.function(step)(x)
      else:
        repl.run(step, inputs=replicator.PerReplica(np.split(x, n)))
    return model, base, step

  model_1, base_1, _ = train(None)
  repl = replicator.Replicator(cpus(n))
  model, base, step = train(repl)
  for got, want in zip(model.trainable_variables + base.variables,
                       model_1.trainable_variables + base_1.variables):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5, atol=2e-6)
  compiled, _ = repl._views["local"].step(step, None, replicator.PerReplica(np.split(x, n)))  # pylint: disable=protected-access
  alike = collections.Counter((tuple(n.input), n.device) for n in _reads(compiled.graph_def))
  for node in _reads(compiled.graph_def):
    if alike[(tuple(node.input), node.device)] > 1:  # left apart: a weight (see test_only_small_reads_merge)
      handle = node.input[0] if ":" in node.input[0] else node.input[0] + ":0"
      assert _variables.component_of(compiled.captures._values[handle]).shape.rank  # pylint: disable=protected-access
  counter = {id(c) for c in _variables.underlying(base.iterations).components}
  counter_reads = 0
  for node in _reads(compiled.graph_def):
    handle = node.input[0] if ":" in node.input[0] else node.input[0] + ":0"
    counter_reads += id(_variables.component_of(compiled.captures._values.get(handle))) in counter  # pylint: disable=protected-access
  assert counter_reads == n  # 3 variables x 2 (kernel, bias) reads a device before the merge


def test_only_small_reads_merge_a_weight_read_twice_is_read_twice():
  # A merged read of a weight would live from the forward pass to the update, and the update's in-place write
  # would copy the weight first (the global view's 2x2 MLP: 1.11 of the unmerged step).
  small, large = tf.Variable(2.0), tf.Variable(tf.ones([rewrite._reads.SMALL + 1]))  # pylint: disable=protected-access

  @tf.function(autograph=False)
  def step():
    return small * 1.0, small * 2.0, large * 1.0, large * 2.0

  concrete = step.get_concrete_function()
  graph_def = concrete.graph.as_graph_def()
  ops = {op.name: op for op in concrete.graph.get_operations()}
  merged = rewrite.merge_reads(graph_def, rewrite.small_reads(ops.get))
  assert len(merged) == 1 and len(_reads(graph_def)) == 3
  (removed,) = merged
  assert ops[removed].outputs[0].shape.rank == 0
  assert not rewrite.merge_reads(graph_def, rewrite.small_reads(lambda name: None))  # unknown ops: kept apart
