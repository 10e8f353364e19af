"""Replicated variables: creation, reads and writes per replica, placement."""

import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator


@pytest.fixture
def repl():
  return replicator.Replicator(cpus(4))


def test_components_identical_and_placed(repl):
  with repl.context():
    v = tf.Variable(tf.random.normal([3, 2]))  # evaluated once: identical components
  assert isinstance(v, replicator.ReplicatedVariable) and isinstance(v, tf.Variable)
  assert [c.device.rsplit("/", 1)[1] for c in v.components] == [f"device:CPU:{i}" for i in range(4)]
  for c in v.components[1:]:
    np.testing.assert_array_equal(c.numpy(), v.components[0].numpy())
  assert v.shape == (3, 2) and v.dtype == tf.float32 and v.trainable


def test_keras_initializers_identical(repl):
  with repl.context():
    layer = keras.layers.Dense(8)
    layer.build((None, 5))
  kernel = layer.kernel.value
  assert isinstance(kernel, replicator.ReplicatedVariable)
  for c in kernel.components[1:]:
    np.testing.assert_array_equal(c.numpy(), kernel.components[0].numpy())


def test_reads_and_writes_outside_a_step(repl):
  with repl.context():
    v = tf.Variable([1.0, 2.0])
  np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
  np.testing.assert_array_equal((v + 1).numpy(), [2.0, 3.0])
  np.testing.assert_array_equal(np.asarray(v), [1.0, 2.0])
  v.assign([5.0, 6.0])  # outside a step: every component
  v.assign_add([1.0, 1.0])
  v.scatter_update(tf.IndexedSlices(tf.constant([0.0]), tf.constant([0])))
  for c in v.components:
    np.testing.assert_array_equal(c.numpy(), [0.0, 7.0])
  assert "ReplicatedVariable" in repr(v) and "replicas=4" in repr(v)


def test_each_replica_reads_and_writes_its_component(repl):
  with repl.context():
    v = tf.Variable(0.0)

  def step_fn():
    v.assign_add(float(repl.replica_id))  # a per-replica write (no collective)
    return v.read_value(), v.device

  out = repl.run(lambda: step_fn()[0])
  assert [float(x) for x in out] == [0.0, 1.0, 2.0, 3.0]
  assert [c.numpy() for c in v.components] == [0.0, 1.0, 2.0, 3.0]


def test_variables_created_in_the_first_step_are_replicated(repl):
  holder = []

  def step_fn():
    if not holder:
      holder.append(tf.Variable(lambda: tf.ones([2])))  # callable: evaluated once, eagerly
    holder[0].assign_add(tf.ones([2]))
    return holder[0].read_value()

  repl.run(step_fn)
  out = repl.run(step_fn)
  assert isinstance(holder[0], replicator.ReplicatedVariable)
  assert [x.numpy().tolist() for x in out] == [[3.0, 3.0]] * 4


def test_tf_module_collects_replicated_variables(repl):
  class M(tf.Module):
    def __init__(self):
      super().__init__()
      self.w = tf.Variable(1.0)
      self.frozen = tf.Variable(2.0, trainable=False)

  with repl.context():
    m = M()
  assert len(m.trainable_variables) == 1 and len(m.variables) == 2


def test_gradient_tape_sees_the_replica_component(repl):
  with repl.context():
    w = tf.Variable([1.0, 2.0])

  def step_fn():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(w * float(repl.replica_id + 1))
    return tape.gradient(loss, w)

  out = repl.run(step_fn)
  for r in range(4):
    np.testing.assert_allclose(out[r].numpy(), [r + 1.0, r + 1.0])


def test_variables_outside_context_are_not_replicated(repl):
  plain = tf.Variable(1.0)
  assert not isinstance(plain, replicator.ReplicatedVariable)


def test_set_owner_reads_the_owners_component():
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    v = tf.Variable(np.zeros(3, np.float32))
  for i, c in enumerate(v.components):
    c.assign(np.full(3, float(i), np.float32))
  np.testing.assert_array_equal(v.numpy(), [0, 0, 0])
  v.set_owner(2, ("replica",))
  np.testing.assert_array_equal(v.numpy(), [2, 2, 2])
  np.testing.assert_array_equal(tf.convert_to_tensor(v).numpy(), [2, 2, 2])
  path = tf.train.Checkpoint(v=v).write(os.path.join(tempfile.mkdtemp(), "ckpt"))
  np.testing.assert_array_equal(tf.train.load_variable(path, "v/.ATTRIBUTES/VARIABLE_VALUE"), [2, 2, 2])
  v.assign(np.ones(3, np.float32))  # writes still go to every component
  assert all(np.array_equal(c.numpy(), [1, 1, 1]) for c in v.components)


