"""``repl.pipeline_stages``: the global view's one-device step run as a pipeline of a model's stages."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus

import mesh
import replicator
from replicator.state import _variables

FEATURES, CLASSES, ROWS, BATCH = 6, 3, 48, 16


def _model(bn=True, dropout=False):
  """An MLP with BatchNormalization (its statistics over the batch), or Dropout."""
  keras.utils.set_random_seed(1)
  layers = [keras.Input((FEATURES,)), keras.layers.Dense(16, use_bias=False, name="d0")]
  layers += [keras.layers.BatchNormalization(name="bn"), keras.layers.Activation("tanh")] if bn else []
  layers += [keras.layers.Dense(16, activation="tanh", name="d1")]
  layers += [keras.layers.Dropout(0.25, name="drop")] if dropout else []
  layers += [keras.layers.Dense(8, activation="tanh", name="d2"), keras.layers.Dense(CLASSES, name="d3")]
  return keras.Sequential(layers)


def _stages(model, p):
  """The model's layers with weights, in ``p`` stages of consecutive layers."""
  weighted = [layer for layer in model.layers if layer.weights]
  return [list(part) for part in np.array_split(np.array(weighted, dtype=object), p)]


def _compile(model):
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")])
  return model


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(ROWS, FEATURES)).astype("float32"), rng.integers(0, CLASSES, ROWS)


def _pipelined(sizes, microbatches, bn=True, dropout=False, schedule="1f1b"):
  repl = replicator.Replicator(mesh=mesh.Mesh(sizes, devices=cpus(int(np.prod(list(sizes.values()))))),
                               view="global", batch_axes=("batch",) if "batch" in sizes else ())
  with repl.context():
    model = _compile(_model(bn, dropout))
  repl.pipeline_stages(_stages(model, sizes["stage"]), microbatches=microbatches, schedule=schedule)
  return repl, model


# (mesh, microbatches, schedule). 1F1B where BatchNormalization's statistics (first stage) are taken before any
# forward pass waits (m <= p); GPipe otherwise (1F1B refuses: test_1f1b_refuses_...).
CASES = {"2_stages_4_microbatches_gpipe": ({"stage": 2}, 4, "gpipe"),
         "2x2_2_microbatches": ({"stage": 2, "batch": 2}, 2, "1f1b"),
         "4_stages_2_microbatches": ({"stage": 4}, 2, "1f1b"), "2_stages_1_microbatch": ({"stage": 2}, 1, "1f1b"),
         "4_stages_4_microbatches_gpipe": ({"stage": 4}, 4, "gpipe")}
IN_CI = ("2x2_2_microbatches", "4_stages_2_microbatches")  # (GPipe in CI: the transformer's test)


def _floor(x, y, fit):
  """The largest difference of one device's fit (every weight, slot and value of the history) from the same fit
  with each batch's rows reversed (its sums in another order): float32's noise, which Adam's normalized steps
  grow where a gradient is small."""
  reference, reversed_ = _compile(_model()), _compile(_model())
  expected = reference.fit(x, y, **fit).history
  order = np.concatenate([np.arange(k, k + BATCH)[::-1] for k in range(0, ROWS, BATCH)])
  got = reversed_.fit(x[order], y[order], **fit).history
  pairs = list(zip(reference.weights + reference.optimizer.variables, reversed_.weights + reversed_.optimizer.variables))
  return max([float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs]
             + [float(np.max(np.abs(np.subtract(got[k], expected[k])))) for k in expected])


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in IN_CI else (pytest.mark.full_grid,))
                                  for c in CASES])
