"""The global view's rule for ``If``: branches partitioned per device, with the collectives they need inside them."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import keras_step
from conftest import summary_events

import mesh
import replicator

LAYOUTS = {
    "batch": None,
    "hidden": {r"ff_in/kernel$": (None, "model"), r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)},
    "hidden_in": {r"ff_in/kernel$": (None, "model"), r"ff_in/bias$": ("model",)},
}
BATCH = 12
STEPS = 4


def _dataset():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
  y = rng.integers(0, 4, size=BATCH * STEPS).astype("int32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def _accumulating(context):
  with context:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu", name="ff_in"),
                              keras.layers.Dense(4, name="ff_out")])
    opt = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2)  # Keras's own tf.cond in every step
  return model, opt


@pytest.mark.parametrize("update", ["auto", "replicated"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_keras_gradient_accumulation_equals_one_device(layout, update):
  # Was: refused ("cannot partition If ... it takes the handle of a sharded variable") with the hidden split.
  one_model, one_opt = _accumulating(contextlib.nullcontext())
  one_step = tf.function(keras_step(one_model, one_opt))
  expected = [float(one_step(batch)) for batch in _dataset()]
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)),
                               layouts=mesh.LayoutMap(LAYOUTS[layout]) if LAYOUTS[layout] else None,
                               batch_axes=("batch",), view="global", update=update, strict=True)
  model, opt = _accumulating(repl.context())
  step_fn = keras_step(model, opt)
  dataset = _dataset()
  losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  reference, ours = one_model.variables + one_opt.variables, model.variables + opt.variables
  assert len(ours) == len(reference) and any("accumulator" in v.path for v in ours)
  assert_every_copy(ours, reference)
  assert int(opt.iterations.numpy()) == STEPS // 2 == int(one_opt.iterations.numpy())
  if layout == "hidden":  # the accumulator follows its variable: half of it per device
    (acc,) = [v for v in opt.variables if v.path.endswith("ff_in_kernel_gradient_accumulator")]
    assert [c.shape.as_list() for c in replicator.state._variables.underlying(acc).components] == [[8, 8]] * 4


@pytest.mark.parametrize("take", ["then", "else"])
def test_a_branch_that_communicates_runs_split_with_the_collective_inside(take):
  # The sum (then) or the max (else) over the split batch is an all-reduce inside the branch that runs: each
  # device's copy of the branch makes it, every device taking the same branch. Was: the cond fell back (gathered).
  x = np.arange(24, dtype=np.float32).reshape(8, 3)

  def step_fn(x):
    return tf.cond(tf.reduce_max(x) > (10.0 if take == "then" else 100.0), lambda: tf.reduce_sum(x, axis=0),
                   lambda: tf.reduce_max(x, axis=0))

  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 4}, devices=cpus(4)), view="global", strict=True)
  dataset = tf.data.Dataset.from_tensors(x)
  got = repl.run(step_fn, dataset)
  np.testing.assert_allclose(np.asarray(got), x.sum(axis=0) if take == "then" else x.max(axis=0))
  plan = repl.explain(step_fn, dataset)
  assert not plan.fallbacks
  assert [c.kind for c in plan.collectives] == ["all_reduce"]  # the predicate's max, before the cond
  rows = sorted((r.why, r.kind, r.op, r.axes) for r in plan.inside_rows)
  assert rows == [("inside the conditional cond, its else_branch: partial max", "all_reduce", "max", ("batch",)),
                  ("inside the conditional cond, its then_branch: partial sum", "all_reduce", "sum", ("batch",))]


def test_a_branch_on_split_values_runs_on_each_piece():
  # Elementwise branches on a batch-split value: no gather, no fallback (strict), equal to one device.
  x = np.arange(24, dtype=np.float32).reshape(8, 3) - 12.0

  def step_fn(x):
    y = tf.cond(tf.reduce_min(x) < 0.0, lambda: tf.nn.relu(x) * 2.0, lambda: x - 1.0)
    return tf.reduce_sum(y, axis=0)

  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 4}, devices=cpus(4)), view="global", strict=True)
  got = repl.run(step_fn, tf.data.Dataset.from_tensors(x))
  np.testing.assert_allclose(np.asarray(got), (np.maximum(x, 0) * 2).sum(axis=0))
  plan = repl.explain(step_fn, tf.data.Dataset.from_tensors(x))
  assert [c.kind for c in plan.collectives] == ["all_reduce", "all_reduce"]  # the min, the sum; none in the cond


def _loss_scaled(context):
  with context:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu", name="ff_in"),
                              keras.layers.Dense(4, name="ff_out")])
    # Small growth interval: the scale grows inside the apply branch (a tf.cond in a tf.cond) during the test.
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**10,
                                              dynamic_growth_steps=2)
  return model, opt


def _scaled_step(model, opt):
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
      scaled = opt.scale_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step_fn


@pytest.mark.parametrize("update,layouts", [("auto", "hidden"), ("replicated", "hidden"), ("auto", "hidden_in")])
def test_keras_loss_scale_optimizer_with_a_hidden_split_equals_one_device(update, layouts):
  # Its apply is a tf.cond on whether every gradient is finite (tf.reduce_all over split gradients: a bool
  # all-reduce), with the inner Adam's update and the scale's growth (another tf.cond) in the branch. "hidden_in":
  # ff_out's kernel is replicated, but its gradient comes split over "model" (ff_in's outputs are): the branch
  # would gather it (was refused: "Sub ... in its then_branch gathers a split input"); it is gathered before.
  one_model, one_opt = _loss_scaled(contextlib.nullcontext())
  one_step = tf.function(_scaled_step(one_model, one_opt))
  expected = [float(one_step(batch)) for batch in _dataset()]
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)),
                               layouts=mesh.LayoutMap(LAYOUTS[layouts]), batch_axes=("batch",), view="global",
                               update=update, strict=True)
  model, opt = _loss_scaled(repl.context())
  step_fn = _scaled_step(model, opt)
  dataset = _dataset()
  losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  reference, ours = one_model.variables + one_opt.variables, model.variables + opt.variables
  assert len(ours) == len(reference)
  assert_every_copy(ours, reference)
  assert float(opt.dynamic_scale.numpy()) == float(one_opt.dynamic_scale.numpy()) == 2.0**12


def test_a_branch_that_communicates_over_a_split_variable_runs_split():
  # The sum over w's split columns is an all-reduce over "model" inside the branch. Was: refused (the If takes the
  # handle of a sharded variable, and its branch needed communication).
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)),
                               layouts=mesh.LayoutMap({r"^w$": (None, "model")}), batch_axes=("batch",), view="global",
                               strict=True)
  w0 = np.arange(12, dtype=np.float32).reshape(3, 4)
  with repl.context():
    w = tf.Variable(w0, name="w")

  def step_fn(x):
    return tf.cond(tf.reduce_sum(x) > 0.0, lambda: tf.reduce_sum(w) * tf.reduce_sum(x), lambda: tf.constant(0.0))

  dataset = tf.data.Dataset.from_tensors(np.ones([4, 3], np.float32))
  assert float(repl.run(step_fn, dataset)) == w0.sum() * 12.0
  rows = repl.explain(step_fn, dataset).inside_rows  # the sums over w's columns and over the batch's rows
  assert sorted((r.kind, r.axes) for r in rows) == [("all_reduce", ("batch",)), ("all_reduce", ("model",))], rows


def test_a_branch_with_a_vocabulary_parallel_loss_runs_split_and_equals_one_device():
  # The cross-entropy of class-split logits communicates (three all-reduces over "model") wherever it runs: inside
  # the branch, each device's copy makes them. Was: the cond fell back (gathered logits, one warning).
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap({r"^w$": (None, "model")}), batch_axes=("batch",),
                               view="global", strict=True)
  w0 = np.random.default_rng(3).normal(size=(6, 8)).astype("float32")
  with repl.context():
    w = tf.Variable(w0, name="w")
  x = np.random.default_rng(4).normal(size=(8, 6)).astype("float32")
  labels = np.arange(8, dtype=np.int32)

  def step_fn(batch):
    x, y = batch
    logits = tf.matmul(x, w)
    per_row = tf.cond(tf.reduce_sum(x) > -1e9, lambda: tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits),
                      lambda: tf.cast(y, tf.float32) * 0.0)
    return tf.reduce_mean(per_row)

  dataset = tf.data.Dataset.from_tensors((x, labels))
  got = repl.run(step_fn, dataset)
  want = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, x @ w0))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  inside = repl.explain(step_fn, dataset).inside_rows
  assert inside and all(r.axes == ("model",) and "its then_branch" in r.why for r in inside), inside


@pytest.mark.parametrize("take", ["then", "else"])
def test_a_branch_returning_whole_zeros_is_sliced_to_the_other_branch_s_split(take):
  # One branch keeps the batch split, the other returns a constant whole: each device slices it, no gather.
  x = np.arange(24, dtype=np.float32).reshape(8, 3) - 12.0

  def step_fn(x):
    y = tf.cond(tf.reduce_min(x) < (0.0 if take == "then" else -100.0), lambda: tf.nn.relu(x) * 2.0,
                lambda: tf.fill([8, 3], 0.5))
    return tf.reduce_sum(y * x, axis=0)

  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 4}, devices=cpus(4)), view="global", strict=True)
  got = repl.run(step_fn, tf.data.Dataset.from_tensors(x))
  y = np.maximum(x, 0) * 2 if take == "then" else np.full([8, 3], 0.5, np.float32)
  np.testing.assert_allclose(np.asarray(got), (y * x).sum(axis=0))
  plan = repl.explain(step_fn, tf.data.Dataset.from_tensors(x))
  assert [c.kind for c in plan.collectives] == ["all_reduce", "all_reduce"]  # the min, the sum


def _batch_repl():
  return replicator.Replicator(mesh=mesh.Mesh({"batch": 4}, devices=cpus(4)), view="global")


def test_a_communicating_branch_that_writes_a_summary_writes_it_once(tmp_path):
  # The norm over the split batch needs an all-reduce inside the branch, which could be placed there, but the
  # summary's writer is a resource of the first device, which the other devices' copies of the branch cannot take:
  # the cond falls back, saying so, and, having no outputs, runs on the first device only (each device wrote the
  # point before).
  x = np.arange(24, dtype=np.float32).reshape(8, 3)
  repl = _batch_repl()
  with repl.context():
    step = tf.Variable(0, dtype=tf.int64)

  def step_fn(x):
    step.assign_add(1)
    if step % 2 == 0:  # AutoGraph: a tf.cond whose branch writes the summary
      tf.summary.scalar("norm", tf.norm(x), step=step)
    return tf.reduce_sum(x)

  writer = tf.summary.create_file_writer(str(tmp_path))
  with writer.as_default(), pytest.warns(UserWarning, match=r"cannot partition (Stateless)?If .*: its then_branch "
                                         r"would communicate inside, and WriteSummary .* writes to a resource"):
    for _ in range(4):
      repl.run(step_fn, tf.data.Dataset.from_tensors(x))
  writer.flush()
  points = [(step, float(value)) for step, _, value in summary_events(tmp_path)]
  assert points == [(2, pytest.approx(float(np.linalg.norm(x)))), (4, pytest.approx(float(np.linalg.norm(x))))]


def test_a_communicating_branch_that_draws_unseeded_numbers_draws_the_same_on_every_device():
  # Each device's copy of the branch draws with the same seeds (the body's own salt), so the all-reduce inside it
  # and whatever follows see one draw: the sum of the batch-split rows times the draw equals the draw times the sum.
  x = np.arange(24, dtype=np.float32).reshape(8, 3)

  def step_fn(x):
    draw = lambda: tf.raw_ops.RandomUniform(shape=[3], dtype=tf.float32, seed=0, seed2=0)  # noqa: E731
    y = tf.cond(tf.reduce_max(x) > 10.0, lambda: tf.reduce_sum(x, axis=0) * draw(), lambda: tf.reduce_max(x, axis=0))
    return y, tf.reduce_sum(x * y, axis=0)

  y, total = _batch_repl().run(step_fn, tf.data.Dataset.from_tensors(x))
  draw = np.asarray(y) / x.sum(axis=0)
  assert np.all((draw >= 0) & (draw < 1)), draw
  np.testing.assert_allclose(np.asarray(total), x.sum(axis=0) * np.asarray(y), rtol=1e-6)


def test_a_communicating_branch_that_reads_a_metric_equals_one_device():
  # The metric's read sums the devices' parts (an all-reduce inside the branch). Was: refused.
  repl = _batch_repl()
  with repl.context():
    mean = keras.metrics.Mean()

  def step_fn(x):
    mean.update_state(x)
    return tf.cond(tf.reduce_sum(x) > 0.0, lambda: mean.result() * tf.reduce_sum(x), lambda: tf.constant(0.0))

  x = np.arange(24, dtype=np.float32).reshape(8, 3)
  got = [float(repl.run(step_fn, tf.data.Dataset.from_tensors(x))) for _ in range(2)]
  np.testing.assert_allclose(got, [x.mean() * x.sum()] * 2, rtol=1e-6)