def test_set_owner_of_a_sharded_variable_assembles_from_the_owners():
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, cpus(4)))
  with repl.context(layouts={"w": ("model",)}):
    w = tf.Variable(np.zeros(4, np.float32), name="w")
  for i, c in enumerate(w.components):  # device i = (batch i // 2, model i % 2)
    c.assign(np.full(2, float(i), np.float32))
  np.testing.assert_array_equal(w.numpy(), [0, 0, 1, 1])  # batch row 0
  w.set_owner(1, ("batch",))
  np.testing.assert_array_equal(w.numpy(), [2, 2, 3, 3])  # batch row 1


def test_python_scalars_of_a_replicated_variable():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    optimizer = keras.optimizers.Adam(0.1)
    v = tf.Variable(2.5)
  assert int(optimizer.iterations) == 0  # Keras's Variable.__int__ reads its ReplicatedVariable
  assert float(v) == 2.5 and int(v) == 2


def test_bytes_per_device_counts_plain_keras_and_tf_variables():
  # A Keras 3 variable made outside every Replicator (its dtype is a string) lives whole on one device.
  with tf.device("/device:CPU:0"):
    layer = keras.layers.Dense(16)
    layer.build((None, 8))
    plain = tf.Variable(tf.zeros([3], tf.float64))
  assert replicator.bytes_per_device(layer.weights + [plain]) == {"/device:CPU:0": (8 * 16 + 16) * 4 + 3 * 8}


def test_the_unique_id_keras_optimizers_key_slots_by_stays_when_the_components_are_replaced():
  # A pipeline's placement replaces a variable's components (new ones on its stage's devices); a Keras optimizer
  # built before (Keras's fit builds it before the first step) finds its slots by the variable's _unique_id.
  from replicator.state import _variables  # pylint: disable=import-outside-toplevel
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)))
  with repl.context():
    v = tf.Variable([1.0, 2.0])
  before, components = v._unique_id, v.components  # pylint: disable=protected-access
  assert _variables.place(v, ("stage",), (1,))
  assert len(v.components) == 1 and v.components[0] is not components[1]  # (a new variable on CPU:1)
  assert v._unique_id == before  # pylint: disable=protected-access


def test_a_summed_on_read_variable_made_like_a_placed_one_lives_and_moves_with_it_keeping_its_total():
  # A gradient accumulator of wrap_optimizer (on read, summed) made like a variable placed on stage 1 of
  # {"stage": 2, "batch": 2}: on stage 1's two devices; a total written from outside a step reads back whole (kept on
  # its first holder, not on replica 0, which does not hold it); moved with its variable to stage 0, then to every
  # device, it keeps its total, exactly. An on-read variable made like nothing stays where it is.
  from replicator.state import _variables  # pylint: disable=import-outside-toplevel
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2, "batch": 2}, devices=cpus(4)))
  with repl.context():
    v = tf.Variable([1.0, 2.0])
    metric = tf.Variable([0.0, 0.0], synchronization=tf.VariableSynchronization.ON_READ,
                         aggregation=tf.VariableAggregation.SUM)
  assert _variables.place(v, ("stage",), (1,))
  with repl.context(), _variables.reference_scope(v):
    acc = tf.Variable(tf.zeros([2]), synchronization=tf.VariableSynchronization.ON_READ,
                      aggregation=tf.VariableAggregation.SUM)
  stage = {s: [mesh.canonical_name(d) for r, d in enumerate(cpus(4)) if repl.mesh.axis_index(r, ("stage",)) == s]
           for s in (0, 1)}
  assert [mesh.canonical_name(c.device) for c in acc.components] == stage[1]
  acc.assign([3.0, 4.0])
  np.testing.assert_array_equal(acc.numpy(), [3.0, 4.0])
  acc.assign_add([1.0, 1.0])
  np.testing.assert_array_equal(acc.numpy(), [4.0, 5.0])
  assert _variables.place(v, ("stage",), (0,))
  assert [mesh.canonical_name(c.device) for c in acc.components] == stage[0]
  np.testing.assert_array_equal(acc.numpy(), [4.0, 5.0])
  assert _variables.place(v, ("stage",), (0, 1))
  assert len(acc.components) == 4 and _variables.placement_of(acc) is None
  np.testing.assert_array_equal(acc.numpy(), [4.0, 5.0])
  assert len(metric.components) == 4 and not metric.place(("stage",), (1,))
