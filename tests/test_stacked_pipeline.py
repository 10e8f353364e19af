"""``replicator.stacked_pipeline``: identical blocks' stacked weights over a stage axis, in the global view."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import global_step_of

import mesh
import replicator

P, FEATURES, WIDTH, HIDDEN, ROWS = 2, 6, 8, 16, 16


def _block(w, x):
  """A pre-norm residual MLP (plain ops: a mean, a variance, two matmuls)."""
  mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
  h = (x - mean) * tf.math.rsqrt(variance + 1e-5) * w["scale"]
  return x + tf.tanh(h @ w["up"]) @ w["down"]


def _initial(stages=P, seed=0):
  rng = np.random.default_rng(seed)
  return {
      "in": (rng.normal(size=(FEATURES, WIDTH)) / 3).astype("float32"),
      "blocks/scale": (1 + rng.normal(size=(stages, WIDTH)) / 10).astype("float32"),
      "blocks/up": (rng.normal(size=(stages, WIDTH, HIDDEN)) / 4).astype("float32"),
      "blocks/down": (rng.normal(size=(stages, HIDDEN, WIDTH)) / 4).astype("float32"),
      "out": (rng.normal(size=(WIDTH, 1)) / 3).astype("float32"),
  }


def _data(seed=1):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(ROWS, FEATURES)).astype("float32"), rng.normal(size=(ROWS, 1)).astype("float32")


def _blocks(variables):
  return {k: variables[f"blocks/{k}"] for k in ("scale", "up", "down")}


def _forward(variables, x, pipelined, microbatches, remat=True, repeats=1):
  h = x @ variables["in"]
  if pipelined:
    h = replicator.stacked_pipeline(_block, _blocks(variables), h, microbatches=microbatches, remat=remat,
                                    repeats=repeats)
  else:
    stacked = _blocks(variables)
    for s in range(variables["blocks/up"].shape[0]):
      h = _block({k: v[s] for k, v in stacked.items()}, h)
  return h @ variables["out"]


def _step(variables, optimizer, pipelined, microbatches, remat=True, repeats=1):
  names = sorted(variables)

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(_forward(variables, x, pipelined, microbatches, remat, repeats) - y))
    grads = tape.gradient(loss, [variables[n] for n in names])
    optimizer.apply_gradients(zip(grads, [variables[n] for n in names]))
    return loss

  return step


def _one_device(steps, initial, data):
  variables = {k: tf.Variable(v, name=k) for k, v in initial.items()}
  optimizer = keras.optimizers.Adam(1e-2)
  step = tf.function(_step(variables, optimizer, pipelined=False, microbatches=1))
  losses = [float(step(tuple(tf.constant(a) for a in data))) for _ in range(steps)]
  return variables, optimizer, losses


STAGES = {r"^blocks/(up|down)$": ("stage", None, None), r"^blocks/scale$": ("stage", None)}
LAYOUTS = {
    "stage": STAGES,
    "stage_x_batch": STAGES,
    "stage_x_batch_x_model": {r"^blocks/up$": ("stage", None, "model"), r"^blocks/down$": ("stage", "model", None),
                              r"^blocks/scale$": ("stage", None)},
}
MESHES = {"stage": {"stage": P}, "stage_x_batch": {"stage": P, "batch": 2},
          "stage_x_batch_x_model": {"stage": P, "batch": 2, "model": 2}}


def _global(shape, steps, initial, data, microbatches, remat=True, repeats=1):
  sizes = MESHES[shape] if isinstance(shape, str) else shape
  layouts = LAYOUTS[shape] if isinstance(shape, str) else STAGES
  if repeats > 1:  # the blocks' weights [repeats, p, ...]: block r * p + s at [r, s], on stage s
    layouts = {k: (None, *v) for k, v in layouts.items()}
    initial = _stacked_as(repeats, initial)
  repl = replicator.Replicator(mesh=mesh.Mesh(sizes, devices=cpus(int(np.prod(list(sizes.values()))))),
                               layouts=mesh.LayoutMap(layouts), view="global",
                               batch_axes=("batch",) if "batch" in sizes else ())
  with repl.context():
    variables = {k: tf.Variable(v, name=k) for k, v in initial.items()}
    optimizer = keras.optimizers.Adam(1e-2)
  step = _step(variables, optimizer, pipelined=True, microbatches=microbatches, remat=remat, repeats=repeats)
  dataset = tf.data.Dataset.from_tensors(tuple(tf.constant(a) for a in data)).repeat()
  losses = [float(repl.run(step, dataset)) for _ in range(steps)]
  return repl, variables, optimizer, losses, step, dataset


def test_on_one_device_it_is_the_blocks_in_a_row():
  initial, (x, _) = _initial(stages=3), _data()
  variables = {k: tf.constant(v) for k, v in initial.items()}
  expected = _forward(variables, x, pipelined=False, microbatches=1)
  for m in (1, 2, 4, 16):
    for remat in (True, False):
      np.testing.assert_allclose(_forward(variables, x, pipelined=True, microbatches=m, remat=remat), expected,
                                 rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape,remat", [(shape, True) for shape in sorted(MESHES)] + [("stage_x_batch", False)])
def test_a_stacked_pipeline_trains_as_one_device_every_weight_and_slot(shape, remat):
  # 5 Adam steps, 4 microbatches, against the blocks in a row on one device. The same steps on one device through
  # stacked_pipeline (the blocks' matmuls on 4 rows at a time, summed in another order) move the weights by 1.5e-7:
  # the floor. Measured here: 1.8e-7 (stage), 1.8e-7 (stage x batch), 2.4e-7 (stage x batch x model), slots 6e-8.
  # Bound 5e-7 (2x the floor is 3e-7; margin for other CPUs' kernels).
  initial, data = _initial(), _data()
  one, one_opt, one_losses = _one_device(5, initial, data)
  repl, ours, opt, losses, _, _ = _global(shape, 5, initial, data, microbatches=4, remat=remat)
  np.testing.assert_allclose(losses, one_losses, rtol=0, atol=5e-7)
  for name in initial:
    np.testing.assert_allclose(ours[name].numpy(), one[name].numpy(), rtol=0, atol=5e-7, err_msg=name)
  for a, b in zip(opt.variables, one_opt.variables):  # Adam's slots and its step counter
    np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=0, atol=5e-7, err_msg=a.path)
  del repl


GRID = [pytest.param(p, m, marks=() if (p, m) in ((2, 1), (4, 8)) else (pytest.mark.full_grid,))
        for p in (2, 4) for m in (1, 2, 4, 8)]


@pytest.mark.parametrize("p,m", GRID)
def test_two_and_four_stages_and_one_to_eight_microbatches_train_as_one_device_for_20_steps(p, m):
  # 20 Adam steps on {"stage": p} against the blocks in a row on one device. Measured: 1.2e-7 to 3.9e-7 over the 8
  # cases; the same steps through stacked_pipeline on one device are 1.8e-7 to 3.6e-7 from it (p = 2 and 4, m = 2
  # and 8). Bound 2e-6.
  initial, data = _initial(stages=p), _data()
  one, _, one_losses = _one_device(20, initial, data)
  _, ours, _, losses, _, _ = _global({"stage": p}, 20, initial, data, microbatches=m)
  np.testing.assert_allclose(losses, one_losses, rtol=0, atol=2e-6)
  for name in initial:
    np.testing.assert_allclose(ours[name].numpy(), one[name].numpy(), rtol=0, atol=2e-6, err_msg=name)


def test_each_device_keeps_its_stage_and_sends_one_microbatch_a_tile_each_way():
  initial, data = _initial(), _data()
  repl, _, _, _, step, dataset = _global("stage_x_batch", 1, initial, data, microbatches=4)
  report = repl.explain(step, dataset)
  permutes = [r for r in report.inside_rows if r.kind == "permute"]
  # The forward loop's roll and its gradient loop's: a stage's [1, rows / m / 2, width] tile (its half of the
  # microbatch's rows), once an iteration.
  assert len(permutes) == 2 and all(r.shape == (1, ROWS // 4 // 2, WIDTH) for r in permutes), permutes
  gathers = [r for r in report.collective_rows + report.inside_rows if r.kind == "all_gather"]
  assert not gathers, gathers  # no block's weights, no activation gathered (the outputs keep the batch's split)
  stacked = sum(v.nbytes for k, v in initial.items() if k.startswith("blocks/"))
  others = sum(v.nbytes for k, v in initial.items() if not k.startswith("blocks/"))
  for device in repl.memory(step, dataset).devices:  # weights and Adam's two slots: the blocks' 1/p
    assert device.variable_bytes <= 3 * (stacked / P + others) + 16, device


@pytest.mark.parametrize("m", [2, 8])
def test_the_memory_report_counts_what_the_schedules_loop_keeps_for_its_gradient(m):
  # The schedule is a tf.while_loop of m + p - 1 iterations: what it keeps for its gradient is the lists it pushes
  # each iteration (rewrite._memory's "loop" rows). With remat=True each iteration keeps the stage's block input,
  # [1, rows / m, width] a device, and no activation inside the block; without, the block's activations too.
  initial, data = _initial(), _data()
  kept = {}
  for remat in (True, False):
    repl, _, _, _, step, dataset = _global("stage", 1, initial, data, microbatches=m, remat=remat)
    report = repl.memory(step, dataset)
    assert all(d.unknown == 0 for d in report.devices)
    kept[remat] = [s for s in report.saved_on("CPU:1") if s.kind == "loop" and s.bytes]
  iterations = m + P - 1
  inputs = [s for s in kept[True] if s.dtype == "float32"]
  assert [(s.shape, s.bytes) for s in inputs] == [((iterations, 1, ROWS // m, WIDTH), iterations * ROWS // m * WIDTH * 4)]
  assert sum(s.bytes for s in kept[False]) >= 4 * sum(s.bytes for s in inputs)


def test_the_graph_does_not_grow_with_the_microbatches():
  initial, data = _initial(), _data()
  sizes = []
  for m in (2, 8):
    built = _global("stage", 1, initial, data, microbatches=m)  # (its step_fn keeps the built step)
    graph = global_step_of(built[0]).graph_def
    # Every op but constants, the step's and the loops' (m's microbatch slices take 6 more constants at m = 8: 518
    # nodes against 524; in the loops, m = 2 = p shares 2 constants that m = 8 makes apart).
    sizes.append((sorted(n.op for n in graph.node if n.op != "Const"),
                  sorted(n.op for f in graph.library.function for n in f.node_def if n.op != "Const")))
  assert sizes[0] == sizes[1]


def _stacked_as(repeats, initial):
  return {k: v.reshape((repeats, -1) + v.shape[1:]) if k.startswith("blocks/") else v for k, v in initial.items()}


def test_on_one_device_repeats_are_rounds_of_the_stages():
  # repeats=2 over 2 stages: blocks 0, 1, 2, 3 in a row, block r * 2 + s at [r, s].
  initial, (x, _) = _initial(stages=4), _data()
  expected = _forward({k: tf.constant(v) for k, v in initial.items()}, x, pipelined=False, microbatches=1)
  variables = {k: tf.constant(v) for k, v in _stacked_as(2, initial).items()}
  for m in (2, 4, 16):
    for remat in (True, False):
      np.testing.assert_allclose(_forward(variables, x, pipelined=True, microbatches=m, remat=remat, repeats=2),
                                 expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape,m", [("stage", 2), ("stage_x_batch", 4)])
def test_the_circular_schedule_trains_as_one_device_every_weight_and_slot(shape, m):
  # 4 blocks as 2 rounds of 2 stages, 5 Adam steps, against the 4 blocks in a row on one device. Measured: weights
  # 6e-8 ({stage: 2}, m = 2) and 1.2e-7 ({stage: 2, batch: 2}, m = 4), slots 1.5e-7, losses 1.8e-7; the floor (the
  # same steps through stacked_pipeline on one device) 1.5e-7 (m = 2), 1.2e-7 (m = 4). Bound 5e-7, as above.
  initial, data = _initial(stages=4), _data()
  one, one_opt, one_losses = _one_device(5, initial, data)
  _, ours, opt, losses, _, _ = _global(shape, 5, initial, data, microbatches=m, repeats=2)
  np.testing.assert_allclose(losses, one_losses, rtol=0, atol=5e-7)
  for name in initial:
    np.testing.assert_allclose(np.reshape(ours[name].numpy(), initial[name].shape), one[name].numpy(), rtol=0,
                               atol=5e-7, err_msg=name)
  for a, b in zip(opt.variables, one_opt.variables):  # Adam's slots and its step counter
    np.testing.assert_allclose(np.reshape(a.numpy(), np.shape(b.numpy())), np.asarray(b.numpy()), rtol=0,
                               atol=5e-7, err_msg=a.path)


def test_the_circular_schedule_keeps_each_stage_on_its_device_and_sends_a_tile_each_way():
  initial, data = _initial(stages=4), _data()
  repl, _, _, _, step, dataset = _global("stage_x_batch", 1, initial, data, microbatches=4, repeats=2)
  report = repl.explain(step, dataset)
  permutes = [r for r in report.inside_rows if r.kind == "permute"]
  assert len(permutes) == 2 and all(r.shape == (1, ROWS // 4 // 2, WIDTH) for r in permutes), permutes
  gathers = [r for r in report.collective_rows + report.inside_rows if r.kind == "all_gather"]
  assert not gathers, gathers
  stacked = sum(v.nbytes for k, v in initial.items() if k.startswith("blocks/"))
  others = sum(v.nbytes for k, v in initial.items() if not k.startswith("blocks/"))
  for device in repl.memory(step, dataset).devices:  # each device: its stage's 2 blocks, weights and Adam's slots
    assert device.variable_bytes <= 3 * (stacked / P + others) + 16, device


def test_mistakes_are_named():
  x = tf.ones([6, 3])
  with pytest.raises(replicator.ArgumentError, match=r"4 microbatches do not divide.*Fix: a number of microbatches"):
    replicator.stacked_pipeline(lambda w, h: h @ w, tf.ones([2, 3, 3]), x, microbatches=4)
  with pytest.raises(replicator.ArgumentError, match=r"stacked along a first dimension of the same size"):
    replicator.stacked_pipeline(lambda w, h: h, {"a": tf.ones([2, 3]), "b": tf.ones([3, 3])}, x, microbatches=2)
  with pytest.raises(replicator.ArgumentError, match=r"2 stages and 2 rounds need at least 2 microbatches.*Fix"):
    replicator.stacked_pipeline(lambda w, h: h @ w, tf.ones([2, 2, 3, 3]), x, microbatches=1, repeats=2)
  with pytest.raises(replicator.ArgumentError, match=r"stacked as \[repeats = 3, stages, ...\].*found leading "
                     r"dimensions \[\(2, 2\)\]"):
    replicator.stacked_pipeline(lambda w, h: h @ w, tf.ones([2, 2, 3, 3]), x, microbatches=2, repeats=3)
  with pytest.raises(replicator.ArgumentError, match=r"found leading dimensions \['too few dimensions'\]"):
    replicator.stacked_pipeline(lambda w, h: h, tf.ones([2]), x, microbatches=2, repeats=2)
  with pytest.raises(replicator.ArgumentError, match=r"repeats=0.*expected a positive int"):
    replicator.stacked_pipeline(lambda w, h: h @ w, tf.ones([2, 3, 3]), x, microbatches=2, repeats=0)
  with pytest.raises(replicator.ArgumentError, match=r"returned \(\[3, 4\], 'float32'\) for x of \(\[3, 3\], 'float32'\); expected the same"):
    replicator.stacked_pipeline(lambda w, h: h @ w, tf.ones([2, 3, 4]), x, microbatches=2)
