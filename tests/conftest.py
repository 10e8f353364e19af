"""Test set-up: 8 logical CPUs, configured once before TensorFlow initialises."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mse_step import keras_step  # noqa: E402, F401  (the tests import it from here)

import replicator  # noqa: E402

NUM_CPUS = 8
replicator.virtual_cpus(NUM_CPUS)

REPLICA_COUNTS = (1, 2, 4, 8)
IMPLEMENTATIONS = ("one_device", "collective_ops")


def cpus(n):
  """The first n logical CPU device names."""
  return [f"/device:CPU:{i}" for i in range(n)]


def replica_values(variable):
  """Every replica's current value of ``variable`` (numpy); a sharded update's slot: its owner's."""
  from replicator.state import _variables  # pylint: disable=import-outside-toplevel
  replicated = _variables.underlying(variable)
  if replicated is None:
    return [variable.numpy()]
  return [replicated.components[h].numpy() for h in replicated._home]  # pylint: disable=protected-access


def _copies(variable, expected):
  """(device's value, the part of ``expected`` it must hold) for every copy of ``variable`` (see assert_every_copy)."""
  import mesh  # pylint: disable=import-outside-toplevel
  from replicator.state import _variables  # pylint: disable=import-outside-toplevel
  replicated = _variables.underlying(variable)
  if replicated is None:
    return [(np.asarray(variable), expected)]
  components = replicated.components
  if _variables.summed_on_read(replicated):
    return [(sum(c.numpy() for c in components), expected)]
  pieces = [np.asarray(piece) for piece in mesh.split(expected, replicated.layout)]
  if replicated._offsets is not None:  # pylint: disable=protected-access  (a seed state drawing per replica)
    pieces = [piece + offset.numpy() for piece, offset in zip(pieces, replicated._offsets)]  # pylint: disable=protected-access
  return list(zip(replica_values(replicated), pieces))


def assert_every_copy(ours, reference, atol=1e-5, rtol=0):
  """Every device's copy of each variable of ``ours`` holds ``reference``'s value (one device's variables).

  A sharded variable's component holds its device's piece; an on-read SUM
  variable's components (a metric's total) add up to the value; a slot the
  sharded update keeps current on one owner per group is read there.
  """
  assert len(ours) == len(reference)
  for mine, theirs in zip(ours, reference):
    expected, name = np.asarray(theirs), getattr(theirs, "path", None) or theirs.name
    for device, (value, part) in enumerate(_copies(mine, expected)):
      np.testing.assert_allclose(value, part, rtol=rtol, atol=atol, err_msg=f"{name} on device {device}")


def assert_held_gradients(grads, variables, expected, atol):
  """Each of ``grads`` (``repl.run``'s, one value per replica) is ``expected``'s on the replicas that hold its
  variable (a pipeline's stage's devices; every replica for a variable every stage holds), zeros on the others."""
  from replicator.state import _variables  # pylint: disable=import-outside-toplevel
  grads, variables, expected = list(grads), list(variables), list(expected)
  assert len(grads) == len(variables) == len(expected)
  for got, variable, want in zip(grads, variables, expected):
    want = np.asarray(want)
    held = set(_variables.underlying(variable).replicas)
    for r, value in enumerate(got):
      np.testing.assert_allclose(np.asarray(value), want if r in held else np.zeros_like(want), atol=atol,
                                 err_msg=f"{getattr(variable, 'path', variable.name)} on replica {r}")


def copies_distance(ours, reference) -> float:
  """The largest distance of any device's copy of any variable of ``ours`` to ``reference``'s (as above)."""
  assert len(ours) == len(reference)
  gaps = [0.0]
  for mine, theirs in zip(ours, reference):
    for value, part in _copies(mine, np.asarray(theirs)):
      assert np.shape(value) == np.shape(part), (getattr(theirs, "path", None), np.shape(value), np.shape(part))
      gaps.append(float(np.max(np.abs(np.asarray(value, np.float64) - np.asarray(part, np.float64)), initial=0.0)))
  return max(gaps)


@pytest.fixture
def mixed_float16():
  """Keras's global policy "mixed_float16" for the test (layers compute in float16), "float32" again after it.

  ``keras.backend.clear_session()`` resets the policy: call ``mixed_float16()`` after it to set it again.
  """
  import keras  # pylint: disable=import-outside-toplevel

  def set_policy():
    keras.mixed_precision.set_global_policy("mixed_float16")

  set_policy()
  yield set_policy
  keras.mixed_precision.set_global_policy("float32")


# A mixed_float16 run against the same run on one device differs by where float16 rounds: a replica's gradient
# of its rows is a float16 sum of those rows, one device's a float16 sum of all of them (and a layer split over
# "model" sums its partial products in float16). Its noise is measured where it is tested: the distance of one
# device's mixed_float16 run from the same run in float32 (float16_noise). The tolerance is twice that: two
# float16 runs that each stray that far from the exact run can be twice as far from each other. (Not the noise:
# the same one-device fit with each batch's rows in another order, which moved no variable by more than 9e-8 on
# an MLP like test_keras.py's over 24 steps, where float16 moved them by 1.4e-4: the reordered sums round alike.)