def test_fit_evaluate_and_predict_are_one_devices(case):
  # 2 epochs of 48 rows in batches of 16, Adam, validation data; BatchNormalization's statistics combine the
  # microbatches (and batch replicas): the batch's, as one device's, and its moving statistics move once a step.
  # Bound: twice the floor (each batch's rows reversed, _floor), measured 1.2e-7; ours 0 (one microbatch) to 1.2e-7
  # from one device's (every weight, slot and value of the history; every case, --full-grid). With ReLU after the
  # normalization, the floor was 1.9e-6 and ours 4.7e-6: Adam's normalized step on an element whose gradient is
  # float32's noise.
  x, y = _data()
  sizes, microbatches, schedule = CASES[case]
  fit = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=(x[:16], y[:16]))
  bound = 2 * _floor(x, y, fit)
  reference = _compile(_model())
  repl, ours = _pipelined(sizes, microbatches, schedule=schedule)
  with repl.context():
    got = ours.fit(x, y, **fit).history
  expected = reference.fit(x, y, **fit).history
  assert sorted(got) == sorted(expected) == ["accuracy", "loss", "val_accuracy", "val_loss", "val_xent", "xent"]
  for key, values in expected.items():
    np.testing.assert_allclose(got[key], values, rtol=0, atol=bound, err_msg=key)
  assert_every_copy(ours.weights, reference.weights, atol=bound)  # (BatchNormalization's moving statistics too)
  assert_every_copy(ours.optimizer.variables, reference.optimizer.variables, atol=bound)
  assert int(ours.optimizer.iterations.numpy()) == 6
  with repl.context():
    evaluated, predicted = ours.evaluate(x, y, batch_size=BATCH, verbose=0), ours.predict(x, batch_size=BATCH, verbose=0)
    trained = ours.train_on_batch(x[:BATCH], y[:BATCH])
  np.testing.assert_allclose(evaluated, reference.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=0, atol=bound)
  np.testing.assert_allclose(predicted, reference.predict(x, batch_size=BATCH, verbose=0), rtol=0, atol=bound)
  np.testing.assert_allclose(trained, reference.train_on_batch(x[:BATCH], y[:BATCH]), rtol=0, atol=bound)
  assert_every_copy(ours.weights, reference.weights, atol=bound)


def test_a_custom_loop_with_a_plain_tf_function_step_and_dropout_trains_as_one_device():
  # The step a researcher writes for one device (a tape, the optimizer's apply), unchanged, 5 steps on a
  # {"stage": 2, "batch": 2} mesh with 4 microbatches a device; Dropout draws one device's numbers for the rows.
  # SGD with momentum (no normalized step to grow float32's noise). Measured: every weight and slot 6.0e-8 from one
  # device's after 5 steps, the losses 1.2e-7; bound 3e-7.
  x, y = _data()
  repl, model = _pipelined({"stage": 2, "batch": 2}, 4, bn=False, dropout=True)
  reference = _model(bn=False, dropout=True)
  with repl.context():
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  reference_optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step_for(net, opt):
    def step(batch):
      features, labels = batch
      with tf.GradientTape() as tape:
        loss = loss_fn(labels, net(features, training=True))
      opt.apply_gradients(zip(tape.gradient(loss, net.trainable_variables), net.trainable_variables))
      return loss
    return step

  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True).repeat()
  ours = [float(repl.run(step_for(model, optimizer), data)) for _ in range(5)]
  one = tf.function(step_for(reference, reference_optimizer))
  theirs = [float(one(batch)) for batch in data.take(5)]
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=3e-7)
  assert_every_copy(model.weights, reference.weights, atol=3e-7)
  assert_every_copy(optimizer.variables, reference_optimizer.variables, atol=3e-7)


