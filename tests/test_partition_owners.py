"""The global view's sharded update: an optimizer's update of a batch-replicated variable runs on one owner."""

import collections
import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import global_step_of
from conftest import keras_step

import mesh
import replicator
from replicator.core import _errors

BATCH, STEPS = 12, 3
HIDDEN = {r"ff_in/kernel$": (None, "model"), r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)}
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(1e-2),
              "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
              "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "sgd": lambda: keras.optimizers.SGD(0.1)}


def _model(context, optimizer):
  with context:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu", name="ff_in"),
                              keras.layers.Dense(4, name="ff_out")])
    opt = OPTIMIZERS[optimizer]()
    opt.build(model.trainable_variables)
  return model, opt


def _dataset():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
  y = rng.integers(0, 4, size=BATCH * STEPS).astype("int32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def _repl(shape, layouts=None, update="auto"):
  m = mesh.Mesh({"batch": shape[0], "model": shape[1]}, devices=cpus(shape[0] * shape[1]))
  return replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(layouts) if layouts else None, batch_axes=("batch",),
                               view="global", update=update)


_step = global_step_of


def _one_device(optimizer):
  model, opt = _model(contextlib.nullcontext(), optimizer)
  step = tf.function(keras_step(model, opt))
  losses = [float(step(batch)) for batch in _dataset()]
  return model, opt, losses


def _train(repl, optimizer):
  model, opt = _model(repl.context(), optimizer)
  step_fn = keras_step(model, opt)
  dataset = _dataset()
  losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  return model, opt, losses, step_fn


def _components(variable):
  return [c.numpy() for c in variable.value.components]


def _pieces(whole, variable, m):
  """Each device's piece of ``whole`` in ``variable``'s layout (numpy)."""
  layout = variable.value.layout
  pieces = []
  for r in range(len(m.devices)):
    index = []
    for d, n in enumerate(whole.shape):
      axes = layout.axes(d) if layout is not None else ()
      chunk = n // m.axis_size(axes) if axes else n
      start = m.axis_index(r, axes) * chunk if axes else 0
      index.append(slice(start, start + chunk))
    pieces.append(whole[tuple(index)])
  return pieces


def _assert_on_devices(variable, expected, m, devices):
  for r, (component, piece) in enumerate(zip(_components(variable), _pieces(np.asarray(expected), variable, m))):
    if r in devices:
      np.testing.assert_allclose(component, piece, rtol=0, atol=1e-5, err_msg=f"{variable.path} on device {r}")


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape,layouts", [((4, 1), None), ((2, 2), HIDDEN)], ids=["4x1-batch", "2x2-hidden"])
def test_sharded_update_equals_one_device_on_every_component(optimizer, shape, layouts):
  one_model, one_opt, expected = _one_device(optimizer)
  repl = _repl(shape, layouts, update="sharded")
  model, opt, losses, _step_fn = _train(repl, optimizer)
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  ownership = _step(repl).ownership
  owned = {v.path: v for v in opt.variables if v.value.owner is not None}
  slots = [v for v in opt.variables if re.search(r"_(momentum|velocity)$", v.path)]
  # Every slot (and nothing else) is owned; plain SGD has none, so nothing is (a broadcast would cost more).
  assert sorted(owned) == sorted(v.path for v in slots)
  assert len(ownership.variables) == len(slots)
  assert len(ownership.broadcasts) == (len(model.trainable_variables) if slots else 0)
  m, everywhere = repl.mesh, range(len(repl.devices))
  for a, b in zip(one_model.variables, model.variables):  # weights: current on every device
    _assert_on_devices(b, a, m, everywhere)
  for a, b in zip(one_opt.variables, opt.variables):  # counters on every device; slots on their owner
    devices = everywhere
    if b.path in owned:
      position, axes = b.value.owner
      devices = [r for r in everywhere if m.axis_index(r, axes) == position]
      assert len(devices) == shape[1]  # one owner per "batch" group: one per "model" position
    _assert_on_devices(b, a, m, devices)


