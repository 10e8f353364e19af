"""All-or-nothing steps (``replicator/guarantees/_atomic.py``): a call that fails writes no variable on any device.

The reference is the state before the failed call: every component of every
variable (weights, sharded pieces, Adam's slots, the iteration counter, a
random generator's state) must hold exactly its value from before. Failures are
injected where they tear state without the guarantee: an assertion after
``apply_gradients`` (every device fails after writing), ``check_numerics`` on one
batch shard only (some devices write, one fails), the third step of a
``steps=5`` loop. Outcomes depend on scheduling, so the calls repeat, also with
the CPUs loaded by other threads.
"""

import re
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus

import mesh
import replicator
from replicator.state import _variables

X = np.random.RandomState(0).rand(64, 8).astype(np.float32)
Y = np.random.RandomState(1).rand(64, 1).astype(np.float32)
LAYOUTS = {"d1/kernel": (None, "model"), "d2/kernel": ("model", None)}


def _dataset(x=X, y=Y):
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)


def _setup(view, atomic=True, shape=(2, 2)):
  m = mesh.Mesh({"batch": shape[0], "model": shape[1]}, devices=cpus(shape[0] * shape[1]))
  repl = replicator.Replicator(mesh=m, view=view, layouts=LAYOUTS if view == "global" else None, atomic=atomic)
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input([8]), keras.layers.Dense(16, name="d1"), keras.layers.Dense(1, name="d2")])
    opt = keras.optimizers.Adam(0.1)
    if view == "local":
      opt = repl.wrap_optimizer(opt)
    threshold = tf.Variable(100.0, trainable=False)  # the step fails while its loss is not below it
  return repl, model, opt, threshold


def _step(model, opt, threshold):
  def step(batch):
    x, y = batch
    x = tf.debugging.check_numerics(x, "input has a NaN")
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(x) - y) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    tf.debugging.assert_less(loss, threshold, message="loss too large")  # after the update: it fails last
    return loss

  return step


def _state(model, opt):
  """Every component of every variable, numpy."""
  return [[c.numpy() for c in _variables.underlying(v).components] for v in model.variables + opt.variables]


def _assert_same(before, after):
  for i, (b, a) in enumerate(zip(before, after)):
    for device, (x, y) in enumerate(zip(b, a)):
      np.testing.assert_array_equal(x, y, err_msg=f"variable {i} on device {device}")


def _load():
  """Threads busy with NumPy until the returned event is set: the CPUs' scheduling changes."""
  stop = threading.Event()

  def burn():
    a = np.random.rand(200, 200)
    while not stop.is_set():
      a @ a  # noqa: B018

  threads = [threading.Thread(target=burn, daemon=True) for _ in range(2)]
  for t in threads:
    t.start()
  return stop


@pytest.mark.parametrize("view", ["local", "global"])
def test_a_step_that_fails_after_its_update_writes_nothing_and_says_one_line(view):
  # Was (global view, 2x2): in 11 of 14 calls some variables updated on some devices only, never refused.
  repl, model, opt, threshold = _setup(view)
  step, ds = _step(model, opt, threshold), _dataset().repeat()
  repl.run(step, ds)  # one good step: built, the slots exist
  threshold.assign(-1.0)
  before = _state(model, opt)
  stop = _load()
  try:
    for _ in range(6):
      with pytest.raises(replicator.StepFailedError) as raised:
        repl.run(step, ds)
      _assert_same(before, _state(model, opt))
  finally:
    stop.set()
  e = raised.value
  assert isinstance(e, tf.errors.InvalidArgumentError)  # `except tf.errors.InvalidArgumentError` still catches it
  assert isinstance(e.__cause__, tf.errors.InvalidArgumentError)
  message = str(e)
  assert "\n" not in message and "root error" not in message
  # An assertion runs inside a tf.cond branch of the step, whose node names do not tell the device: none named.
  assert re.search(r"^The step failed at .*test_atomic\.py:\d+ in step \(op '.*assert_less", message)
  assert "loss too large" in message and "No variable was written" in message
  assert "test_atomic.py" in e.location and e.restored and e.devices == ()
  threshold.assign(100.0)
  repl.run(step, ds)  # the next step runs, from the state of before
  assert int(opt.iterations.numpy()) == 2