def float16_noise(mixed, exact) -> float:
  """How far float16 moves a run: its variables' largest distance from the run's in float32 (``exact``).

  Each variable's distance is over ``max(1, its largest magnitude)``, as
  float16's spacing (2**-10 at 1) scales: absolute for weights and slots,
  relative for a loss scale.
  """
  return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / max(1.0, float(np.max(np.abs(np.asarray(a)))))
             for a, b in zip(mixed, exact, strict=True))


def assert_every_copy_float16(ours, reference, noise: float):
  """:func:`assert_every_copy` within twice the float16 ``noise`` (:func:`float16_noise`) of one device's run.

  Each variable within ``2 * noise * max(1, its largest magnitude)``; compare
  counters (a LossScaleOptimizer's scale and step counter, iterations) exactly.
  """
  for mine, theirs in zip(ours, reference, strict=True):
    largest = float(np.max(np.abs(np.asarray(theirs))))
    assert_every_copy([mine], [theirs], atol=2 * noise * max(1.0, largest))


def summary_events(logdir) -> list:
  """``(step, tag, value)`` of every summary written under ``logdir``, file by file in order (value: numpy)."""
  import glob  # pylint: disable=import-outside-toplevel
  found = []
  for path in sorted(glob.glob(f"{logdir}/events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      found += [(event.step, value.tag, tf.make_ndarray(value.tensor)) for value in event.summary.value]
  return found


def global_step_of(repl):
  """The one global-view step ``repl`` built (its partition, plan and graph)."""
  (by_spec,) = repl._views["global"].steps.values()  # pylint: disable=protected-access
  (variants,) = by_spec.values()
  (step,) = variants.values()
  return step


_TESTS_RUN = [0]
COLLECT_EVERY = 25  # tests between full garbage collections


@pytest.fixture(autouse=True)
def _fresh_keras_state():
  # Keras's name counters reset for every test; Python's full collection (0.67 s a test on average here, 40% of
  # the suite's time) only every COLLECT_EVERY tests, to keep the process's memory bounded.
  import keras
  _TESTS_RUN[0] += 1
  keras.backend.clear_session(free_memory=_TESTS_RUN[0] % COLLECT_EVERY == 0)
  yield


def pytest_report_header(config):
  return f"tensorflow {tf.__version__}, {NUM_CPUS} logical CPUs"




def loss_and_grads(fn, x, w):
  """``fn(x, w)``, a loss of it (``sum(y^2 / 2 + y)``) and its gradients with respect to ``w`` and ``x``.

  The rule tests' step: each runs it in the global view and on one device. ``x``'s gradient is zeros where it
  is not differentiable (ids).
  """
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = fn(x, w)
    loss = tf.reduce_sum(y * y * 0.5 + y)
  dw, dx = tape.gradient(loss, [w, x])
  return y, loss, tf.convert_to_tensor(dw), tf.zeros_like(x) if dx is None else dx


def mse_step(model, opt):
  """A single-device training step on the mean squared error of ``model(x)`` against ``y`` (inference-mode call)."""

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x) - y))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  return step_fn


def sonnet_step(net, opt):
  """The single-device Sonnet 2 training step (sparse labels, logits, ``opt.apply``) the global view runs unchanged."""

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, net(x)))
    opt.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
    return loss

  return step_fn


MESH_SHAPES = ((1, 4), (2, 2), (4, 1), (2, 4))  # (batch, model) meshes of the global view's sweeps


def mesh_sweep(layouts, representative):
  """``pytest.param(shape, layout)`` for every mesh shape x layout name; those not in ``representative`` are
  marked full_grid (CI runs the representative ones, ``--full-grid`` all). A list: pytest refuses iterators."""
  cases = []
  for shape in MESH_SHAPES:
    for layout in sorted(layouts):
      marks = () if (shape, layout) in representative else (pytest.mark.full_grid,)
      cases.append(pytest.param(shape, layout, marks=marks, id=f"{shape[0]}x{shape[1]}-{layout}"))
  return cases


def pytest_addoption(parser):
  parser.addoption("--full-grid", action="store_true", default=False,
                   help="also run the cases marked full_grid (every mesh x layout; CI runs representative ones)")


def pytest_configure(config):
  config.addinivalue_line("markers", "full_grid: a sweep case beyond CI's representative ones (run with --full-grid)")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--full-grid"):
    return
  skip = pytest.mark.skip(reason="sweep case: run with --full-grid")
  for item in items:
    if "full_grid" in item.keywords:
      item.add_marker(skip)

