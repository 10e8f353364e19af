"""``repl.pipeline`` (``replicator/core/_pipeline.py``): stages over a mesh axis, microbatches streamed through.

Checked against one device running the stages in a row on the whole batch (loss and every gradient; every
weight and Adam slot after 20 steps with a data axis too), the schedules' orders against their definitions
(GPipe; 1F1B: ``p - s - 1`` warm-up forward passes, then one of each), ``explain`` (the activations and
their gradients sent between neighbours only: ``2 m (p - 1)`` permutes of one pair each, plain edges in one
process) and the memory report (1F1B's activations on the first stage against GPipe's).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import assert_held_gradients
from conftest import copies_distance
from conftest import cpus
from stage_losses import AddsLosses

import mesh
import replicator
from replicator.core import _pipeline
from replicator.state import _variables

ROWS, IN = 10, 6
WIDTHS = (9, 4, 6, 3, 8, 5, 7, 1)


def _stages(p, seed=1, widths=WIDTHS):
  """``p`` Sequential stages of Dense layers (tanh between), built: 6 -> ... -> 1."""
  keras.utils.set_random_seed(seed)
  stages, d = [], IN
  for k, w in enumerate(widths[-p:]):
    stage = keras.Sequential([keras.layers.Dense(w, activation="tanh" if k < p - 1 else None)])
    stage.build((None, d))
    stages.append(stage)
    d = w
  return stages


def _data(rows=ROWS, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(rows, IN)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def _one_device(stages, x, y):
  with tf.GradientTape() as tape:
    h = tf.constant(x)
    for stage in stages:
      h = stage(h)
    loss = tf.reduce_mean(keras.losses.mean_squared_error(y, h))
  return float(loss), [g.numpy() for g in tape.gradient(loss, replicator.pipeline_variables(stages))]


@pytest.mark.parametrize("p", [2, 4])
def test_the_schedules_run_each_stage_s_passes_in_their_order(p):
  m = 6
  for s in range(p):
    gpipe = _pipeline.device_order("gpipe", s, p, 1, m)
    assert gpipe == [("F", s, j) for j in range(m)] + [("B", s, j) for j in range(m)]
    one = _pipeline.device_order("1f1b", s, p, 1, m)
    warmup = p - s - 1
    assert one[:warmup] == [("F", s, j) for j in range(warmup)]
    assert one[warmup:warmup + 2] == [("F", s, warmup), ("B", s, 0)]
    assert sorted(one) == sorted(gpipe)
    assert _in_flight(one) == p - s  # GPipe's: m
  for v, m in ((2, p), (2, 2 * p), (3, 2 * p)):  # interleaved: v stages a device, microbatches in groups of p
    for d in range(p):
      order = _pipeline.device_order("interleaved", d, p, v, m)
      mine = [d + c * p for c in range(v)]
      assert sorted(order) == sorted((k, g, j) for k in "FB" for g in mine for j in range(m))
      warmup = m * v if m == p else 2 * (p - d - 1) + (v - 1) * p
      assert all(k == "F" for k, _, _ in order[:warmup]) and (warmup == m * v or order[warmup + 1][0] == "B")
      # forward passes stage by stage in groups of p microbatches (Megatron-LM's order)
      assert [g for k, g, _ in order if k == "F"][:p] == [mine[0]] * p
  for schedule, v in (("gpipe", 1), ("1f1b", 1), ("gpipe", 2), ("interleaved", 2)):
    for m in (p, 2 * p) if schedule == "interleaved" else (1, 2, 3, 8):
      done = set()
      for kind, g, j in _pipeline.global_order(schedule, p, v, m):  # each pass after what it needs
        if kind == "F" and g > 0:
          assert ("F", g - 1, j) in done
        if kind == "B":
          assert ("F", g, j) in done and (g == p * v - 1 or ("B", g + 1, j) in done)
        done.add((kind, g, j))
      assert len(done) == 2 * p * v * m


def _in_flight(order) -> int:
  """The most microbatches whose forward pass has run and backward pass not, over ``order``."""
  in_flight, most = 0, 0
  for kind, _, _ in order:
    in_flight += 1 if kind == "F" else -1
    most = max(most, in_flight)
  return most


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 2), (2, 4), (2, 8), (4, 1), (4, 2), (4, 4), (4, 8), (4, 3)])
def test_the_loss_and_every_gradient_are_one_devices(schedule, p, m):
  _check_against_one_device(schedule, p, m)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (2, 3, 4)])
def test_interleaved_stages_give_one_devices_loss_and_gradients(p, v, m):
  _check_against_one_device("interleaved", p, m, v)


def test_gpipe_runs_several_stages_a_device_too():
  _check_against_one_device("gpipe", 2, 4, 2)


def _check_against_one_device(schedule, p, m, v=1):
  # 10 rows: microbatches of 5, 3+3+2+2, 2+1+..., 4+3+3 (weighted by their rows). Measured: 1.2e-7 from one device
  # at most (float32 sums in another order), so 1e-6; a microbatch weighted wrongly or a gradient sent to the
  # wrong stage is 1e-2 off or more.
  x, y = _data()
  expected_loss, expected = _one_device(_stages(p * v), x, y)
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)))
  with repl.context():
    stages = _stages(p * v)
  loss, grads = repl.run(lambda: repl.pipeline(stages, tf.constant(x), tf.constant(y),
                                               keras.losses.mean_squared_error, microbatches=m, schedule=schedule))
  np.testing.assert_allclose([float(value) for value in loss], [expected_loss] * p, atol=1e-6)
  # each stage's gradients on its device (zeros on the others: its variables live there only)
  assert_held_gradients(grads, replicator.pipeline_variables(stages), expected, atol=1e-6)


def test_a_pipeline_with_a_data_axis_trains_as_one_device_every_weight_and_slot():
  # {"stage": 2, "batch": 2}: each batch replica's 8 rows in 4 microbatches; wrap_optimizer means the gradients
  # over the batch axis. 20 Adam steps at 1e-2: 1e-6 from one device's after the same steps (measured 3e-7).
  rng = np.random.default_rng(5)
  x, y = rng.normal(size=(16, IN)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
  one, one_opt = _stages(2), keras.optimizers.Adam(1e-2)

  @tf.function
  def one_step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, one[1](one[0](x))))
    variables = replicator.pipeline_variables(one)
    one_opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2, "batch": 2}, devices=cpus(4)), batch_axes=("batch",))
  with repl.context():
    stages, opt = _stages(2), repl.wrap_optimizer(keras.optimizers.Adam(1e-2))
  variables = replicator.pipeline_variables(stages)
  data = tf.data.Dataset.from_tensors((x, y)).repeat()

  def step(batch):
    loss, grads = repl.pipeline(stages, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=4)
    opt.apply_gradients(zip(grads, variables))
    return repl.all_reduce(loss, "mean", axis="batch")

  for _ in range(20):
    expected = float(one_step())
    got = repl.run(step, data)
  np.testing.assert_allclose([float(v) for v in got], [expected] * 4, atol=1e-6)
  assert_every_copy(variables, replicator.pipeline_variables(one), atol=1e-6)
  assert_every_copy(opt.variables, one_opt.variables, atol=1e-6)


def test_activations_go_between_neighbours_only_as_plain_edges():
  p, m = 4, 3
  x, y = _data()
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)))
  with repl.context():
    stages = _stages(p)

  def step():
    return repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error, microbatches=m)

  plan = repl.explain(step)
  permutes = [c for c in plan.collectives if c.kind == "permute"]
  assert len(permutes) == 2 * m * (p - 1)
  assert all(len(c.param_dict["perm"]) == 1 and c.implementation == "one_device" for c in permutes)
  forward = sorted(c.param_dict["perm"][0] for c in permutes if "activation" in c.location)
  assert forward == sorted([(s, s + 1) for s in range(p - 1)] * m)
  others = [c for c in plan.collectives if c.kind != "permute"]  # the loss, summed once (each stage's weights and
  assert [(c.kind, c.shape.as_list()) for c in others] == [("all_reduce", [])]  # gradients stay on its device)
  assert "the loss, the stages' gradients and state" in others[0].location


def test_1f1b_keeps_fewer_microbatches_activations_on_the_first_stage_than_gpipe():
  # The memory report's peak on the first stage's device (its order follows the schedule's control edges): the
  # forward activations live there, GPipe's m microbatches', 1F1B's p (m = 2p): 4 and 2 of 8,192 bytes each, in
  # peaks of 41,728 and 32,320 step bytes (measured; the rest: the microbatches' inputs, the weights' gradients
  # summed so far, the next stage's gradient arriving).
  p, m, rows = 2, 4, 32
  x, y = _data(rows)
  held, peaks = {}, {}
  for schedule in ("gpipe", "1f1b"):
    repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)))
    with repl.context():
      stages = _stages(p, widths=(256, 1))

    def step(schedule=schedule, stages=stages, repl=repl):
      return repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error, microbatches=m,
                           schedule=schedule)

    first = repl.explain(step).memory.devices[0]
    activations = [t for t in first.live_at_peak if t.bytes == (rows // m) * 256 * 4 and t.op_type != "Fill"
                   and not t.tensor.startswith("gradient_tape/")]
    held[schedule], peaks[schedule] = len(activations), first.step_peak_bytes
  assert held == {"gpipe": m, "1f1b": p}, (held, peaks)
  assert peaks["1f1b"] < peaks["gpipe"], peaks


def test_mistakes_are_named():
  x, y = _data()
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)))
  with repl.context():
    stages = _stages(2)

  def run(stages=stages, **kwargs):
    kwargs = {"microbatches": 2, **kwargs}
    with warnings.catch_warnings():  # (a new step object each call: warned that it is built anew)
      warnings.simplefilter("ignore", UserWarning)
      return repl.run(lambda: repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                            **kwargs))

  with pytest.raises(replicator.ArgumentError, match=r"3 stages over \('stage',\) \(2 devices\); expected one stage"):
    run(stages + stages[:1])
  with pytest.raises(replicator.ArgumentError,
                     match=r"schedule='zb'\).*expected one of \('gpipe', '1f1b', 'interleaved'\)"):
    run(schedule="zb")
  with pytest.raises(replicator.ArgumentError, match=r"schedule='interleaved'\).*2 stages over \('stage',\) \(2 "
                                                     r"devices\); expected several stages a device"):
    run(schedule="interleaved")
  with pytest.raises(replicator.ArgumentError, match=r"microbatches=3, schedule='interleaved'\).*expected a multiple "
                                                     r"of 2. Fix: microbatches=4"):
    run(stages + stages, schedule="interleaved", microbatches=3)
  with pytest.raises(replicator.ArgumentError, match=r"microbatches=11\).*has 10 rows, fewer than the microbatches"):
    run(microbatches=11)
  with pytest.raises(replicator.ReplicaContextError):
    repl.pipeline(stages, x, y, keras.losses.mean_squared_error, microbatches=2)


def test_stacked_blocks_split_over_the_stages_keep_a_block_a_device_and_train_as_one_device():
  # praxis's and shard_map's form: identical blocks' weights stacked, split over "stage" (one block a device), a
  # replicated head on the last stage. 20 Adam steps: every weight within 2e-6 of one device's (measured 9.5e-7;
  # one device's own float32 weights are 3.1e-7 from a float64 run of the same steps); variables and Adam slots a
  # device: the blocks' 1/p (and the head's, where the step keeps it).
  p, d, rows = 4, 16, 12
  rng = np.random.default_rng(2)
  x, y = rng.normal(size=(rows, d)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")
  kernels, biases = (rng.normal(size=(p, d, d)) / 4).astype("float32"), (rng.normal(size=(p, d)) / 4).astype("float32")

  def head_layer():
    keras.utils.set_random_seed(3)
    head = keras.layers.Dense(1)
    head.build((None, d))
    return head

  one_head, one_opt = head_layer(), keras.optimizers.Adam(1e-2)
  one_w, one_b = tf.Variable(kernels), tf.Variable(biases)

  @tf.function
  def one_step():
    with tf.GradientTape() as tape:
      h = tf.constant(x)
      for k in range(p):
        h = tf.tanh(h @ one_w[k] + one_b[k])
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, one_head(h)))
    variables = [one_w, one_b] + one_head.trainable_variables
    one_opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  layouts = mesh.LayoutMap({r"^blocks/kernel$": ("stage", None, None), r"^blocks/bias$": ("stage", None)})
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)), layouts=layouts)
  with repl.context():
    w, b = tf.Variable(kernels, name="blocks/kernel"), tf.Variable(biases, name="blocks/bias")
    head, opt = head_layer(), repl.wrap_optimizer(keras.optimizers.Adam(1e-2))
  variables = [w, b] + head.trainable_variables

  def block(h):
    return tf.tanh(h @ w[0] + b[0])  # (in a replica: its stage's block, [1, d, d])

  stages = [block] * (p - 1) + [lambda h: head(block(h))]

  def step():
    loss, grads = repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                microbatches=4, variables=variables)
    opt.apply_gradients(zip(grads, variables))
    return loss

  for _ in range(20):
    expected = float(one_step())
    got = repl.run(step)
  np.testing.assert_allclose([float(v) for v in got], [expected] * p, atol=1e-6)
  np.testing.assert_allclose(w.numpy(), one_w.numpy(), atol=2e-6)
  np.testing.assert_allclose(b.numpy(), one_b.numpy(), atol=2e-6)
  assert_every_copy(head.trainable_variables, one_head.trainable_variables, atol=2e-6)
  memory = repl.memory(step)
  blocks, head_bytes = (kernels.size + biases.size) * 4, (d + 1) * 4
  for device in memory.devices:  # the weights and their two Adam slots (and Adam's counters)
    assert 3 * blocks / p <= device.variable_bytes <= 3 * (blocks / p + head_bytes) + 16, device


def test_a_batch_of_unknown_rows_is_split_at_run_time():
  # A dataset batched without drop_remainder: the rows are not static; 10 of them in 4 microbatches (3, 3, 2, 2)
  # and 3 of them in 4 (one empty, weighted 0).
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)), batch_axes=())
  with repl.context():
    stages = _stages(2)

  def step(batch):
    return repl.pipeline(stages, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=4)

  for rows in (10, 3):
    x, y = _data(rows)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    assert data.element_spec[0].shape[0] is None
    expected_loss, expected = _one_device(_stages(2), x, y)
    loss, grads = repl.run(step, data)
    np.testing.assert_allclose([float(value) for value in loss], [expected_loss] * 2, atol=1e-6)
    assert_held_gradients(grads, replicator.pipeline_variables(stages), expected, atol=1e-6)


def _stacked(p, kernels, biases, head_weights):
  """A Replicator of ``p`` stages over stacked blocks (``kernels.shape[0] / p`` blocks a stage), a replicated head;
  its step and variables."""
  layouts = mesh.LayoutMap({r"^blocks/kernel$": ("stage", None, None), r"^blocks/bias$": ("stage", None)})
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)), layouts=layouts)
  with repl.context():
    w, b = tf.Variable(kernels, name="blocks/kernel"), tf.Variable(biases, name="blocks/bias")
    head = keras.layers.Dense(1)
    head.build((None, kernels.shape[1]))
    opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-2))
  for v, value in zip(head.weights, head_weights):
    v.assign(value)
  variables = [w, b] + head.trainable_variables
  per_stage = kernels.shape[0] // p

  def blocks(h):
    for k in range(per_stage):  # (this stage's blocks: its piece of the stacked weights)
      h = tf.tanh(h @ w[k] + b[k])
    return h

  stages = [blocks] * (p - 1) + [lambda h: head(blocks(h))]
  rng = np.random.default_rng(9)
  x, y = rng.normal(size=(8, kernels.shape[1])).astype("float32"), rng.normal(size=(8, 1)).astype("float32")

  def step():
    loss, grads = repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                microbatches=4, variables=variables)
    opt.apply_gradients(zip(grads, variables))
    return loss

  return repl, step, variables, opt


def test_a_pipeline_checkpoint_restores_on_another_number_of_stages_and_on_one_device(tmp_path):
  # Saved at 4 stages (a block each), restored at 2 (two blocks each) and into plain variables: the same values;
  # 2 more steps at 4 and at 2 stages then agree (1e-6; measured 7.5e-9).
  d = 8
  rng = np.random.default_rng(4)
  kernels, biases = (rng.normal(size=(4, d, d)) / 3).astype("float32"), (rng.normal(size=(4, d)) / 3).astype("float32")
  head_weights = [(rng.normal(size=(d, 1)) / 3).astype("float32"), np.zeros(1, "float32")]
  repl4, step4, vars4, opt4 = _stacked(4, kernels, biases, head_weights)
  for _ in range(3):
    repl4.run(step4)
  path = tf.train.Checkpoint(variables=vars4, opt=opt4).write(str(tmp_path / "ckpt"))
  saved = [v.numpy() for v in vars4]

  zeros = [np.zeros_like(a) for a in (kernels, biases)]
  repl2, step2, vars2, opt2 = _stacked(2, *zeros, [np.zeros_like(a) for a in head_weights])
  repl2.run(step2)  # (the optimizer's slots made, then overwritten)
  tf.train.Checkpoint(variables=vars2, opt=opt2).read(path).assert_consumed()
  for got, want in zip(vars2, saved):
    np.testing.assert_array_equal(got.numpy(), want)
  plain = [tf.Variable(tf.zeros_like(a)) for a in saved]
  tf.train.Checkpoint(variables=plain).read(path).expect_partial()
  for got, want in zip(plain, saved):
    np.testing.assert_array_equal(got.numpy(), want)
  for _ in range(2):
    repl4.run(step4)
    repl2.run(step2)
  for a, b in zip(vars2, vars4):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def _bn_stages(p, seed=3):
  """``p`` stages of a small conv net, BatchNormalization in each but the last (momentum 0.8: its moving
  statistics move visibly in a step): [conv, BN, relu] ..., [pool, dense]; each called with training=True."""
  keras.utils.set_random_seed(seed)
  layers, channels = [], 2
  for k in range(p - 1):
    block = keras.Sequential([keras.layers.Conv2D(3 + k, 3, padding="same", use_bias=False),
                              keras.layers.BatchNormalization(momentum=0.8, name=f"bn{k}"), keras.layers.ReLU()])
    block.build((None, 6, 6, channels))
    layers.append(block)
    channels = 3 + k
  head = keras.Sequential([keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)])
  head.build((None, 6, 6, channels))
  return layers + [head]


def _bn_data(rows, seed=4):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(rows, 6, 6, 2)).astype("float32") + 0.5, rng.normal(size=(rows, 1)).astype("float32")


def _ghost_batch_step(stages, x, y, groups):
  """One device's step with BatchNormalization over each group of rows (a microbatch) on its own: the loss and
  gradients summed over the groups weighted by their rows, each BatchNormalization's moving statistics updated
  once from the groups' mean and variance, averaged by rows (Keras 2's ``virtual_batch_size``'s update)."""
  variables, rows = replicator.pipeline_variables(stages), len(x)
  norms = [layer for stage in stages for layer in stage.layers if isinstance(layer, keras.layers.BatchNormalization)]
  before = [(bn.moving_mean.numpy(), bn.moving_variance.numpy()) for bn in norms]
  moments = [[np.zeros_like(mean), np.zeros_like(var)] for mean, var in before]
  loss, grads = 0.0, [np.zeros(v.shape, np.float32) for v in variables]
  for group in groups:
    weight = len(group) / rows
    with tf.GradientTape() as tape:
      h, k = tf.constant(x[group]), 0
      for stage in stages:
        for layer in stage.layers:
          if isinstance(layer, keras.layers.BatchNormalization):
            mean, var = tf.nn.moments(h, axes=[0, 1, 2])
            moments[k][0] += weight * mean.numpy()
            moments[k][1] += weight * var.numpy()
            k += 1
          h = layer(h, training=True)
      part = tf.reduce_mean(keras.losses.mean_squared_error(y[group], h)) * weight
    loss += float(part)
    grads = [total + g.numpy() for total, g in zip(grads, tape.gradient(part, variables))]
  for bn, (mean, var), (new_mean, new_var) in zip(norms, before, moments):
    bn.moving_mean.assign(0.8 * mean + 0.2 * new_mean)
    bn.moving_variance.assign(0.8 * var + 0.2 * new_var)
  return loss, grads, norms