def test_each_stage_keeps_its_weights_and_slots_and_the_weights_restore_on_one_device(tmp_path):
  x, y = _data()
  repl, ours = _pipelined({"stage": 2, "batch": 2}, 2)
  with repl.context():
    ours.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  devices = [sorted({c.device[-5:] for c in _variables.underlying(w).components}) for w in ours.weights]
  # d0 and BatchNormalization's 4 (its moving statistics with them) and d1's 2 on the first stage's devices; d2's and
  # d3's 4 on the last's.
  assert devices == [["CPU:0", "CPU:1"]] * 7 + [["CPU:2", "CPU:3"]] * 4
  slots = [v for v in ours.optimizer.variables if v.path.endswith(("momentum", "velocity"))]
  assert [len(_variables.underlying(v).components) for v in slots] == [2] * len(slots)
  # First stage: 6 x 16 + 16 x 4 (gamma, beta, moving mean and variance) + 16 x 16 + 16 = 432 floats, of which
  # 400 trained (Adam's two slots each); last: 16 x 8 + 8 + 8 x 3 + 3 = 163, all trained. Adam's counter and
  # learning rate on every device.
  assert replicator.bytes_per_device(ours.weights + ours.optimizer.variables) == {
      "/device:CPU:0": (432 + 2 * 400) * 4 + 12, "/device:CPU:1": (432 + 2 * 400) * 4 + 12,
      "/device:CPU:2": 163 * 3 * 4 + 12, "/device:CPU:3": 163 * 3 * 4 + 12}
  path = str(tmp_path / "stages.weights.h5")
  ours.save_weights(path)
  one = _model()
  one.load_weights(path)
  for mine, theirs in zip(one.weights, ours.weights, strict=True):
    np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
  other_repl, other = _pipelined({"stage": 4}, 2)  # (another stage count)
  other.load_weights(path)
  for mine, theirs in zip(other.weights, ours.weights, strict=True):
    np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_the_memory_report_gives_each_device_its_stage_s_variables_and_slots():
  # repl.memory of the pipelined step against the same step on one device's mesh: the variables and slots a
  # device, 1/p of one device's (stages of equal weights here), the rest (Adam's counter, learning rate) on each.
  x, y = _data()
  sizes = {"stage": 2}
  repl = replicator.Replicator(mesh=mesh.Mesh(sizes, devices=cpus(2)), view="global", batch_axes=())
  with repl.context():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(32)])
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
  repl.pipeline_stages([model.layers[:2], model.layers[2:]], microbatches=2)

  def step(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(batch) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  data = tf.data.Dataset.from_tensors(x[:16]).repeat()
  report = repl.memory(step, data)
  per_device = [device.variable_bytes for device in report.devices]
  first = (6 * 32 + 32 + 32 * 32 + 32) * 3 * 4 + 12
  last = (32 * 32 + 32) * 2 * 3 * 4 + 12
  assert per_device == [first, last], per_device
  whole = (6 * 32 + 32 + 3 * (32 * 32 + 32)) * 3 * 4 + 12  # one device's
  assert abs(first + last - 12 - whole) == 0


@pytest.mark.parametrize("what, call, message", [
    ("local view", lambda repl, model: replicator.Replicator(mesh=repl.mesh, batch_axes=()).pipeline_stages(
        _stages(model, 2), microbatches=2), "partitions a global-view step; this Replicator's view is 'local'"),
    ("unknown axis", lambda repl, model: repl.pipeline_stages(_stages(model, 2), microbatches=2, axis="pipe"),
     "expected one axis of the mesh {'stage': 2} that is not a batch axis"),
    ("stage count", lambda repl, model: repl.pipeline_stages(_stages(model, 3), microbatches=2),
     "3 stages for the 2 devices along 'stage'; expected one a device"),
    ("no variables", lambda repl, model: repl.pipeline_stages([model.layers[:4], [keras.layers.ReLU()]],
                                                              microbatches=2), "stage 1 .* has no variables"),
    ("twice", lambda repl, model: repl.pipeline_stages([model.layers[:2], model.layers[1:]], microbatches=2),
     "the variable .* is in stages 0 and 1"),
    ("microbatches", lambda repl, model: repl.pipeline_stages(_stages(model, 2), microbatches=0),
     "expected a positive int"),
])
def test_what_a_pipeline_cannot_be_is_refused_by_name(what, call, message):
  repl, model = _pipelined({"stage": 2}, 2, bn=False)
  with pytest.raises(replicator.ArgumentError, match=message):
    call(repl, model)


def test_rows_that_do_not_divide_into_the_microbatches_are_refused_with_the_fix():
  x, y = _data()
  repl, model = _pipelined({"stage": 2}, 3, bn=False)
  with pytest.raises(replicator.ArgumentError, match=r"the global batch's 16 rows do not divide into 3 pieces .* "
                     r"Fix: batch the dataset by a multiple of 3"):
    with repl.context():
      model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def _deep(p):
  keras.utils.set_random_seed(1)
  return keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(256, activation="tanh") for _ in range(2 * p)]
                          + [keras.layers.Dense(1)])


@pytest.mark.parametrize("p, m", [(2, 8), pytest.param(4, 16, marks=pytest.mark.full_grid)])
def test_1f1b_holds_p_of_gpipes_m_microbatches_activations_on_the_first_stage(p, m):
  # The memory report (its order: ops run as their inputs become ready, the first ready first) of the same step
  # under each schedule: the activations saved for backward that the first stage holds at once. GPipe (by dataflow)
  # holds every microbatch's; 1F1B, p of them. Measured: exactly p / m of GPipe's (0.25 at p = 2, m = 8 and p = 4,
  # m = 16); bound p / m + 10%.
  held = {}
  for schedule in ("gpipe", "1f1b"):
    repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)), view="global", batch_axes=())
    with repl.context():
      model, optimizer = _deep(p), keras.optimizers.SGD(0.1)
    layers = model.layers
    repl.pipeline_stages([layers[2 * k:2 * k + 2] for k in range(p - 1)] + [layers[2 * p - 2:]], microbatches=m,
                         schedule=schedule)

    def step(batch, model=model, optimizer=optimizer):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(batch) ** 2)
      optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
      return loss

    report = repl.memory(step, tf.data.Dataset.from_tensors(tf.ones([16 * m, 64])).repeat())
    held[schedule] = report.devices[0].saved_peak_bytes
  assert held["gpipe"] == m * 2 * 16 * 256 * 4  # (each microbatch's 16 rows: its 2 layers' 256-wide outputs)
  assert held["1f1b"] <= (p / m) * 1.1 * held["gpipe"], held


