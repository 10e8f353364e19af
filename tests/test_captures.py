"""Captured handles are stacked per device: fewer inputs per call, same values and updates."""

import types

import keras
import numpy as np
import tensorflow as tf

import mesh
import replicator
from replicator.views import _captures
from tests.conftest import cpus


def _variables(devices, per_device):
  out = []
  for d, device in enumerate(devices):
    with tf.device(device):
      out.extend(tf.Variable(np.full([2, 3], 10.0 * d + i, np.float32)) for i in range(per_device))
  return out


def _run_through(captures: _captures.Captures, variables):
  """Reads every variable through ``captures`` inside a function, then adds 1 to each."""
  names = [f"v{i}" for i in range(len(variables))]

  @tf.function(autograph=False)
  def f():
    mapping = captures.input_map()
    reads = []
    for name, v in zip(names, variables):
      with tf.device(v.device):
        reads.append(tf.raw_ops.ReadVariableOp(resource=mapping[name], dtype=tf.float32))
        with tf.control_dependencies([reads[-1]]):
          tf.raw_ops.AssignAddVariableOp(resource=mapping[name], value=tf.ones([2, 3]))
    return reads

  return [r.numpy() for r in f()]


def test_handles_on_one_device_become_one_input():
  variables = _variables(cpus(4), per_device=5)
  captures = _captures.Captures([(f"v{i}", v.handle) for i, v in enumerate(variables)])
  assert captures.num_inputs == 4
  expected = [v.numpy() for v in variables]
  np.testing.assert_array_equal(_run_through(captures, variables), expected)
  # The assignments went to the right variables (each on its own device).
  np.testing.assert_array_equal([v.numpy() for v in variables], [e + 1 for e in expected])
  assert [v.device for v in variables] == [v.handle.device for v in variables]


def test_other_captures_are_fed_directly():
  variables = _variables(cpus(2), per_device=1)  # one handle per device: nothing to stack
  constant = tf.constant(3.0)
  captures = _captures.Captures([("v0", variables[0].handle), ("v1", variables[1].handle), ("c", constant)])
  assert captures.num_inputs == 3
  assert not captures.stacks
  assert sorted(name for name, _ in captures.direct) == ["c", "v0", "v1"]


def test_only_cpu_handles_are_stacked():
  gpu_handle = types.SimpleNamespace(dtype=tf.resource, shape=tf.TensorShape([]),
                                     device="/job:localhost/replica:0/task:0/device:GPU:0")
  assert not _captures._stackable(gpu_handle)  # pylint: disable=protected-access
  assert _captures._stackable(_variables(cpus(1), 1)[0].handle)  # pylint: disable=protected-access


def test_a_replicated_step_passes_one_handle_tensor_per_device():
  devices = cpus(4)
  repl = replicator.Replicator(devices=devices)
  keras.utils.set_random_seed(0)
  x = np.random.RandomState(0).randn(8, 5).astype(np.float32)
  with repl.context():
    model = keras.Sequential([keras.Input([5]), keras.layers.Dense(4), keras.layers.Dense(3)])
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.1))
  reference = keras.models.clone_model(model)
  reference.set_weights(model.get_weights())

  def step(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(batch) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  inputs = replicator.PerReplica([tf.constant(x[2 * r:2 * r + 2]) for r in range(4)])
  repl.run(step, inputs=inputs)
  compiled, _ = repl._views["local"].step(step, None, inputs)  # pylint: disable=protected-access
  # 4 variables x 4 replicas (+ the optimizer's own state) captured, 4 passed.
  fed = compiled.captures
  assert len(fed.direct) + sum(len(names) for _, names, _ in fed.stacks) >= 16
  assert fed.num_inputs == len(devices)

  # The update is the one-device update on the global batch.
  ref_optimizer = keras.optimizers.SGD(0.1)
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(reference(x) ** 2)
  ref_optimizer.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_reads_of_stacked_handles_keep_their_variables_shapes_in_the_global_view():
  # A handle taken out of a stack carries no shape in the function's graph, so its reads and every op after them were
  # of unknown shape, which Grappler does not rewrite: a KerasHub Qwen step on 2x2 kept `Pow(x, 1)` in its layer
  # norms' gradients (3,018 of 7,095 ops unshaped; 1.60 of one device's step time, 1.39 with the shapes). The local
  # view's steps did not run faster with the shapes (deep MLP, transformer, ResNet) and leave them out. Only the
  # trainable variables' reads are checked: the slots' checks cost build time and no step time.
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)), view="global",
                               layouts={"d0/kernel": (None, "model"), "d1/kernel": ("model", None)})
  with repl.context():
    model = keras.Sequential([keras.Input([5]), keras.layers.Dense(4, name="d0"), keras.layers.Dense(3, name="d1")])
    optimizer = keras.optimizers.Adam(0.1)

  def step(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(batch) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  repl.run(step, tf.data.Dataset.from_tensors(tf.ones([4, 5])))
  (built,) = [s for by_spec in repl._views["global"].steps.values() for variants in by_spec.values()  # pylint: disable=protected-access
              for s in variants.values()]
  assert built.captures.stacks
  (function,) = built.functions.values()
  graph = function.graph
  reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
  assert len(reads) > 16
  # The model's forward and backward pass are shaped; the optimizer's reads of its slots and counter are not
  # checked (elementwise updates, rewritten alike with shapes or without).
  unchecked = [op for op in reads if not any(use.type == "EnsureShape" for use in op.outputs[0].consumers())]
  after_unchecked, stack = set(), list(unchecked)
  while stack:
    for t in stack.pop().outputs:
      for use in t.consumers():
        if use not in after_unchecked:
          after_unchecked.add(use)
          stack.append(use)
  assert unchecked and not [op.name for op in after_unchecked if "/sequential" in op.name]
  unshaped = [op.name for op in graph.get_operations() if op.name.startswith("step/") and op.type != "ReadVariableOp"
              and op not in after_unchecked
              for t in op.outputs if t.dtype != tf.resource and not t.shape.is_fully_defined()]  # a read's check is
  assert not unshaped, unshaped[:5]
  assert any("/sequential" in op.name for op in graph.get_operations() if op.type == "MatMul")
  shapes = {tuple(use.outputs[0].shape.as_list()) for op in reads for use in op.outputs[0].consumers()
            if use.type == "EnsureShape"}
  assert shapes == {(5, 2), (4,), (2, 3), (3,)}  # the kernels' pieces and the biases
  checks = [op for op in graph.get_operations() if op.type == "EnsureShape" and op.name.startswith("step/")]
  assert len(checks) >= 8
  # Each check runs where its read does: an unplaced check went to the default device, and every read of
  # another device's variable crossed devices twice (0.71 of MirroredStrategy's deep-MLP step, 0.54 after).
  for check in checks:
    assert check.colocation_groups() == check.inputs[0].op.colocation_groups(), check.name