def _groups(rows, m, replicas=1):
  """The rows of each microbatch, as repl.pipeline splits each batch replica's rows (np.array_split)."""
  per = rows // replicas
  return [part for r in range(replicas) for part in np.array_split(np.arange(r * per, (r + 1) * per), m)]


@pytest.mark.parametrize("schedule,p,m", [
    ("1f1b", 2, 4), ("gpipe", 2, 1), ("interleaved", 2, 2),
    pytest.param("gpipe", 2, 4, marks=pytest.mark.full_grid), pytest.param("1f1b", 2, 8, marks=pytest.mark.full_grid),
    pytest.param("1f1b", 4, 2, marks=pytest.mark.full_grid), pytest.param("gpipe", 4, 4, marks=pytest.mark.full_grid),
    pytest.param("interleaved", 2, 4, marks=pytest.mark.full_grid)])
def test_batch_normalization_normalizes_each_microbatch_and_updates_its_moving_statistics_once_a_step(schedule, p, m):
  # Each microbatch normalized by its own statistics (one device running the microbatches one by one); the moving
  # statistics written once, on every device alike, from the microbatches' (a mean by rows: the mean is the batch's,
  # the variance the microbatches' mean variance). 10 rows (ragged microbatches: 3+3+2+2 at m=4). Measured: loss and
  # gradients 6.0e-8 at most from one device, moving statistics 6.0e-8 (the same sums in another order); so 1e-6.
  # Writing the statistics a microbatch at a time keeps 0.8^m of the old value where once keeps 0.8; a copy left as
  # it was misses the step's whole move (0.2 of the batch's statistics, about 0.1 here).
  stages_count = 2 * p if schedule == "interleaved" else p
  x, y = _bn_data(10)
  one = _bn_stages(stages_count)
  expected_loss, expected, norms = _ghost_batch_step(one, x, y, _groups(10, m))
  full = 0.8 * 0.0 + 0.2 * tf.reduce_mean(one[0].layers[0](x), axis=[0, 1, 2]).numpy()  # one device's whole batch
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)))
  with repl.context():
    stages = _bn_stages(stages_count)
  calls = [lambda h, s=stage: s(h, training=True) for stage in stages]
  loss, grads = repl.run(lambda: repl.pipeline(calls, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                               microbatches=m, schedule=schedule,
                                               variables=replicator.pipeline_variables(stages)))
  np.testing.assert_allclose([float(value) for value in loss], [expected_loss] * p, atol=1e-6)
  assert_held_gradients(grads, replicator.pipeline_variables(stages), expected, atol=1e-6)
  ours = [layer for stage in stages for layer in stage.layers if isinstance(layer, keras.layers.BatchNormalization)]
  assert_every_copy([v for bn in ours for v in (bn.moving_mean, bn.moving_variance)],
                    [v for bn in norms for v in (bn.moving_mean, bn.moving_variance)], atol=1e-6)
  assert copies_distance([ours[0].moving_mean], [full]) < 1e-6  # the batch's mean, as one device's BatchNormalization


