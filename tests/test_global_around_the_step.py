"""The global view with what researchers put around a step: metrics, summaries, prints, wrap_optimizer and its
gradient accumulation, distribute_dataset, partial batches, Python control flow, BatchNormalization, Sonnet,
checkpoints and export. Each equals the same code on one device, every variable compared on every device."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import keras_step
from conftest import sonnet_step
from conftest import summary_events

import mesh
import replicator
from replicator.state import _variables

HIDDEN = {r"ff_in/kernel$": (None, "model"), r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)}
LAYOUTS = {"hidden": HIDDEN, "batch": None}
SHAPES = {"hidden": (2, 2), "batch": (4, 1)}
BATCH, STEPS = 12, 3


def _repl(layout="hidden", split=True):
  """A global-view Replicator on the layout's mesh; ``split=False``: without its layouts (a step with no MLP,
  whose keys would match nothing, which is warned about)."""
  shape, layouts = SHAPES[layout], LAYOUTS[layout] if split else None
  m = mesh.Mesh({"batch": shape[0], "model": shape[1]}, devices=cpus(shape[0] * shape[1]))
  return replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(layouts) if layouts else None, batch_axes=("batch",),
                               view="global")


def _mlp(context, batch_norm=None):
  with context:
    keras.utils.set_random_seed(1)
    middle = [keras.layers.BatchNormalization(synchronized=batch_norm == "synchronized")] if batch_norm else []
    return keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu", name="ff_in"),
                             *middle, keras.layers.Dense(4, name="ff_out")])


def _dataset(rows=BATCH * STEPS, batch=BATCH):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(rows, 8)).astype("float32")
  y = rng.integers(0, 4, size=rows).astype("int32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=rows % batch == 0)


def _with_metrics(model, opt):
  """A step that also updates two Keras metrics and returns the accuracy so far, read inside the step."""
  train = keras_step(model, opt)
  accuracy, mean = keras.metrics.SparseCategoricalAccuracy(), keras.metrics.Mean()

  def step_fn(batch):
    x, y = batch
    loss = train(batch)
    accuracy.update_state(y, model(x))
    mean.update_state(loss)
    return loss, accuracy.result()

  return step_fn, [accuracy, mean]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_keras_metrics_count_every_example_once(layout):
  one_model, one_opt = _mlp(contextlib.nullcontext()), keras.optimizers.Adam(1e-2)
  one_step, one_metrics = _with_metrics(one_model, one_opt)
  one_step = tf.function(one_step)
  expected = [[float(t) for t in one_step(batch)] for batch in _dataset()]
  repl = _repl(layout)
  with repl.context():
    model, opt = _mlp(contextlib.nullcontext()), keras.optimizers.Adam(1e-2)
    step_fn, metrics = _with_metrics(model, opt)
  dataset = _dataset()
  got = [[float(t) for t in repl.run(step_fn, dataset)] for _ in range(STEPS)]
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)  # the accuracy read inside the step too
  ours = [v for m in metrics for v in m.variables]
  reference = [v for m in one_metrics for v in m.variables]
  assert float(metrics[0].count) == BATCH * STEPS  # was 4x: each device added the global count
  assert_every_copy(ours, reference)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)
  for m, one in zip(metrics, one_metrics):
    assert float(m.result()) == pytest.approx(float(one.result()), abs=1e-6)


def test_summaries_and_prints_happen_once_per_step(tmp_path):
  def with_effects(model, opt, printed):
    train = keras_step(model, opt)

    def step_fn(batch):
      loss = train(batch)
      tf.summary.scalar("loss", loss, step=opt.iterations)
      tf.summary.histogram("hidden", model.layers[0](batch[0]), step=opt.iterations)  # split over model
      tf.print("loss", loss, output_stream=f"file://{printed}")
      return loss

    return step_fn

  one_model, one_opt = _mlp(contextlib.nullcontext()), keras.optimizers.Adam(1e-2)
  with tf.summary.create_file_writer(str(tmp_path / "one")).as_default():
    one_step = tf.function(with_effects(one_model, one_opt, tmp_path / "one.txt"))
    for batch in _dataset():
      one_step(batch)
  repl = _repl("hidden")
  with repl.context():
    model, opt = _mlp(contextlib.nullcontext()), keras.optimizers.Adam(1e-2)
  step_fn, dataset = with_effects(model, opt, tmp_path / "ours.txt"), _dataset()
  writer = tf.summary.create_file_writer(str(tmp_path / "ours"))
  with writer.as_default():
    for _ in range(STEPS):
      repl.run(step_fn, dataset)
  writer.flush()
  ours, theirs = summary_events(tmp_path / "ours"), summary_events(tmp_path / "one")
  assert [(s, t) for s, t, _ in ours] == [(s, t) for s, t, _ in theirs] == [
      (s, t) for s in (1, 2, 3) for t in ("loss", "hidden")]  # was every point once per device
  for (_, tag, a), (_, _, b) in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=tag)
  assert (tmp_path / "ours.txt").read_text().count("loss") == STEPS


def _accumulating_step(model, opt, k):
  """One device's step that applies the mean gradient of every k steps (wrap_optimizer's accumulation)."""
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  sums = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]

  def step(batch, apply):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    if apply:
      opt.apply_gradients(zip([(s + g) / k for s, g in zip(sums, grads)], model.trainable_variables))
      for s in sums:
        s.assign(tf.zeros_like(s))
    else:
      for s, g in zip(sums, grads):
        s.assign_add(g)
    return loss

  def apply(batch):
    return step(batch, True)

  def accumulate(batch):
    return step(batch, False)

  return tf.function(apply), tf.function(accumulate)


@pytest.mark.parametrize("accumulation_steps", [1, 3])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_wrap_optimizer_and_its_accumulation_equal_one_device(layout, accumulation_steps):
  k, steps = accumulation_steps, 6
  one_model, one_opt = _mlp(contextlib.nullcontext()), keras.optimizers.Adam(1e-2)
  apply, accumulate = _accumulating_step(one_model, one_opt, k)
  expected = [float((apply if i % k == k - 1 else accumulate)(batch))
              for i, batch in enumerate(_dataset(BATCH * steps))]
  repl = _repl(layout)
  with repl.context():
    model = _mlp(contextlib.nullcontext())
    opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-2), accumulation_steps=k)
  step_fn, dataset = keras_step(model, opt), _dataset(BATCH * steps)
  losses = [float(repl.run(step_fn, dataset)) for _ in range(steps)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)
  assert repl.trace_count == (2 if k > 1 else 1)  # an accumulating and an applying variant
  if k > 1:
    (accumulator, *_) = opt._accumulators  # pylint: disable=protected-access
    assert accumulator.shape == (8, 16)
    pieces = [c.shape.as_list() for c in _variables.underlying(accumulator).components]
    assert pieces == [[8, 16 // SHAPES[layout][1]]] * 4  # laid out like its kernel
    with pytest.raises(replicator.ArgumentError, match=r"accumulation_steps > 1 is not supported"):
      repl.run(step_fn, _dataset(), steps=2)


def test_local_view_sharded_updates_then_global_steps_equal_one_device():
  # Was refused (a stale-owner error naming the kernel): the local view's sharded update marked the variable, not
  # only its slots, as current on its owner alone; its new value is written on every device.
  one_model, one_opt = _mlp(contextlib.nullcontext()), keras.optimizers.Adam(1e-2)
  one_step = tf.function(keras_step(one_model, one_opt))
  expected = [float(one_step(batch)) for batch in _dataset()]
  repl = _repl("batch")
  with repl.context():
    model = _mlp(contextlib.nullcontext())
    opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-2), update="sharded")
  step_fn, batches = keras_step(model, opt), list(_dataset())
  local = repl.run(step_fn, inputs=replicator.PerReplica([tf.nest.map_structure(lambda t, r=r: t[3 * r:3 * r + 3],
                                                                                batches[0]) for r in range(4)]),
                   view="local")
  assert opt.iterations.numpy() == 1
  data = tf.data.Dataset.from_tensor_slices(tf.nest.map_structure(lambda *t: tf.stack(t), *batches[1:]))
  losses = [float(repl.reduce("mean", local))] + [float(repl.run(step_fn, data)) for _ in range(STEPS - 1)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)


def _trained(repl, dataset=_dataset, steps=STEPS, batch_norm=None, data=None):
  """One device's model, optimizer and step (trained on ``dataset()``), and the same trained by ``repl.run``
  on ``data`` (by default ``dataset()``)."""
  one_model, one_opt = _mlp(contextlib.nullcontext(), batch_norm), keras.optimizers.Adam(1e-2)
  one_step = tf.function(keras_step(one_model, one_opt))
  expected = [float(one_step(batch)) for batch in dataset()]
  with repl.context():
    model, opt = _mlp(contextlib.nullcontext(), batch_norm), keras.optimizers.Adam(1e-2)
  step_fn, data = keras_step(model, opt), dataset() if data is None else data
  losses = [float(repl.run(step_fn, data)) for _ in range(steps)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  return repl, (model, opt, step_fn), (one_model, one_opt, one_step)


def test_distribute_dataset_gives_the_global_batches():
  repl = _repl()
  _, (model, opt, _), (one_model, one_opt, _) = _trained(repl, data=repl.distribute_dataset(_dataset()))
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)


def test_a_batch_the_batch_axes_do_not_divide_runs_whole_and_equals_one_device():
  with pytest.warns(UserWarning, match=r"dimension 0 \(input 0: 5 rows, input 1: 5 rows\) is not divided by the "
                    r"batch axes \('batch',\) \(of size 2\): this step takes those inputs whole on every device"):
    _, (model, opt, _), (one_model, one_opt, _) = _trained(_repl(), lambda: _dataset(rows=15, batch=10), steps=2)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)


@pytest.mark.parametrize("batch_norm", ["synchronized", "plain"])
def test_batch_normalization_equals_one_device(batch_norm):
  # One device normalizes over the global batch: so does the global view, synchronized or not.
  _, (model, opt, _), (one_model, one_opt, _) = _trained(_repl(), batch_norm=batch_norm)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)
  assert any("moving_variance" in v.path for v in model.variables)


def test_python_control_flow_is_converted_as_tf_function_does():
  repl = _repl(split=False)
  with repl.context():
    v = tf.Variable(tf.ones([8, 4]))

  def step_fn(batch):
    x, _ = batch
    total = tf.reduce_sum(tf.matmul(x, v))
    if total > 0:  # a tensor: AutoGraph makes it a tf.cond, as on one device
      total = -total
    for _ in tf.range(2):
      total += 1.0
    return total

  dataset = _dataset()
  for x, _ in dataset:
    total = 4 * float(np.sum(x.numpy()))
    assert float(repl.run(step_fn, dataset)) == pytest.approx(-abs(total) + 2.0, abs=1e-4)


def test_a_checkpoint_of_a_global_step_restores_anywhere(tmp_path):
  _, (model, opt, _), (one_model, one_opt, one_step) = _trained(_repl())
  path = tf.train.Checkpoint(model=model, opt=opt).save(str(tmp_path / "ckpt"))
  # On one device: the global values (sharded kernels assembled, slots read on their owner).
  fresh_model, fresh_opt = _mlp(contextlib.nullcontext()), keras.optimizers.Adam(1e-2)
  fresh_opt.build(fresh_model.trainable_variables)
  tf.train.Checkpoint(model=fresh_model, opt=fresh_opt).restore(path).assert_existing_objects_matched()
  assert_every_copy(fresh_model.variables + fresh_opt.variables, one_model.variables + one_opt.variables)
  # Into another mesh and layout, training on as one device does.
  other = _repl("batch")
  with other.context():
    more_model, more_opt = _mlp(contextlib.nullcontext()), keras.optimizers.Adam(1e-2)
    more_opt.build(more_model.trainable_variables)
  tf.train.Checkpoint(model=more_model, opt=more_opt).restore(path).assert_existing_objects_matched()
  batch = next(iter(_dataset()))
  expected = float(one_step(batch))
  assert float(other.run(keras_step(more_model, more_opt), _dataset())) == pytest.approx(expected, abs=1e-6)
  assert_every_copy(more_model.variables + more_opt.variables, one_model.variables + one_opt.variables)


def test_a_model_trained_in_the_global_view_exports_for_serving(tmp_path):
  _, (model, _, _), (one_model, _, _) = _trained(_repl())
  model.export(str(tmp_path / "served"), verbose=False)
  served = tf.saved_model.load(str(tmp_path / "served"))
  x = np.random.default_rng(3).normal(size=(5, 8)).astype("float32")
  np.testing.assert_allclose(served.serve(x).numpy(), one_model(x).numpy(), rtol=0, atol=1e-5)


def test_a_sonnet_module_built_in_the_context_equals_one_device():
  snt = pytest.importorskip("sonnet")
  layouts = {r"mlp/linear_0/w$": (None, "model"), r"mlp/linear_0/b$": ("model",), r"mlp/linear_1/w$": ("model", None)}

  def build():
    tf.random.set_seed(1)
    net = snt.nets.MLP([16, 4], name="mlp")
    net(tf.zeros([1, 8]))  # built by one call, before the step
    return net, snt.optimizers.Adam(1e-2)

  one_net, one_opt = build()
  one_step = tf.function(sonnet_step(one_net, one_opt))
  expected = [float(one_step(batch)) for batch in _dataset()]
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(layouts), batch_axes=("batch",), view="global")
  with repl.context():
    net, opt = build()
  step_fn, dataset = sonnet_step(net, opt), _dataset()
  losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  (w,) = [v for v in net.variables if v.name == "mlp/linear_0/w:0"]
  assert _variables.layout_of(w).spec == (None, "model")
  assert_every_copy(list(net.variables) + list(opt.variables), list(one_net.variables) + list(one_opt.variables))


def test_a_variable_made_outside_the_replicator_is_read_but_never_written():
  repl = _repl(split=False)
  outside = tf.Variable(3.0)  # one resource, not the Replicator's
  with repl.context():
    inside = tf.Variable(1.0)

  def reads(batch):
    return tf.reduce_sum(batch[0]) * outside * inside

  x = next(iter(_dataset()))[0].numpy()
  assert float(repl.run(reads, _dataset())) == pytest.approx(3.0 * float(np.sum(x)), rel=1e-5)

  def writes(batch):
    outside.assign_add(1.0)  # every device's copy would add 1.0
    return tf.reduce_sum(batch[0])

  with pytest.raises(replicator.UnreplicatedStateError, match=r"The step writes the variable 'Variable:0' at "
                     r".*test_global_around_the_step.py:\d+ in writes, but it was created outside every Replicator "
                     r"context"):
    repl.run(writes, _dataset())
  assert float(outside.numpy()) == 3.0