def test_1f1b_refuses_a_step_that_combines_the_microbatches_before_their_backward_passes():
  # BatchNormalization's statistics over the batch, on the first stage: microbatch 2's forward pass would wait for
  # microbatch 0's backward pass, which waits for the statistics of every microbatch.
  x, y = _data()
  repl, model = _pipelined({"stage": 2}, 4)  # (1F1B: the default)
  with pytest.raises(replicator.UnsupportedError, match=r"The 1F1B schedule cannot run this step: .*bn.* combines "
                     r"every microbatch's value before their backward passes.*Fix: schedule='gpipe'"):
    with repl.context():
      model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_stages_compose_with_batch_and_tensor_splits_on_a_2x2x2_mesh():
  # {"stage": 2, "batch": 2, "model": 2}: each stage's Dense kernels split over "model" (Megatron's pairs: the
  # first of each pair by columns, the second by rows), the batch over "batch", 2 microbatches a device; Adam,
  # 3 steps of the plain step. Each stage's weights and slots (split over "model") on its 4 devices alone.
  # Bound: twice one device's floor (every weight, slot and loss with its rows reversed), measured 6.0e-8; ours
  # measured 7.5e-8.
  x, y = _data()
  x, y = x[:16], tf.one_hot(y[:16], CLASSES).numpy()
  layouts = {r"a/kernel": (None, "model"), r"a/bias": ("model",), r"b/kernel": ("model", None),
             r"c/kernel": (None, "model"), r"c/bias": ("model",), r"d/kernel": ("model", None)}

  def make():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh", name="a"),
                             keras.layers.Dense(8, activation="tanh", name="b"),
                             keras.layers.Dense(16, activation="tanh", name="c"), keras.layers.Dense(CLASSES, name="d")])

  def train(model, optimizer, run, rows):
    def step(batch):
      features, labels = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(features) - labels) ** 2)
      optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
      return loss
    data = tf.data.Dataset.from_tensors((x[rows], y[rows])).repeat()
    return [float(run(step, data)) for _ in range(3)]

  def one_device(rows):
    model, optimizer = make(), keras.optimizers.Adam(1e-2)
    losses = train(model, optimizer, lambda step, data: tf.function(step)(next(iter(data))), rows)
    return losses, [v.numpy() for v in model.weights + optimizer.variables]

  rows = np.arange(16)
  expected_losses, expected = one_device(rows)
  reversed_losses, reversed_ = one_device(rows[::-1])
  floor = max(float(np.max(np.abs(np.subtract(a, b))))
              for a, b in zip(expected + [expected_losses], reversed_ + [reversed_losses]))
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2, "batch": 2, "model": 2}, devices=cpus(8)), view="global",
                               batch_axes=("batch",))
  with repl.context(layouts=layouts):
    model, optimizer = make(), keras.optimizers.Adam(1e-2)
  repl.pipeline_stages([model.layers[:2], model.layers[2:]], microbatches=2)
  losses = train(model, optimizer, repl.run, rows)
  got = [v.numpy() for v in model.weights + optimizer.variables]
  distance = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(got + [losses], expected + [expected_losses]))
  assert distance <= 2 * floor, (distance, floor)
  held = [sorted({c.device[-5:] for c in _variables.underlying(w).components}) for w in model.weights]
  assert held == [["CPU:0", "CPU:1", "CPU:2", "CPU:3"]] * 4 + [["CPU:4", "CPU:5", "CPU:6", "CPU:7"]] * 4
  kernel = _variables.underlying(model.layers[0].kernel)
  assert [c.shape.as_list() for c in kernel.components] == [[FEATURES, 8]] * 4  # (its columns split over "model")