def test_batch_normalization_in_a_pipeline_with_a_data_axis_trains_as_one_device_every_weight_slot_and_statistic():
  # {"stage": 2, "batch": 2}, 16 rows: each batch replica's 8 in 4 microbatches of 2, normalized on their own; the
  # moving statistics' means over the batch replicas (as data parallelism takes BatchNormalization's). 20 steps of
  # SGD with momentum against one device's ghost-batch steps: measured 1.2e-7 (weights; slots 5.6e-9); the
  # one-device floor (its microbatches summed in reverse order) 1.2e-7; bound 1e-6. (Not Adam: a kernel entry whose
  # gradient is 1.4e-5, 600 times below the median, has Adam's update drift 1e-7 a step from float32 noise alone.)
  x, y = _bn_data(16, seed=6)
  one, one_opt = _bn_stages(2), keras.optimizers.SGD(0.05, momentum=0.9)
  variables = replicator.pipeline_variables(one)
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2, "batch": 2}, devices=cpus(4)), batch_axes=("batch",))
  with repl.context():
    stages, opt = _bn_stages(2), repl.wrap_optimizer(keras.optimizers.SGD(0.05, momentum=0.9))
  ours = replicator.pipeline_variables(stages)
  calls = [lambda h, s=stage: s(h, training=True) for stage in stages]
  data = tf.data.Dataset.from_tensors((x, y)).repeat()

  def step(batch):
    loss, grads = repl.pipeline(calls, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=4,
                                variables=ours)
    opt.apply_gradients(zip(grads, ours))
    return repl.all_reduce(loss, "mean", axis="batch")

  for _ in range(20):
    expected, grads, norms = _ghost_batch_step(one, x, y, _groups(16, 4, replicas=2))
    one_opt.apply_gradients(zip([tf.constant(g) for g in grads], variables))
    got = repl.run(step, data)
  np.testing.assert_allclose([float(v) for v in got], [expected] * 4, atol=1e-6)
  assert_every_copy(ours, variables, atol=1e-6)
  assert_every_copy(opt.variables, one_opt.variables, atol=1e-6)
  bn = stages[0].layers[1]
  assert_every_copy([bn.moving_mean, bn.moving_variance], [norms[0].moving_mean, norms[0].moving_variance], atol=1e-6)