@pytest.mark.parametrize("batch,expected", [(4, {0: 1024, 1: 512, 2: 128, 3: 32}), (2, {0: 1024, 1: 512 + 128 + 32})])
def test_owners_spread_the_optimizer_state_over_the_batch_group(batch, expected):
  # One owner per variable's update (its two Adam slots together), largest first to the least loaded position:
  # ff_in's kernel slots 2 x 512 B, ff_out's kernel 2 x 256 B, ff_in's bias 2 x 64 B, ff_out's bias 2 x 16 B.
  repl = _repl((batch, 1), update="sharded")
  _, opt, _, _step_fn = _train(repl, "adam")
  load = collections.Counter()
  for v in opt.variables:
    if v.value.owner is not None:
      load[v.value.owner[0]] += np.asarray(v).nbytes
  assert dict(load) == expected


def test_sharded_update_runs_adam_once_per_group():
  counts = {}
  for update in ("sharded", "replicated"):
    repl = _repl((4, 1), update=update)
    _, _, _, _step_fn = _train(repl, "adam")
    step = _step(repl)
    counts[update] = collections.Counter(n.op for n in step.graph_def.node)
    kinds = collections.Counter(c.kind for c in step.plan.collectives)
    assert kinds["broadcast"] == (4 if update == "sharded" else 0)
  # Adam takes two square roots per variable (its velocity's, and its bias correction's): on each of the 4
  # devices, or once, on the owner (the step counter's read is shared by every update and stays everywhere).
  assert counts["replicated"]["Sqrt"] == 4 * (4 * 2)
  assert counts["sharded"]["Sqrt"] == 4 * 2
  assert sum(counts["sharded"].values()) < sum(counts["replicated"].values())


def test_replicated_update_keeps_every_slot_current_everywhere():
  one_model, one_opt, expected = _one_device("adam")
  repl = _repl((2, 2), HIDDEN, update="replicated")
  _, opt, losses, _step_fn = _train(repl, "adam")
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  assert not _step(repl).ownership.ops
  for a, b in zip(one_opt.variables, opt.variables):
    assert b.value.owner is None
    _assert_on_devices(b, a, repl.mesh, range(len(repl.devices)))


def test_auto_shards_on_the_cpus_of_one_process():
  repl = _repl((2, 2), HIDDEN)
  _, _, _, _step_fn = _train(repl, "adam")
  assert _step(repl).ownership.variables


def test_explain_names_owners_and_broadcasts():
  repl = _repl((2, 2), HIDDEN, update="sharded")
  model, opt = _model(repl.context(), "adam")
  report = repl.explain(keras_step(model, opt), _dataset())
  rows = {r.name: r for r in report.variables}
  slot = next(r for name, r in rows.items() if name.endswith("ff_in_kernel_momentum"))
  assert re.fullmatch(r"position [01] along batch", slot.owner)
  assert next(r for name, r in rows.items() if name.endswith("ff_in/kernel")).owner == ""
  broadcasts = [r for r in report.collective_rows if r.kind == "broadcast"]
  assert len(broadcasts) == 4
  for row in broadcasts:
    assert row.op_type == "AssignSubVariableOp" and row.axes == ("batch",)
    assert re.fullmatch(r"sharded update: input 1, computed by position [01] along batch only", row.why)
  assert "kept current on" in str(report)


def test_a_step_that_reads_owned_slots_everywhere_is_refused():
  repl = _repl((2, 1), update="sharded")
  model, opt, _, _step_fn = _train(repl, "adam")
  (momentum,) = [v for v in opt.variables if v.path.endswith("ff_in_kernel_momentum")]

  def norm_of_momentum(batch):
    del batch
    return tf.reduce_sum(tf.square(momentum))

  with pytest.raises(_errors.UnsupportedError, match=re.escape(
      "is kept current only on one device of each group along ('batch',) (a sharded optimizer update owns it), "
      "but this global-view step uses it on every device. Fix: run the step that updates it and this one with "
      "the same kind of update: Replicator(update=\"replicated\")")):
    repl.run(norm_of_momentum, _dataset())


def test_unknown_update_is_refused():
  with pytest.raises(_errors.ArgumentError, match=re.escape(
      "Replicator(update='zero'): update must be one of ('auto', 'sharded', 'replicated').")):
    replicator.Replicator(devices=cpus(2), update="zero")
