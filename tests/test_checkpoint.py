"""tf.train.Checkpoint with replicated models: one copy stored, any replica count restores."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import replica_values

import mesh
import replicator

X = np.random.RandomState(0).randn(16, 3).astype(np.float32)


def make():
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)])
  return model, keras.optimizers.Adam(0.05)


def loss_fn(model, x):
  return tf.reduce_mean(tf.square(model(x)))


def replicated(n):
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    model, base = make()
    opt = repl.wrap_optimizer(base)

  def step_fn(x):
    with tf.GradientTape() as tape:
      loss = loss_fn(model, x)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  def train(steps):
    shards = replicator.PerReplica(np.split(X, n))
    for _ in range(steps):
      repl.run(step_fn, inputs=shards)

  return model, opt, train


def single():
  model, opt = make()

  def train(steps):
    for _ in range(steps):
      with tf.GradientTape() as tape:
        loss = loss_fn(model, X)
      opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  return model, opt, train


def values(model, opt):
  inner = getattr(opt, "optimizer", opt)
  return [v.numpy() for v in model.trainable_variables] + [v.numpy() for v in inner.variables]


def assert_all_components_equal(model, opt, want):
  """Weights: every component. Optimizer state: the value read (under the default sharded
  update each slot is kept current only on its owner)."""
  inner = getattr(opt, "optimizer", opt)
  weights = [v.value for v in model.trainable_variables]
  for var, expected in zip(weights, want, strict=False):
    for component in var.components:
      np.testing.assert_allclose(component.numpy(), expected, atol=1e-6)
  state = [v.numpy() for v in inner.variables]
  assert len(weights) + len(state) == len(want)
  for got, expected in zip(state, want[len(weights):]):
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_replicated_to_single_to_other_replica_count(tmp_path):
  model, opt, train = replicated(4)
  train(3)
  saved = values(model, opt)
  path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "four"))

  keras.backend.clear_session()
  plain_model, plain_opt, plain_train = single()
  plain_opt.build(plain_model.trainable_variables)
  tf.train.Checkpoint(model=plain_model, optimizer=plain_opt).read(path).assert_consumed()
  for got, want in zip(values(plain_model, plain_opt), saved, strict=True):
    np.testing.assert_allclose(got, want, atol=1e-7)
  plain_train(2)  # training continues from the restored optimizer state
  path = tf.train.Checkpoint(model=plain_model, optimizer=plain_opt).write(str(tmp_path / "single"))

  keras.backend.clear_session()
  model2, opt2, train2 = replicated(2)
  opt2.build(model2.trainable_variables)
  tf.train.Checkpoint(model=model2, optimizer=opt2).read(path).assert_consumed()
  assert_all_components_equal(model2, opt2, values(plain_model, plain_opt))
  train2(1)
  plain_train(1)
  assert_all_components_equal(model2, opt2, values(plain_model, plain_opt))


def test_restore_before_optimizer_slots_exist(tmp_path):
  """Slots created lazily in the first step are restored when they appear."""
  model, opt, train = replicated(2)
  train(2)
  path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
  reference_model, reference_opt, reference_train = single()
  reference_opt.build(reference_model.trainable_variables)
  tf.train.Checkpoint(model=reference_model, optimizer=reference_opt).read(path).assert_consumed()
  reference_train(1)

  keras.backend.clear_session()
  model2, opt2, train2 = replicated(4)  # optimizer not built: no slots yet
  status = tf.train.Checkpoint(model=model2, optimizer=opt2).read(path)
  train2(1)
  status.assert_consumed()
  assert_all_components_equal(model2, opt2, values(reference_model, reference_opt))


def test_checkpoint_stores_one_copy_whatever_the_replica_count(tmp_path):
  sizes, contents = {}, {}
  for n in (1, 2, 4, 8):
    keras.backend.clear_session()
    model, opt, train = replicated(n)
    train(1)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / f"n{n}"))
    sizes[n] = os.path.getsize(path + ".data-00000-of-00001")
    contents[n] = tf.train.list_variables(path)
  keras.backend.clear_session()
  plain_model, plain_opt, plain_train = single()
  plain_train(1)
  plain = tf.train.list_variables(tf.train.Checkpoint(model=plain_model, optimizer=plain_opt).write(str(tmp_path / "plain")))
  assert len(set(sizes.values())) == 1, sizes  # bytes do not grow with n
  for n in sizes:
    assert contents[n] == plain  # the same variables, names and shapes as one device


def test_restore_updates_every_component_of_a_module(tmp_path):
  class Module(tf.Module):
    def __init__(self):
      super().__init__()
      self.w = tf.Variable([1.0, 2.0])

  plain = Module()
  plain.w.assign([5.0, 6.0])
  path = tf.train.Checkpoint(m=plain).write(str(tmp_path / "m"))
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    module = Module()
  tf.train.Checkpoint(m=module).read(path).assert_consumed()
  assert [c.numpy().tolist() for c in module.w.components] == [[5.0, 6.0]] * 4


# -- sharded variables: checkpoints hold global values --------------------------------


def _sharded_setup(shape, spec, seed_offset=0.0):
  """A variable plus Adam on a mesh (``shape`` None: one device), laid out by ``spec``."""
  import mesh
  value = tf.reshape(tf.range(32.0), [4, 8]) / 10.0 + seed_offset
  if shape is None:
    w = tf.Variable(value, name="w")
    return None, w, keras.optimizers.Adam(0.1)
  n = int(np.prod(list(shape.values())))
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(n)))
  with repl.context(layouts={"w": spec}):
    w = tf.Variable(value, name="w")
    opt = repl.wrap_optimizer(keras.optimizers.Adam(0.1))
  return repl, w, opt


def _sharded_train(repl, w, opt):
  def step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.sin(w))
      if repl is not None:  # each device sums its piece; the whole sum is over every axis
        loss = repl.all_sum(loss, axis=w.sharding.sharded_axes) if w.sharding else loss
    opt.apply_gradients([(tape.gradient(loss, w), w)])
  if repl is None:
    tf.function(step)()
  else:
    repl.run(step)


def test_sharded_checkpoint_restores_on_any_layout_mesh_or_one_device(tmp_path):
  repl, w, opt = _sharded_setup({"batch": 2, "model": 2}, ("batch", "model"))
  _sharded_train(repl, w, opt)
  _sharded_train(repl, w, opt)
  path = tf.train.Checkpoint(w=w, opt=opt).write(os.path.join(tmp_path, "ckpt"))
  saved_w = w.numpy()
  saved_slots = sorted((v.path.split("/")[-1], v.numpy()) for v in opt.optimizer.variables[2:])
  targets = [({"batch": 4, "model": 1}, (None, "model")),  # replicated along both
             ({"model": 4}, (None, "model")),  # another mesh, another layout
             ({"batch": 2, "model": 4}, ("model", "batch")),
             (None, None)]  # a single device
  for shape, spec in targets:
    other_repl, other_w, other_opt = _sharded_setup(shape, spec, seed_offset=5.0)
    _sharded_train(other_repl, other_w, other_opt)  # create the slots, then overwrite them all
    tf.train.Checkpoint(w=other_w, opt=other_opt).read(path).assert_consumed()
    np.testing.assert_array_equal(other_w.numpy(), saved_w, err_msg=str(shape))
    inner = other_opt.optimizer if other_repl is not None else other_opt
    slots = sorted((v.path.split("/")[-1], v.numpy()) for v in inner.variables[2:])
    for (name, a), (_, b) in zip(slots, saved_slots):
      np.testing.assert_array_equal(a, b, err_msg=f"{shape} {name}")
    # Training continues identically from the restored state.
    _sharded_train(other_repl, other_w, other_opt)
    if shape == targets[0][0]:
      _sharded_train(repl, w, opt)
      np.testing.assert_allclose(other_w.numpy(), w.numpy(), atol=1e-6)


@pytest.mark.parametrize("layouts", [None, {r"dense_\d+/kernel$": (None, "model")}], ids=["replicated", "sharded"])
def test_a_restore_that_fails_changes_no_variable(tmp_path, layouts):
  # Was: the first layer restored ([3.0, 3.0, ...]), then TensorFlow's ValueError at the second layer's kernel.
  def model(width, value):
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, kernel_initializer=keras.initializers.Constant(
        value), bias_initializer=keras.initializers.Constant(value)), keras.layers.Dense(
            width, kernel_initializer=keras.initializers.Constant(value))])

  saved = tf.train.Checkpoint(model=model(6, 3.0)).save(str(tmp_path / "ckpt"))
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)),
                               layouts=None if layouts is None else mesh.LayoutMap(layouts))
  with repl.context():
    target = model(2, 0.5)  # the second layer 2 wide: the checkpoint's is 6
  with pytest.raises(replicator.ArgumentError, match=(
      r"Restoring the checkpoint into '.*dense_\d+/kernel': it holds a float32 tensor of shape \[4, 6\], and the "
      r"variable is float32 of shape \[4, 2\]. The restore stopped there, and the 2 variable\(s\) this restore had "
      r"assigned before it \(.*dense_\d+/kernel, .*dense_\d+/bias\) hold their values from before the restore "
      r"again: a failed restore changes none of the Replicator's variables. Fix: restore into a model built like")):
    tf.train.Checkpoint(model=target).restore(saved)
  _every_copy_is(target, {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.0})  # as made (the second bias: zeros)
  # A restore that fits restores every variable (and the values kept to undo the failed one are gone).
  tf.train.Checkpoint(model=target).restore(tf.train.Checkpoint(model=model(2, 3.0)).save(str(tmp_path / "fits")))
  _every_copy_is(target, {0: 3.0, 1: 3.0, 2: 3.0, 3: 0.0})


def _every_copy_is(model, values):
  for i, variable in enumerate(model.weights):
    for copy in replica_values(variable):
      np.testing.assert_array_equal(copy, np.full_like(copy, values[i]), err_msg=variable.path)