def test_state_a_stage_cannot_write_once_a_step_is_named():
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)))
  with repl.context():
    keras.utils.set_random_seed(1)
    first = keras.Sequential([keras.layers.Dense(8)])
    first.build((None, IN))
    last = keras.Sequential([keras.layers.Dense(1)])
    last.build((None, 8))
    counter = tf.Variable(0.0, trainable=False, name="rows_seen")
    shared = tf.Variable(0.0, trainable=False, name="shared_state")
  x, y = _data()
  variables = first.trainable_variables + last.trainable_variables

  def run(stages):
    return repl.run(lambda: repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                          microbatches=2, variables=variables))

  def counting(h):
    counter.assign_add(1.0)
    return first(h)

  with pytest.raises(replicator.UnsupportedError, match=r"stage 0 writes \(by a delta or rows\) the variable "
                                                          r"'rows_seen.*', which every device along \('stage',\) "
                                                          r"holds.*Fix: write it with assign"):
    run([counting, last])

  def training(h):
    first.layers[0].kernel.assign(first.layers[0].kernel * 0.5)
    return first(h)

  with pytest.raises(replicator.UnsupportedError, match=r"stage 0 assigns the trained the variable '.*kernel.*'.*"
                                                          r"Fix: make the variable not trainable"):
    run([training, last])

  def writing(stage):
    def call(h):
      shared.assign(tf.reduce_mean(h))
      return stage(h)
    return call

  with pytest.raises(replicator.UnsupportedError, match=r"stage 1 and stage 0 both write the variable "
                                                          r"'shared_state.*'.*Fix: give each stage its own"):
    run([writing(first), writing(last)])


def test_a_keras_hub_decoder_cut_by_hand_over_two_stages_with_its_tied_embedding_is_one_device():
  # KerasHub's Llama (rotary positions, grouped-query attention, a padding mask passed along with the activations)
  # cut into the docs' recipe's two stages; its token embedding is also its output layer (tie_word_embeddings): on
  # both stages, its gradient the sum of the two. Loss and every gradient: 3e-8 from one device (measured), so 1e-6.
  keras_hub = pytest.importorskip("keras_hub", reason="KerasHub is a test dependency: see the README's test command")
  vocabulary, length, rows = 64, 8, 4

  def backbone():
    keras.utils.set_random_seed(2)
    return keras_hub.models.LlamaBackbone(vocabulary_size=vocabulary, num_layers=2, num_query_heads=2,
                                          num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
                                          tie_word_embeddings=True)

  rng = np.random.default_rng(0)
  ids = rng.integers(1, vocabulary, (rows, length)).astype("int32")
  mask = np.ones((rows, length), "int32")
  mask[:, -2:] = 0
  labels = rng.integers(0, vocabulary, (rows, length)).astype("int32")

  def loss_fn(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

  one = backbone()
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(loss_fn(labels, one.token_embedding(one({"token_ids": ids, "padding_mask": mask}),
                                                              reverse=True)))
  expected = tape.gradient(loss, one.trainable_variables)

  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)))
  with repl.context():
    model = backbone()

  def first(batch):  # the embedding and the first decoder block; the padding mask goes along
    tokens, padding = batch
    return model.transformer_layers[0](model.token_embedding(tokens), decoder_padding_mask=padding), padding

  def last(carried):  # the second block, the final norm, and the embedding again as the output layer
    x, padding = carried
    x = model.layer_norm(model.transformer_layers[1](x, decoder_padding_mask=padding))
    return model.token_embedding(x, reverse=True)

  got, grads = repl.run(lambda: repl.pipeline([first, last], (tf.constant(ids), tf.constant(mask)),
                                              tf.constant(labels), loss_fn, microbatches=2,
                                              variables=model.trainable_variables))
  np.testing.assert_allclose([float(value) for value in got], [float(loss)] * 2, atol=1e-6)
  assert_held_gradients(grads, model.trainable_variables, [g.numpy() for g in expected], atol=1e-6)
  embedding = model.token_embedding.embeddings  # (read by both stages: on both devices, the two parts summed)
  assert len(_variables.underlying(embedding).components) == 2


# -- each stage's variables and slots on its own devices ---------------------------------------------------------

WIDE = 16


def _mlp(seed=7):
  """4 Dense layers of one width (the two halves hold as many bytes), built."""
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((WIDE,))] + [keras.layers.Dense(WIDE, activation="tanh") for _ in range(3)]
                          + [keras.layers.Dense(WIDE)])


def _optimizer(name):
  return keras.optimizers.SGD(5e-2, momentum=0.9) if name == "sgd" else keras.optimizers.Adam(1e-2)


def _mlp_data(rows=16, seed=11):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(rows, WIDE)).astype("float32"), rng.normal(size=(rows, WIDE)).astype("float32")


def _placed_mlp(shape, schedule, optimizer, update="auto"):
  """The MLP cut into 2 stages over ``shape`` (a batch axis too if it has one), its wrapped optimizer and step."""
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(int(np.prod(list(shape.values()))))),
                               batch_axes=("batch",) if "batch" in shape else ())
  with repl.context():
    model, opt = _mlp(), repl.wrap_optimizer(_optimizer(optimizer), update=update)
  stages = replicator.split_stages(model, split_points=[model.layers[2].name])
  variables = replicator.pipeline_variables(stages)

  def step(batch):
    loss, grads = repl.pipeline(stages, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=4,
                                schedule=schedule)
    opt.apply_gradients(zip(grads, variables))
    return loss

  return repl, model, stages, opt, step


def _one_device_steps(optimizer, x, y, steps):
  model, opt = _mlp(), _optimizer(optimizer)

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  for _ in range(steps):
    step()
  return model, opt


def _stage_devices(repl, s):
  return {mesh.canonical_name(d) for r, d in enumerate(repl.devices) if repl.mesh.axis_index(r, ("stage",)) == s}


@pytest.mark.parametrize("shape,schedule,optimizer", [
    ({"stage": 2}, "gpipe", "sgd"), ({"stage": 2}, "1f1b", "adam"),
    ({"stage": 2, "batch": 2}, "gpipe", "adam"), ({"stage": 2, "batch": 2}, "1f1b", "sgd")])
def test_each_stage_keeps_its_variables_and_slots_on_its_devices_and_trains_as_one_device(shape, schedule, optimizer):
  # 6 steps; every weight and slot within 1e-6 of one device's run of the same steps on the whole batch. Measured:
  # 5.7e-7 (Adam, stage x batch), 3.9e-7 (Adam, stage), 3e-8 (SGD); the floor, one device summing the same 4
  # microbatches' gradients in float32 against its whole batch: 1.8e-7 (Adam), 3e-8 (SGD). A gradient reduced over
  # the wrong axis is off by a factor of 2.
  x, y = _mlp_data()
  repl, model, stages, opt, step = _placed_mlp(shape, schedule, optimizer)
  data = tf.data.Dataset.from_tensors((x, y)).repeat()
  for _ in range(6):
    repl.run(step, data)
  one, one_opt = _one_device_steps(optimizer, x, y, 6)
  assert copies_distance(model.trainable_variables, one.trainable_variables) < 1e-6
  assert copies_distance(opt.variables, one_opt.variables) < 1e-6
  # Each stage's weights, and their slots, only on the devices of that stage (on both batch replicas of it).
  slots = [v for v in opt.variables if v.path not in (opt.iterations.path, opt.learning_rate.path)]
  assert len(slots) == {"sgd": 1, "adam": 2}[optimizer] * len(model.trainable_variables)
  for s, stage in enumerate(stages):
    mine = {id(v.value) for v in stage.trainable_variables}
    theirs = [v for v in slots if id(_variables.slot_reference(v.value)) in mine]
    assert len(theirs) == len(slots) // 2
    for v in stage.trainable_variables + theirs:
      devices = {mesh.canonical_name(c.device) for c in v.value.components}
      assert devices == _stage_devices(repl, s), (v.path, devices)
  # The gradients of the weights are reduced over the batch axis only: over "stage" only the activations (and
  # their gradients) go, by permutes, and the loss (a scalar). With a batch axis the sharded update (the default
  # here) reduces each stage's gradients for their owners, one all-reduce an owner (its root), and each owner
  # broadcasts its new values along the batch axis.
  plan = repl.explain(step, data)
  over_stages = [c for c in plan.collectives if "stage" in c.axes and c.kind != "permute"]
  assert [(c.kind, c.shape.as_list()) for c in over_stages] == [("all_reduce", [])], over_stages
  weights = [c for c in plan.collectives if c.kind == "all_reduce" and "stage" not in c.axes]
  assert sorted(c.param_dict.get("root") for c in weights) == ([0, 1] if "batch" in shape else []), weights
  broadcasts = [c for c in plan.collectives if c.kind == "broadcast"]
  assert sorted((c.axes, c.param_dict["source"]) for c in broadcasts) == (
      [(("batch",), 0), (("batch",), 1)] if "batch" in shape else []), broadcasts