@pytest.mark.parametrize("view", ["local", "global"])
def test_a_failure_on_one_batch_shard_restores_the_devices_that_wrote(view):
  # check_numerics fails on the devices holding the NaN row only; the others update (2x2: 2 of 4 devices).
  repl, model, opt, threshold = _setup(view)
  x = X.copy()
  x[9, 0] = np.nan  # the second global batch, its second row: the first batch shard
  step, ds = _step(model, opt, threshold), _dataset(x)
  repl.run(step, ds)
  before = _state(model, opt)
  with pytest.raises(replicator.StepFailedError, match=r"The step failed on device:CPU:[01](, device:CPU:[01])? at "
                     r".*test_atomic\.py:\d+ in step \(op '.*CheckNumerics'\): .*input has a NaN") as raised:
    repl.run(step, ds)
  assert {d.rsplit(":", 1)[-1] for d in raised.value.devices} <= {"0", "1"}  # the first batch shard's devices
  _assert_same(before, _state(model, opt))
  repl.run(step, ds)  # the third batch: runs


@pytest.mark.parametrize("view", ["local", "global"])
def test_a_loop_of_steps_is_one_call_all_or_nothing(view):
  repl, model, opt, threshold = _setup(view)
  step = _step(model, opt, threshold)

  def failing_third(batch):  # the third step of the loop fails (a row of its input is marked)
    x, y = batch
    marked = tf.reduce_any(tf.equal(x, 7.0))
    x = tf.debugging.check_numerics(x / (1.0 - tf.cast(marked, tf.float32)), "the third batch")
    return step((x, y))

  x = X.copy()
  x[16, 0] = 7.0
  before = _state(model, opt)
  with pytest.raises(replicator.StepFailedError, match="the third batch"):
    repl.run(failing_third, _dataset(x), steps=5)
  _assert_same(before, _state(model, opt))  # steps 1 and 2 ran, and were undone with the rest
  assert int(opt.iterations.numpy()) == 0


@pytest.mark.parametrize("view", ["local", "global"])
def test_after_a_failed_call_training_equals_one_device_without_it(view):
  repl, model, opt, threshold = _setup(view)
  step, ds = _step(model, opt, threshold), _dataset()
  repl.run(step, ds)
  threshold.assign(-1.0)
  with pytest.raises(tf.errors.InvalidArgumentError):
    repl.run(step, ds)  # reads and drops the second batch
  threshold.assign(100.0)
  for _ in range(2):
    repl.run(step, ds)
  # One device: the first batch, then the third and fourth (the second was read by the failed call).
  keras.utils.set_random_seed(0)
  ref = keras.Sequential([keras.Input([8]), keras.layers.Dense(16, name="d1"), keras.layers.Dense(1, name="d2")])
  ref_opt = keras.optimizers.Adam(0.1)
  ref_step = tf.function(_step(ref, ref_opt, tf.Variable(100.0)))
  for i, batch in enumerate(_dataset().take(4)):
    if i != 1:
      ref_step(batch)
  assert_every_copy(model.variables + opt.variables, ref.variables + ref_opt.variables, atol=2e-6)


def test_a_random_generator_state_is_restored():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    generator = tf.random.Generator.from_seed(1)
    fail = tf.Variable(False, trainable=False)

  def step():
    draw = generator.normal([3])
    with tf.control_dependencies([draw]):  # after the draw has moved the state
      tf.debugging.Assert(tf.logical_not(fail), ["failing"])
    return draw

  repl.run(step)
  before = [c.numpy() for c in _variables.underlying(generator.state).components]
  fail.assign(True)
  with pytest.raises(replicator.StepFailedError):
    repl.run(step)
  _assert_same([before], [[c.numpy() for c in _variables.underlying(generator.state).components]])


def test_atomic_false_keeps_no_copy_and_the_global_view_refuses_torn_replicated_copies():
  # A NaN in one batch shard: that device fails, the others may have written (replicated variables, 4x1).
  x = X.copy()
  x[9, 0] = np.nan
  for _ in range(4):
    repl, model, opt, threshold = _setup("global", atomic=False, shape=(4, 1))
    step, ds = _step(model, opt, threshold), _dataset(x)
    repl.run(step, ds)
    try:
      repl.run(step, ds)
    except replicator.ReplicasDivergedError as e:
      assert "now differ between replicas" in str(e) and e.variables
      with pytest.raises(replicator.ReplicasDivergedError, match="still differ since a step failed"):
        repl.run(step, ds)
    except replicator.StepFailedError as e:
      assert "atomic=False" in str(e) and not e.restored
      for v in model.variables + opt.variables:  # then every copy agrees
        components = [c.numpy() for c in _variables.underlying(v).components]
        assert all(np.array_equal(components[0], c) for c in components[1:])
    else:
      raise AssertionError("the NaN did not fail the step")