@pytest.mark.parametrize("shape", [{"stage": 2}, {"stage": 2, "batch": 2}])
def test_the_memory_report_shows_each_device_half_of_one_devices_variables_and_slots(shape):
  # The two halves of the MLP hold as many bytes: each device keeps its stage's weights and their two Adam slots,
  # 1/2 of one device's (the same model and Adam in a one-device Replicator's report) within 10%; measured 0.5005
  # (6,540 against 13,068 bytes: Adam's step counter and learning rate, 12 bytes, are on every device).
  # (The replicated update: under the sharded one the report counts on each device the slots it updates, those
  # it owns; see the sharded update's test below.)
  x, y = _mlp_data()
  data = tf.data.Dataset.from_tensors((x, y)).repeat()
  repl, _, _, _, step = _placed_mlp(shape, "1f1b", "adam", update="replicated")
  repl.run(step, data)
  one_repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 1}, devices=cpus(1)))
  with one_repl.context():
    one, one_opt = _mlp(), one_repl.wrap_optimizer(keras.optimizers.Adam(1e-2))

  def one_step(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.mean_squared_error(batch[1], one(batch[0])))
    one_opt.apply_gradients(zip(tape.gradient(loss, one.trainable_variables), one.trainable_variables))
    return loss

  one_repl.run(one_step, data)
  (whole,) = [d.variable_bytes for d in one_repl.memory(one_step, data).devices]
  halves = [d.variable_bytes for d in repl.memory(step, data).devices]
  assert all(abs(b / (whole / 2) - 1) <= 0.1 for b in halves), (halves, whole)
  assert max(halves) * 2 - whole <= 12, (halves, whole)  # (what every device keeps: Adam's counter and rate)


def _tied_projection():
  """A ``WIDE x 8`` projection (tied: used by the first stage and, transposed, by the last) and two Dense(8) layers
  between: ``(w, middle, variables)``, the same values each call."""
  keras.utils.set_random_seed(5)
  w = tf.Variable((np.random.default_rng(3).normal(size=(WIDE, 8)) / 4).astype("float32"), name="tied")
  middle = [keras.layers.Dense(8, activation="tanh") for _ in range(2)]
  for layer in middle:
    layer.build((None, 8))
  return w, middle, [w] + [v for layer in middle for v in layer.trainable_variables]


def test_a_weight_two_stages_share_lives_on_their_devices_its_gradient_summed_between_them():
  # Over 4 stages, a projection used by stage 0 and, transposed, by stage 3 (an output layer tied to its
  # embedding): on the devices of those two stages only, with its SGD-momentum slot; its gradient the sum of the two
  # stages' parts, by a permute between them (no all-reduce over the stages). 5 steps: every weight and slot
  # within 1e-6 of one device's (measured 3e-8, as the MLP's SGD runs above).
  x, y = _mlp_data()
  build = _tied_projection

  def stage_fns(w, middle):
    return [lambda h: tf.tanh(h @ w), middle[0], middle[1], lambda h: h @ tf.transpose(w)]

  w1, middle1, variables1 = build()
  opt1 = keras.optimizers.SGD(5e-2, momentum=0.9)

  @tf.function
  def one_step():
    with tf.GradientTape() as tape:
      h = tf.constant(x)
      for fn in stage_fns(w1, middle1):
        h = fn(h)
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, h))
    opt1.apply_gradients(zip(tape.gradient(loss, variables1), variables1))

  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 4}, devices=cpus(4)))
  with repl.context():
    w, middle, variables = build()
    opt = repl.wrap_optimizer(keras.optimizers.SGD(5e-2, momentum=0.9))
  fns = stage_fns(w, middle)

  def step():
    loss, grads = repl.pipeline(fns, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                microbatches=4, variables=variables)
    opt.apply_gradients(zip(grads, variables))
    return loss

  for _ in range(5):
    one_step()
    repl.run(step)
  assert copies_distance(variables, variables1) < 1e-6
  assert copies_distance(opt.variables, opt1.variables) < 1e-6
  momentum = [v for v in opt.variables if _variables.slot_reference(v.value) is w]
  for v in [w] + momentum:
    assert {mesh.canonical_name(c.device) for c in _variables.underlying(v).components} == {
        mesh.canonical_name(d) for d in cpus(4)[0::3]}
  plan = repl.explain(step)
  shared = [c for c in plan.collectives if "share" in c.location]
  assert [(c.kind, c.param_dict["perm"]) for c in shared] == [("permute", ((0, 3), (3, 0)))], shared
  assert [c.shape.as_list() for c in plan.collectives if c.kind != "permute"] == [[]]  # (the loss)


def test_a_placed_model_checkpoint_restores_onto_one_device_and_back(tmp_path):
  # Saved from the stages' devices (global values: each variable and slot once), restored into the model on one
  # device and into a new pipelined one: the same values, exactly.
  x, y = _mlp_data()
  data = tf.data.Dataset.from_tensors((x, y)).repeat()
  repl, model, _, opt, step = _placed_mlp({"stage": 2, "batch": 2}, "1f1b", "adam")
  for _ in range(2):
    repl.run(step, data)
  path = tf.train.Checkpoint(model=model, opt=opt).write(str(tmp_path / "ckpt"))
  one, one_opt = _one_device_steps("adam", x, y, 1)  # (its slots made, then overwritten)
  tf.train.Checkpoint(model=one, opt=one_opt).read(path).assert_consumed()
  assert copies_distance(model.variables, one.variables) == 0
  assert copies_distance(opt.variables, one_opt.variables) == 0
  again, again_model, _, again_opt, again_step = _placed_mlp({"stage": 2}, "gpipe", "adam")
  again.run(again_step, data)  # (placed, and its slots made; then overwritten)
  tf.train.Checkpoint(model=again_model, opt=again_opt).read(path).assert_consumed()
  assert copies_distance(again_model.variables, one.variables) == 0
  assert copies_distance(again_opt.variables, one_opt.variables) == 0
  assert len(_variables.underlying(again_model.trainable_variables[0]).components) == 1  # (still on its stage)


def test_a_stage_s_variable_used_on_another_stage_and_an_optimizer_coupling_the_stages_are_named():
  x, y = _mlp_data()
  data = tf.data.Dataset.from_tensors((x, y)).repeat()
  repl, _, stages, _, step = _placed_mlp({"stage": 2}, "1f1b", "adam")
  repl.run(step, data)  # (placed)
  variables = replicator.pipeline_variables(stages)

  def penalized(batch):  # a weight penalty over every stage's weights, on every device
    loss, _ = repl.pipeline(stages, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=2)
    return loss + 1e-3 * tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables])

  with pytest.raises(replicator.UnsupportedError, match=r"Replica 0 \(position 0 along \('stage',\)\) uses the "
                                                          r"variable '.*', which lives only on the devices of "
                                                          r"stage\(s\) \[1\] along \('stage',\).*Fix: use it inside "
                                                          r"its stage's function"):
    repl.run(penalized, data)
  with repl.context():
    clipped = repl.wrap_optimizer(keras.optimizers.SGD(0.1, global_clipnorm=1.0))

  def clipped_step(batch):
    loss, grads = repl.pipeline(stages, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=2)
    clipped.apply_gradients(zip(grads, variables))
    return loss

  with pytest.raises(replicator.UnsupportedError, match=r"SGD updates variables repl.pipeline placed on their "
                                                          r"stages' devices.*but global_clipnorm clips by the norm of "
                                                          r"every stage's gradients together.*Fix: clip each "
                                                          r"variable's gradient"):
    repl.run(clipped_step, data)


def _accumulating_pipeline(update="auto"):
  """The MLP over {"stage": 2, "batch": 2} with Adam accumulating 2 steps, its stages and step."""
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2, "batch": 2}, devices=cpus(4)), batch_axes=("batch",))
  with repl.context():
    model = _mlp()
    opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-2), accumulation_steps=2, update=update)
  stages = replicator.split_stages(model, split_points=[model.layers[2].name])
  variables = replicator.pipeline_variables(stages)

  def step(batch):
    loss, grads = repl.pipeline(stages, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=4)
    opt.apply_gradients(zip(grads, variables))
    return loss

  return repl, model, stages, opt, step


def _batches(count, rows=16):
  """``count`` different batches of the MLP's data, and a dataset giving them in turn."""
  xs, ys = zip(*(_mlp_data(rows, seed=20 + n) for n in range(count)))
  return list(zip(xs, ys)), tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys)))


def _one_device_gradients(model, x, y):
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
  return tape.gradient(loss, model.trainable_variables)


def _one_device_accumulated(batches, k=2):
  """One device's MLP and Adam, each update the mean of ``k`` batches' gradients (``batches`` in turn)."""
  model, opt = _mlp(), keras.optimizers.Adam(1e-2)
  for n in range(0, len(batches), k):
    grads = [_one_device_gradients(model, x, y) for x, y in batches[n:n + k]]
    opt.apply_gradients(zip([tf.add_n(g) / k for g in zip(*grads)], model.trainable_variables))
  return model, opt


@pytest.mark.parametrize("update", ["sharded", "replicated"])
def test_accumulated_gradients_of_placed_variables_live_on_their_stages_and_train_as_one_device(update):
  # wrap_optimizer(accumulation_steps=2) over the stages' variables, 4 steps on 4 different batches: every weight and
  # Adam slot as one device's 2 updates, each from the mean of 2 batches' gradients (within 1e-6; measured 4.2e-7
  # under both updates; the one-device floor, its 4 microbatches summed against the whole batch, 1.8e-7, above).
  # Applying every second batch's gradient alone (the other's lost) is off by 4e-2.
  batches, data = _batches(4)
  repl, model, stages, opt, step = _accumulating_pipeline(update)
  repl.run(step, data)
  # After the first (accumulating) step: each variable's accumulator on its own stage's devices only, the sum of
  # its 2 batch replicas' gradients of their halves: twice one device's gradient of the whole batch (within 1e-6;
  # measured 3e-8).
  expected = _one_device_gradients(_mlp(), *batches[0])
  accumulators = opt._accumulators  # pylint: disable=protected-access
  assert len(accumulators) == len(model.trainable_variables)
  for s, stage in enumerate(stages):
    for v in stage.trainable_variables:
      (acc,) = [a for a, w in zip(accumulators, model.trainable_variables) if w is v]
      assert {mesh.canonical_name(c.device) for c in acc.components} == _stage_devices(repl, s), v.path
  for acc, g in zip(accumulators, expected):
    np.testing.assert_allclose(acc.numpy(), 2 * g.numpy(), rtol=0, atol=1e-6)
  for _ in range(3):
    repl.run(step, data)
  one, one_opt = _one_device_accumulated(batches)
  assert copies_distance(model.trainable_variables, one.trainable_variables) < 1e-6
  assert copies_distance(opt.variables, one_opt.variables) < 1e-6
  for acc in accumulators:  # (reset by the applying step)
    assert not np.any(acc.numpy())


def test_the_memory_report_shows_each_device_its_stage_s_accumulators_only():
  # The accumulating step of the MLP over 2 stages x 2 batch replicas holds, per device, its stage's weights (2,176
  # bytes: 2 Dense(16) layers) and their accumulators (2,176): 4,352 bytes, where every stage's accumulators on every
  # device held 6,528. The applying step (the replicated update: each device updates its stage's slots) adds the 2
  # Adam slots of the stage's weights and Adam's counter and rate: 8,716 (10,892 before), as every device holds
  # (bytes_per_device of the model's, the optimizer's and the accumulators' variables).
  _, data = _batches(2)
  repl, model, _, opt, step = _accumulating_pipeline("replicated")
  stage_bytes = 2 * (WIDE * WIDE + WIDE) * 4
  assert [d.variable_bytes for d in repl.memory(step, data).devices] == [2 * stage_bytes] * 4
  repl.run(step, data)
  assert [d.variable_bytes for d in repl.memory(step, data).devices] == [4 * stage_bytes + 12] * 4
  accumulators = opt._accumulators  # pylint: disable=protected-access
  held = replicator.bytes_per_device(model.variables + opt.variables + accumulators)
  assert held == {mesh.canonical_name(d): 4 * stage_bytes + 12 for d in cpus(4)}, held


def test_an_accumulator_moves_with_its_variable_keeping_its_sum():
  # Accumulated in a step cut after layer 2, applied in a step cut after layer 1: the second layer moves to stage 1,
  # its accumulator with it, holding the first step's sum. The update is one device's from the mean of the 2
  # batches' gradients (within 1e-6; measured 5.4e-7); had the sum been lost, off by 2e-2.
  batches, data = _batches(2)
  repl, model, _, opt, step = _accumulating_pipeline()
  repl.run(step, data)
  other = replicator.split_stages(model, split_points=[model.layers[1].name])
  variables = replicator.pipeline_variables(other)

  def other_step(batch):
    loss, grads = repl.pipeline(other, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=4)
    opt.apply_gradients(zip(grads, variables))
    return loss

  repl.run(other_step, data)
  first = {id(w) for w in model.layers[0].trainable_variables}  # (stage 0 now; the other layers on stage 1)
  for acc, v in zip(opt._accumulators, model.trainable_variables):  # pylint: disable=protected-access
    devices = {mesh.canonical_name(c.device) for c in acc.components}
    assert devices == _stage_devices(repl, 0 if id(v) in first else 1), v.path
  one, one_opt = _one_device_accumulated(batches)
  assert copies_distance(model.trainable_variables, one.trainable_variables) < 1e-6
  assert copies_distance(opt.variables, one_opt.variables) < 1e-6


def _owner_devices(repl, variable, owner):
  """The devices of ``variable``'s components at ``owner``'s position along its axes, and the others."""
  position = {mesh.canonical_name(d): repl.mesh.axis_index(r, owner.axes) for r, d in enumerate(repl.devices)}
  components = _variables.underlying(variable).components
  return ([c for c in components if position[mesh.canonical_name(c.device)] == owner.position],
          [c for c in components if position[mesh.canonical_name(c.device)] != owner.position])


def test_the_sharded_update_of_placed_variables_runs_on_one_owner_of_each_stage_s_batch_replicas():
  # update="sharded" over 2 stages x 2 batch replicas, 5 steps on 5 different batches: each stage's variables owned
  # by one of its 2 devices (along "batch"), the positions balanced (each owns 1,088 of its stage's 2,176 bytes);
  # only the owner updates the Adam slots (the other's copies stay at their initial zeros), the weights' new values
  # reach the other by a broadcast along "batch". Every weight on every device, and every slot on its owner, within
  # 1e-6 of one device's 5 steps (measured 6.7e-7, the slots 5e-9; one step left out is off by 1e-2).
  batches, data = _batches(5)
  repl, model, stages, opt, step = _placed_mlp({"stage": 2, "batch": 2}, "1f1b", "adam", update="sharded")
  for _ in range(5):
    repl.run(step, data)
  one, one_opt = _one_device_accumulated(batches, k=1)
  assert copies_distance(model.trainable_variables, one.trainable_variables) < 1e-6
  assert copies_distance(opt.variables, one_opt.variables) < 1e-6
  variables = replicator.pipeline_variables(stages)
  owners = opt.owners(variables)
  assert all(o is not None and o.axes == ("batch",) for o in owners), owners
  for stage in stages:
    mine = [(v, o) for v, o in zip(variables, owners) if any(v is w for w in stage.trainable_variables)]
    owned = [sum(int(np.prod(v.shape)) * 4 for v, o in mine if o.position == p) for p in (0, 1)]
    assert owned == [1088, 1088], owned
  slots = [v for v in opt.variables if _variables.slot_reference(v.value) is not None]
  assert len(slots) == 2 * len(variables)
  for slot in slots:
    (owner,) = [o for v, o in zip(variables, owners) if _variables.underlying(v) is _variables.slot_reference(slot.value)]
    (at_owner,), (elsewhere,) = _owner_devices(repl, slot, owner)
    assert np.any(at_owner.numpy()) and not np.any(elsewhere.numpy()), slot.path
  plan = repl.explain(step, data)
  broadcasts = [c for c in plan.collectives if c.kind == "broadcast"]
  assert broadcasts and all(c.axes == ("batch",) for c in broadcasts), broadcasts