def test_atomic_takes_a_bool():
  with pytest.raises(replicator.ArgumentTypeError, match=r"Replicator\(atomic='yes'\): expected True"):
    replicator.Replicator(cpus(2), atomic="yes")


def _checked_keras_model(threshold):
  """Keras's own train step, then a check that fails while the loss is not below ``threshold`` (after the update)."""

  class Checked(keras.Sequential):
    def train_step(self, data):
      logs = super().train_step(data)
      tf.debugging.assert_less(logs["loss"], threshold, message="loss too large")
      return logs

  keras.utils.set_random_seed(0)
  model = Checked([keras.Input([8]), keras.layers.Dense(16, name="d1"), keras.layers.Dense(1, name="d2")])
  model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
  return model


def _keras_reference(fits):
  """One device: a fit of the first two batches, ``fits`` times."""
  ref = _checked_keras_model(tf.Variable(100.0))
  for _ in range(fits):
    ref.fit(_dataset().take(2), epochs=1, verbose=0)
  return ref


def test_a_failed_step_of_keras_fit_leaves_every_copy_as_before_it():
  # Keras's fit calls the global view's step in Keras's own tf.function: the failure surfaced from Keras's call,
  # where nothing restored what the step wrote (an update on some devices, the slots, the iteration counter).
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)), view="global",
                               layouts=LAYOUTS)
  with repl.context():
    threshold = tf.Variable(100.0, trainable=False)
    model = _checked_keras_model(threshold)
  model.fit(_dataset().take(2), epochs=1, verbose=0)
  before = _state(model, model.optimizer)
  threshold.assign(-1.0)
  for _ in range(3):
    with pytest.raises(tf.errors.InvalidArgumentError, match="loss too large"):
      model.fit(_dataset().take(2), epochs=1, verbose=0)
    _assert_same(before, _state(model, model.optimizer))  # as soon as fit has raised
  threshold.assign(100.0)
  model.fit(_dataset().take(2), epochs=1, verbose=0)
  ref = _keras_reference(fits=2)
  assert_every_copy(model.variables + model.optimizer.variables, ref.variables + ref.optimizer.variables, atol=2e-6)


def test_a_failure_in_the_first_call_of_keras_fit_is_undone_before_the_next_step():
  # The first call is the one in which Keras traces its function (and the library wraps it): what its failed
  # step wrote is written back at the start of the next step, which trains from the state before the failure.
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)), view="global",
                               layouts=LAYOUTS)
  with repl.context():
    threshold = tf.Variable(-1.0, trainable=False)
    model = _checked_keras_model(threshold)
  with pytest.raises(tf.errors.InvalidArgumentError, match="loss too large"):
    model.fit(_dataset().take(2), epochs=1, verbose=0)
  threshold.assign(100.0)
  model.fit(_dataset().take(2), epochs=1, verbose=0)
  ref = _keras_reference(fits=1)
  assert_every_copy(model.variables + model.optimizer.variables, ref.variables + ref.optimizer.variables, atol=2e-6)


@pytest.mark.parametrize("view", ["local", "global"])
def test_a_failed_step_called_in_a_function_is_undone_before_the_next_step(view):
  # repl.run inside the user's tf.function: the failure leaves the user's function, where the library cannot
  # restore; the values kept are written back at the start of the step's next call (was: trained on from the
  # torn state, 2x2: every weight off).
  repl, model, opt, threshold = _setup(view)
  step = _step(model, opt, threshold)

  @tf.function
  def train(batch):
    return repl.run(step, inputs=batch)  # local view: every replica the whole batch, as one device

  batches = list(_dataset().take(4))
  train(batches[0])
  threshold.assign(-1.0)
  with pytest.raises(tf.errors.InvalidArgumentError, match="loss too large"):
    train(batches[1])
  threshold.assign(100.0)
  for batch in batches[2:]:
    train(batch)
  keras.utils.set_random_seed(0)
  ref = keras.Sequential([keras.Input([8]), keras.layers.Dense(16, name="d1"), keras.layers.Dense(1, name="d2")])
  ref_opt = keras.optimizers.Adam(0.1)
  ref_step = tf.function(_step(ref, ref_opt, tf.Variable(100.0)))
  for i, batch in enumerate(batches):
    if i != 1:
      ref_step(batch)
  assert_every_copy(model.variables + opt.variables, ref.variables + ref_opt.variables, atol=2e-6)