def test_a_placed_variable_moved_to_another_stage_keeps_its_owner_and_its_slots_there():
  # Sharded: 2 steps cut after layer 2, then 2 steps cut after layer 1 (layer 1 moves from stage 0 to stage 1, its
  # slots with it: each copy the owner's value, owned there again). Every weight and slot within 1e-6 of one device's
  # 4 steps (measured 6.7e-7, the slots 5e-9); had the moved slots not been owned again (read outside a step from
  # the non-owner's stale copy), the slots are off by 1e-2.
  batches, data = _batches(4)
  repl, model, _, opt, step = _placed_mlp({"stage": 2, "batch": 2}, "1f1b", "adam", update="sharded")
  for _ in range(2):
    repl.run(step, data)
  other = replicator.split_stages(model, split_points=[model.layers[1].name])
  variables = replicator.pipeline_variables(other)

  def other_step(batch):
    loss, grads = repl.pipeline(other, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=4)
    opt.apply_gradients(zip(grads, variables))
    return loss

  for _ in range(2):
    repl.run(other_step, data)
  for v in model.layers[1].trainable_variables:
    assert {mesh.canonical_name(c.device) for c in v.value.components} == _stage_devices(repl, 1)
  one, one_opt = _one_device_accumulated(batches, k=1)
  assert copies_distance(model.trainable_variables, one.trainable_variables) < 1e-6
  assert copies_distance(opt.variables, one_opt.variables) < 1e-6


def _tied_sharded(stage_fns, shape, batches):
  """The tied projection's stages (``stage_fns(w, middle)``) trained on one device with Adam over ``batches``, and
  set up as a pipeline over ``shape`` under the sharded update: ``(repl, step, ours, one device's)``, each of the
  two ``(w, middle, variables, optimizer)``."""
  w1, middle1, variables1 = _tied_projection()
  opt1 = keras.optimizers.Adam(1e-2)
  for x, y in batches:
    with tf.GradientTape() as tape:
      h = tf.constant(x)
      for fn in stage_fns(w1, middle1):
        h = fn(h)
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, h))
    opt1.apply_gradients(zip(tape.gradient(loss, variables1), variables1))
  devices = int(np.prod(list(shape.values())))
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(devices)), batch_axes=("batch",))
  with repl.context():
    w, middle, variables = _tied_projection()
    opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-2), update="sharded")
  fns = stage_fns(w, middle)

  def step(batch):
    loss, grads = repl.pipeline(fns, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=4,
                                variables=variables)
    opt.apply_gradients(zip(grads, variables))
    return loss

  return repl, step, (w, middle, variables, opt), (w1, middle1, variables1, opt1)


def test_the_sharded_update_owns_a_weight_both_stages_read_among_every_device_and_the_others_within_their_stage():
  # Over 2 stages x 2 batch replicas a projection both stages read (tied, the second transposed) stays on every
  # device, owned by one of the 4 (its gradient summed over the stages, then reduced over both axes for its owner);
  # the stages' Dense layers are each owned within their stage's 2 devices, the bytes balanced with the projection's
  # (CPU:0 owns it, so CPU:1 owns the first stage's layer). 4 steps of Adam on 4 batches: every weight, and every slot
  # on its owner, within 1e-6 of one device's (measured 6e-8).
  batches, data = _batches(4)

  def stage_fns(w, middle):
    return [lambda h: middle[0](tf.tanh(h @ w)), lambda h: middle[1](h) @ tf.transpose(w)]

  repl, step, (w, middle, variables, opt), (w1, middle1, variables1, opt1) = _tied_sharded(
      stage_fns, {"stage": 2, "batch": 2}, batches)

  for _ in range(4):
    repl.run(step, data)
  assert copies_distance(variables, variables1) < 1e-6
  assert copies_distance(opt.variables, opt1.variables) < 1e-6
  assert [len(_variables.underlying(v).components) for v in variables] == [4, 2, 2, 2, 2]
  assert [(o.position, o.axes) for o in opt.owners(variables)] == [
      (0, ("stage", "batch")), (1, ("batch",)), (1, ("batch",)), (0, ("batch",)), (1, ("batch",))]
  plan = repl.explain(step, data)
  broadcasts = sorted((c.axes, c.param_dict["source"]) for c in plan.collectives if c.kind == "broadcast")
  assert broadcasts == [(("batch",), 0), (("batch",), 1), (("stage", "batch"), 0)], broadcasts


def test_variables_owned_before_a_pipeline_placed_them_are_owned_again_within_their_stages():
  # Sharded: 2 data-parallel steps of the whole MLP (each variable owned by one of the 4 devices, along "stage" and
  # "batch"), then 2 pipelined steps (placed: each owned again by one of its stage's 2 devices, along "batch"). Every
  # weight and slot within 1e-6 of one device's 4 steps (measured 3.1e-7).
  batches, data = _batches(4)
  repl, model, _, opt, step = _placed_mlp({"stage": 2, "batch": 2}, "1f1b", "adam", update="sharded")

  def whole(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.mean_squared_error(batch[1], model(batch[0])))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  for _ in range(2):
    repl.run(whole, data)
  assert {o.axes for o in opt.owners(model.trainable_variables)} == {("stage", "batch")}
  for _ in range(2):
    repl.run(step, data)
  assert [(o.position, o.axes) for o in opt.owners(model.trainable_variables)] == [
      (p, ("batch",)) for p in (0, 0, 1, 1, 0, 0, 1, 1)]
  one, one_opt = _one_device_accumulated(batches, k=1)
  assert copies_distance(model.trainable_variables, one.trainable_variables) < 1e-6
  assert copies_distance(opt.variables, one_opt.variables) < 1e-6


def test_the_sharded_update_of_a_weight_two_stages_share_runs_once_in_each_of_their_groups():
  # Over 4 stages x 2 batch replicas (8 devices), a projection the first stage uses and the last uses transposed
  # lives on those two stages' 4 devices; under the sharded update it is owned by one position along "batch", the
  # same in both stages' groups (each group's owner applies the summed gradient and broadcasts within its group).
  # 4 steps of Adam on 4 batches: every weight, and every slot on its owners, within 1e-6 of one device's
  # (measured 6e-8).
  batches, data = _batches(4)

  def stage_fns(w, middle):
    return [lambda h: tf.tanh(h @ w), middle[0], middle[1], lambda h: h @ tf.transpose(w)]

  repl, step, (w, middle, variables, opt), (w1, middle1, variables1, opt1) = _tied_sharded(
      stage_fns, {"stage": 4, "batch": 2}, batches)

  for _ in range(4):
    repl.run(step, data)
  assert copies_distance(variables, variables1) < 1e-6
  assert copies_distance(opt.variables, opt1.variables) < 1e-6
  holders = {s: _stage_devices(repl, s) for s in range(4)}
  assert {mesh.canonical_name(c.device) for c in w.components} == holders[0] | holders[3]
  owner = opt.owners([w])[0]
  assert owner is not None and owner.axes == ("batch",)
  for slot in [v for v in opt.variables if _variables.slot_reference(v.value) is w]:
    at_owner, elsewhere = _owner_devices(repl, slot, owner)
    assert len(at_owner) == len(elsewhere) == 2  # (one of each stage's two devices)
    assert all(np.any(c.numpy()) for c in at_owner) and not any(np.any(c.numpy()) for c in elsewhere)


@pytest.mark.parametrize("update", ["sharded", "replicated"])
def test_a_stage_without_variables_under_either_update(update):
  # Over 2 stages x 2 batch replicas, the second stage a function without variables: its devices hold none of the
  # optimizer's variables (every gradient there is another stage's), yet take part in the first stage's collectives
  # (was, sharded: Keras's "No gradients provided for any variable" on the second stage's devices). 3 steps of Adam
  # on 3 batches: the Dense layer and its slots within 1e-6 of one device's (measured 3e-8).
  batches, data = _batches(3)

  def build():
    keras.utils.set_random_seed(1)
    dense = keras.layers.Dense(WIDE)
    dense.build((None, WIDE))
    return dense

  one, one_opt = build(), keras.optimizers.Adam(1e-2)
  for x, y in batches:
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, tf.tanh(one(x))))
    one_opt.apply_gradients(zip(tape.gradient(loss, one.trainable_variables), one.trainable_variables))
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2, "batch": 2}, devices=cpus(4)), batch_axes=("batch",))
  with repl.context():
    dense, opt = build(), repl.wrap_optimizer(keras.optimizers.Adam(1e-2), update=update)
  variables = dense.trainable_variables

  def step(batch):
    loss, grads = repl.pipeline([dense, tf.tanh], batch[0], batch[1], keras.losses.mean_squared_error,
                                microbatches=2, variables=variables)
    opt.apply_gradients(zip(grads, variables))
    return loss

  for _ in range(3):
    repl.run(step, data)
  assert copies_distance(variables, one.trainable_variables) < 1e-6
  assert copies_distance(opt.variables, one_opt.variables) < 1e-6


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_last_stages_outputs_with_the_loss_and_from_a_forward_pass_alone(schedule):
  # 4 stages on {"stage": 4}, 10 rows in 3 microbatches (4, 3 and 3 rows): repl.pipeline(outputs=True) and
  # repl.pipeline_forward give every replica the rows' outputs of the stages in a row on one device (measured: equal
  # on this machine; bound 1e-7, room for a matmul of fewer rows rounding otherwise), the first with the same loss
  # and gradients as without.
  x, y = _data()
  one = _stages(4)
  h = tf.constant(x)
  for stage in one:
    h = stage(h)
  expected = h.numpy()
  expected_loss, expected_grads = _one_device(one, x, y)
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 4}, devices=cpus(4)), batch_axes=())
  with repl.context():
    stages = _stages(4)

  def step():
    loss, grads, out = repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                     microbatches=3, schedule=schedule, outputs=True)
    return loss, grads, out, repl.pipeline_forward(stages, tf.constant(x), microbatches=3)

  loss, grads, out, forward = repl.run(step)
  for r in range(4):
    np.testing.assert_allclose(out.values[r].numpy(), expected, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(forward.values[r].numpy(), out.values[r].numpy())
  np.testing.assert_allclose([float(v) for v in loss.values], [expected_loss] * 4, atol=1e-6)
  assert_held_gradients(grads, replicator.pipeline_variables(stages), expected_grads, atol=1e-6)


def _losing_stages(p):
  """``p`` stages adding every kind of loss: weight penalties, an activity penalty, a layer's add_loss."""
  keras.utils.set_random_seed(2)
  widths, d, stages = WIDTHS[-p:], IN, []
  for k, w in enumerate(widths):
    layers = [keras.layers.Dense(w, activation="tanh" if k < p - 1 else None,
                                 kernel_regularizer=keras.regularizers.L2(0.05) if k % 2 == 0 else None,
                                 bias_regularizer="l1" if k == p - 1 else None,
                                 activity_regularizer=keras.regularizers.L1(0.02) if k == 0 else None)]
    stage = keras.Sequential(([AddsLosses()] if k == 1 else []) + layers)
    stage.build((None, d))
    stages.append(stage)
    d = w
  return stages


@pytest.mark.parametrize("schedule, p", [("1f1b", 2), ("gpipe", 4)])
def test_stage_losses_adds_the_losses_keras_stages_add_as_one_device(schedule, p):
  # 10 rows in 3 microbatches (4, 3 and 3 rows). One device: mse(y, model(x)) + sum(model.losses), the model the
  # stages in a row; repl.pipeline(stage_losses=True) gives its loss and gradients (each weight's penalty once, on
  # its stage's devices; the activity penalty and add_loss of each microbatch weighted by its rows), and
  # pipeline_forward(stage_losses=True) the added losses of a forward pass. Measured: the loss 4.8e-7 from one
  # device's, the gradients 1.2e-7, the added losses equal; bound 1e-6, as above. Without stage_losses the loss
  # leaves them out (0.54 and 0.87 less here).
  x, y = _data()
  one = keras.Sequential(_losing_stages(p))
  with tf.GradientTape() as tape:
    out = one(tf.constant(x), training=True)
    plain = tf.reduce_mean(keras.losses.mean_squared_error(y, out))
    total = plain + tf.add_n(one.losses)
  expected = [g.numpy() for g in tape.gradient(total, replicator.pipeline_variables(one.layers))]
  one(tf.constant(x), training=False)
  expected_added = float(tf.add_n(one.losses))
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)))
  with repl.context():
    stages = _losing_stages(p)

  def step():
    loss, grads = repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                microbatches=3, schedule=schedule, stage_losses=True)
    without, _ = repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                               microbatches=3, schedule=schedule)
    outputs, added = repl.pipeline_forward(stages, tf.constant(x), microbatches=3, stage_losses=True)
    return loss, grads, without, outputs, added

  loss, grads, without, outputs, added = repl.run(step)
  np.testing.assert_allclose([float(v) for v in loss.values], [float(total)] * p, rtol=0, atol=1e-6)
  assert_held_gradients(grads, replicator.pipeline_variables(stages), expected, atol=1e-6)
  np.testing.assert_allclose([float(v) for v in without.values], [float(plain)] * p, rtol=0, atol=1e-6)
  assert float(total) - float(plain) > 0.1
  np.testing.assert_allclose([float(v) for v in added.values], [expected_added] * p, rtol=0, atol=1e-6)
  np.testing.assert_allclose(outputs.values[0].numpy(), out.numpy(), rtol=0, atol=1e-6)


def test_a_weight_two_stages_share_is_penalized_once():
  shared = keras.layers.Dense(4, kernel_regularizer="l2")
  shared.build((None, 4))
  other = keras.layers.Dense(4, kernel_regularizer="l2")
  other.build((None, 4))
  stages = [keras.Sequential([shared]), keras.Sequential([other]), keras.Sequential([shared]), lambda h: h]
  assert [[w.path for w in ws] for ws in _pipeline.weight_penalties(stages)] == [
      [shared.kernel.path], [other.kernel.path], [], []]


def test_the_keras_losses_order_stage_losses_relies_on():
  # _pipeline.added_losses takes a Keras layer's call losses as its Layer.losses without the last penalties, one a
  # regularized trainable weight (Keras lists the call's add_loss and activity penalties first, then the weights'),
  # and documents an activity penalty as a mean over the rows (Keras divides it by the output's rows). If Keras
  # changes either, this fails first.
  layer = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.5), bias_regularizer="l1",
                             activity_regularizer=keras.regularizers.L1(0.25))
  stage = keras.Sequential([AddsLosses(), layer])
  x = np.arange(12, dtype="float32").reshape(4, 3) / 10
  out = stage(x)
  losses = [float(t) for t in stage.losses]
  penalties = [0.5 * float(tf.reduce_sum(layer.kernel ** 2)), 0.01 * float(tf.reduce_sum(tf.abs(layer.bias)))]
  calls = [0.1 * float(np.mean(x ** 2)), 0.01 * 3, 0.25 * float(tf.reduce_sum(tf.abs(out))) / 4]
  np.testing.assert_allclose(losses, calls + penalties, rtol=1e-6)
  np.testing.assert_allclose([float(t) for t in _pipeline.added_losses(stage)], calls, rtol=1e-6)


def test_loss_scale_seeds_the_backward_passes_and_leaves_the_loss_unscaled():
  # repl.pipeline(loss_scale=s): the gradients of s times the loss (s a power of 2: s times those without, measured
  # 1.8e-7 apart relative, float32 rounding of the seeded passes' other kernels; bound 1e-6), the loss itself
  # unscaled, exactly; a function giving s is called once the variables are placed.
  x, y = _data()
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)))
  with repl.context():
    stages = _losing_stages(2)

  def step():
    plain = repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error, microbatches=3,
                          stage_losses=True)
    scaled = repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error, microbatches=3,
                           stage_losses=True, loss_scale=lambda: tf.constant(2.0 ** 10))
    return plain, scaled

  (loss, grads), (scaled_loss, scaled_grads) = repl.run(step)
  np.testing.assert_array_equal([float(v) for v in scaled_loss.values], [float(v) for v in loss.values])
  for g, s in zip(grads, scaled_grads):
    for r in range(2):
      np.testing.assert_allclose(s.values[r].numpy(), g.values[r].numpy() * 2.0 ** 10, rtol=1e-6, atol=0)


class _AddsRowSum(keras.layers.Layer):
  """Adds the sum of its inputs over the rows (not a mean): a loss no microbatch split can give as one device."""

  def call(self, x):
    self.add_loss(keras.ops.sum(x))
    return x


def test_a_loss_added_as_a_sum_over_the_rows_counts_as_the_microbatches_mean_of_it():
  # Documented: a loss a stage adds is weighted by its microbatch's rows as the loss is (right for a mean over the
  # rows or a value that does not depend on them); a sum over the rows is then the microbatches' sums weighted by
  # their rows, not one device's sum. 10 rows in 3 microbatches (4, 3 and 3 rows).
  x, _ = _data()
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)))
  with repl.context():
    base = _stages(2)
    stages = [keras.Sequential([_AddsRowSum()] + base[0].layers), base[1]]
    stages[0].build((None, IN))
  _, added = repl.run(lambda: repl.pipeline_forward(stages, tf.constant(x), microbatches=3, stage_losses=True))
  parts = [x[a:b].sum() * (b - a) / ROWS for a, b in ((0, 4), (4, 7), (7, 10))]
  np.testing.assert_allclose([float(v) for v in added.values], [sum(parts)] * 2, rtol=1e-6)
  assert abs(sum(parts) - x.sum()) > 1.0  # (one device's: the whole sum)
