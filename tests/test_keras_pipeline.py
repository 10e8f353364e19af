"""``replicator.PipelineModel``: Keras's fit, evaluate and predict of a model cut into stages, a local-view pipeline."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from stage_losses import AddsLosses

import mesh
import replicator
from replicator.state import _variables

FEATURES, CLASSES, ROWS, BATCH = 6, 3, 41, 16  # 41 rows in batches of 16: Keras's last batch has 9


def _stages():
  keras.utils.set_random_seed(1)
  return [keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                            keras.layers.Dense(8, activation="tanh")], name="first"),
          keras.Sequential([keras.Input((8,)), keras.layers.Dense(CLASSES)], name="last")]


def _compile(model, steps_per_execution=1):
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")],
                steps_per_execution=steps_per_execution)
  return model


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
  return x, rng.integers(0, CLASSES, ROWS), rng.uniform(0.5, 1.5, ROWS).astype("float32")


def _replicator(sizes):
  return replicator.Replicator(mesh=mesh.Mesh(sizes, devices=cpus(int(np.prod(list(sizes.values()))))),
                               batch_axes=("batch",) if "batch" in sizes else ())


def _pipelined(repl, steps_per_execution=1, **kwargs):
  with repl.context():
    return _compile(replicator.PipelineModel(_stages(), **kwargs), steps_per_execution)


SHAPES = {"stage": {"stage": 2}, "stage_x_batch": {"stage": 2, "batch": 2}}
# (shape, schedule): microbatches, steps_per_execution. 3 microbatches do not divide the batch axis's 8 rows a replica
# (3, 3 and 2 rows), nor the short last batch's 5 and 4; steps_per_execution=2 runs 2 steps a call of Keras's function.
SETTINGS = {("stage_x_batch", "1f1b"): (3, 1), ("stage", "gpipe"): (2, 2), ("stage", "1f1b"): (2, 1),
            ("stage_x_batch", "gpipe"): (2, 1)}
CASES = [pytest.param(shape, schedule, marks=() if (shape, schedule) in (("stage_x_batch", "1f1b"), ("stage", "gpipe"))
                      else (pytest.mark.full_grid,), id=f"{shape}-{schedule}")
         for shape in sorted(SHAPES) for schedule in ("1f1b", "gpipe")]


@pytest.mark.parametrize("shape, schedule", CASES)
def test_fit_evaluate_and_predict_are_one_devices_keras_of_the_stages_in_a_row(shape, schedule):
  # 2 epochs of 41 rows in batches of 16 (the last of 9: on the batch axis 5 and 4 rows), Adam, sample weights,
  # validation data of 21 rows (SETTINGS: the microbatches and steps_per_execution), against one device's fit of
  # keras.Sequential(stages) from the same weights. Measured (every case, --full-grid): the weights 3.0e-7 from one
  # device's at most, Adam's slots 7.5e-9, the history's values 1.2e-7, evaluate 1.2e-7, predict 2.1e-7 (float32
  # sums in another order: each microbatch's matmuls and loss apart). Bound: 6e-7, twice the largest. Each
  # replica's gradient not weighted by its rows in the short last batch is 2.4e-2 off; the metrics updated on every
  # stage, 0.54.
  x, y, weights = _data()
  microbatches, steps_per_execution = SETTINGS[shape, schedule]
  reference = _compile(keras.Sequential(_stages()), steps_per_execution)
  ours = _pipelined(_replicator(SHAPES[shape]), microbatches=microbatches, schedule=schedule,
                    steps_per_execution=steps_per_execution)
  np.testing.assert_allclose(ours.predict(x, batch_size=BATCH, verbose=0),  # (before fit: the forward pass places)
                             reference.predict(x, batch_size=BATCH, verbose=0), rtol=0, atol=6e-7)
  fit = dict(sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
             validation_data=(x[:21], y[:21]))
  expected, got = reference.fit(x, y, **fit).history, ours.fit(x, y, **fit).history
  assert sorted(got) == sorted(expected) == ["accuracy", "loss", "val_accuracy", "val_loss", "val_xent", "xent"]
  for key, values in expected.items():
    np.testing.assert_allclose(got[key], values, rtol=0, atol=6e-7, err_msg=key)
  assert_every_copy(ours.trainable_weights, reference.trainable_weights, atol=6e-7)
  assert [v.shape for v in ours.optimizer.variables] == [v.shape for v in reference.optimizer.variables]
  assert_every_copy(ours.optimizer.variables, reference.optimizer.variables, atol=6e-7)
  assert int(ours.optimizer.iterations.numpy()) == 6
  np.testing.assert_allclose(ours.evaluate(x, y, batch_size=BATCH, verbose=0),
                             reference.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=0, atol=6e-7)
  np.testing.assert_allclose(ours.predict(x, batch_size=BATCH, verbose=0),
                             reference.predict(x, batch_size=BATCH, verbose=0), rtol=0, atol=6e-7)
  for call in ("train_on_batch", "test_on_batch"):  # (Keras's functions of fit and evaluate, on one batch)
    np.testing.assert_allclose(getattr(ours, call)(x[:BATCH], y[:BATCH]), getattr(reference, call)(x[:BATCH], y[:BATCH]),
                               rtol=0, atol=6e-7, err_msg=call)
  assert_every_copy(ours.trainable_weights, reference.trainable_weights, atol=6e-7)


def test_each_stage_keeps_its_weights_and_slots_and_a_saved_model_restores_on_another_mesh(tmp_path):
  x, y, _ = _data()
  repl = _replicator({"stage": 2, "batch": 2})
  ours = _pipelined(repl, microbatches=4)
  ours.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  devices = [sorted({c.device[-5:] for c in _variables.underlying(w).components}) for w in ours.trainable_weights]
  assert devices == [["CPU:0", "CPU:1"]] * 4 + [["CPU:2", "CPU:3"]] * 2  # the first stage's 4, the last's 2
  slots = [v for v in ours.optimizer.variables if "kernel" in v.path or "bias" in v.path]
  assert {len(_variables.underlying(v).components) for v in slots} == {2}  # each slot on its stage's 2 devices
  # 6 x 16 + 16 x 8 kernels, 24 biases: 248 floats and Adam's two slots for them on the first stage's devices;
  # 8 x 3 + 3 on the last's; Adam's step counter and learning rate (12 bytes) on every device.
  assert replicator.bytes_per_device(ours.weights + ours.optimizer.variables) == {
      "/device:CPU:0": 248 * 12 + 12, "/device:CPU:1": 248 * 12 + 12, "/device:CPU:2": 27 * 12 + 12,
      "/device:CPU:3": 27 * 12 + 12}
  path = str(tmp_path / "stages.weights.h5")
  ours.save_weights(path)
  other = _pipelined(_replicator({"stage": 2}), microbatches=2)
  other.load_weights(path)
  for mine, theirs in zip(other.weights, ours.weights, strict=True):
    np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
  ours.load_weights(path)  # back onto the placed variables: every copy written
  assert_every_copy(ours.trainable_weights, other.trainable_weights, atol=0)
  # The whole model (its config, weights, compile arguments and optimizer state), loaded in another Replicator's
  # context, trains on as the saved one does: an epoch more, measured 1.2e-7 apart in the history, 6e-8 in the
  # weights (the two meshes' sums in other orders); bound 3e-7.
  whole = str(tmp_path / "stages.keras")
  ours.save(whole)
  with _replicator({"stage": 2}).context():
    loaded = keras.saving.load_model(whole)
  assert isinstance(loaded, replicator.PipelineModel) and loaded.microbatches == 4
  for mine, theirs in zip(loaded.weights + loaded.optimizer.variables, ours.weights + ours.optimizer.variables,
                          strict=True):
    np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
  expected = ours.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
  got = loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
  for key, values in expected.items():
    np.testing.assert_allclose(got[key], values, rtol=0, atol=3e-7, err_msg=key)
  assert_every_copy(loaded.trainable_weights, ours.trainable_weights, atol=3e-7)


@pytest.mark.full_grid
def test_the_interleaved_schedule_with_two_stages_a_device():
  # 4 stages on {"stage": 2, "batch": 2}, device d running stages d and d + 2: the same fit as the main test's.
  # Measured: the history 1.2e-7 from one device's, the weights 6e-8, predict 2.1e-7; bound 6e-7 as there.
  def stages():
    keras.utils.set_random_seed(1)
    widths = [(FEATURES, 16), (16, 8), (8, 8), (8, CLASSES)]
    return [keras.Sequential([keras.Input((a,)), keras.layers.Dense(b, activation="tanh" if b != CLASSES else None)])
            for a, b in widths]

  x, y, weights = _data()
  reference = _compile(keras.Sequential(stages()))
  with _replicator({"stage": 2, "batch": 2}).context():
    ours = _compile(replicator.PipelineModel(stages(), microbatches=2, schedule="interleaved"))
  fit = dict(sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
             validation_data=(x[:21], y[:21]))
  expected, got = reference.fit(x, y, **fit).history, ours.fit(x, y, **fit).history
  for key, values in expected.items():
    np.testing.assert_allclose(got[key], values, rtol=0, atol=6e-7, err_msg=key)
  assert_every_copy(ours.trainable_weights, reference.trainable_weights, atol=6e-7)
  np.testing.assert_allclose(ours.predict(x, batch_size=BATCH, verbose=0),
                             reference.predict(x, batch_size=BATCH, verbose=0), rtol=0, atol=6e-7)
  devices = [sorted({c.device[-5:] for c in _variables.underlying(stage.weights[0]).components})
             for stage in ours.stages]
  assert devices == [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]] * 2


def test_dropout_in_the_stages_draws_one_devices_numbers_on_a_stage_axis():
  # On {"stage": 2} the stages share one random stream (repl.pipeline): Keras's Dropout draws the masks one device's
  # fit draws. 2 epochs: measured 3.3e-7 from one device's weights; bound 7e-7. (With a batch axis each batch
  # replica draws its own, as the local view's data parallelism does: 8e-2 off here.)
  def stages():
    keras.utils.set_random_seed(1)
    return [keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dropout(0.5), keras.layers.Dense(8, activation="tanh")]),
            keras.Sequential([keras.Input((8,)), keras.layers.Dropout(0.3), keras.layers.Dense(CLASSES)])]

  x, y, _ = _data()
  reference = _compile(keras.Sequential(stages()))
  with _replicator({"stage": 2}).context():
    ours = _compile(replicator.PipelineModel(stages(), microbatches=2))
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
  got = ours.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
  np.testing.assert_allclose(got["loss"], expected["loss"], rtol=0, atol=7e-7)
  assert_every_copy(ours.trainable_weights, reference.trainable_weights, atol=7e-7)


def test_on_one_device_it_is_the_stages_in_a_row():
  x, _, _ = _data()
  with _replicator({"stage": 2}).context():
    ours = replicator.PipelineModel(_stages(), microbatches=2)
  np.testing.assert_array_equal(ours(x).numpy(), keras.Sequential(_stages())(x).numpy())


def _refused(error, *fragments, **kwargs):
  with pytest.raises(error) as raised:
    kwargs.pop("make")()
  for fragment in fragments:
    assert fragment in str(raised.value), (fragment, str(raised.value))


def test_misuse_is_named():
  repl = _replicator({"stage": 2, "batch": 2})
  _refused(replicator.ReplicaContextError, "made outside a Replicator's context", "Fix: make and compile it inside",
           make=lambda: replicator.PipelineModel(_stages(), microbatches=2))
  with repl.context():
    _refused(replicator.ArgumentError, "has no such axis", "'pipe'", "Fix:",
             make=lambda: replicator.PipelineModel(_stages(), microbatches=2, axis="pipe"))
    _refused(replicator.ArgumentTypeError, "stage 1 is 3 (int), not a callable",
             make=lambda: replicator.PipelineModel([_stages()[0], 3], microbatches=2))
    _refused(replicator.ArgumentError, "3 stages over the axis 'stage' of 2 devices; expected one stage a device",
             make=lambda: replicator.PipelineModel(_stages() + [keras.layers.Dense(1)], microbatches=2))
    _refused(replicator.ArgumentError, "microbatches=0", make=lambda: replicator.PipelineModel(_stages(), microbatches=0))
    _refused(replicator.ArgumentError, "schedule='zero'",
             make=lambda: replicator.PipelineModel(_stages(), microbatches=2, schedule="zero"))
  with _replicator({"stage": 2, "batch": 2}).context():
    few = _compile(replicator.PipelineModel(_stages(), microbatches=2))
  x, y, _ = _data()
  _refused(replicator.ArgumentError, "a batch of 1 rows cannot be split over the 2 batch replicas", "Fix:",
           make=lambda: few.fit(x[:1], y[:1], batch_size=1, epochs=1, verbose=0))
  with pytest.raises(replicator.UnsupportedError, match="write the step with repl.pipeline"):
    repl.explain(few.train_step, tf.data.Dataset.from_tensors((x, y)))
  with pytest.raises(replicator.UnsupportedError, match="write the step with repl.pipeline"):
    repl.memory(few.test_step, tf.data.Dataset.from_tensors((x, y)))
  global_repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)), view="global")
  with global_repl.context():
    _refused(replicator.UnsupportedError, "global-view Replicator", "StackedBlocks",
             make=lambda: replicator.PipelineModel(_stages(), microbatches=2))


def _regularized_stages():
  # Every kind of loss a stage adds: weight penalties (L2 kernel, L1 bias, L1L2 kernel), an activity penalty (Keras
  # divides it by the output's rows), and a layer's add_loss of its inputs' mean and of its own weight.
  keras.utils.set_random_seed(1)
  return [keras.Sequential([keras.Input((FEATURES,)),
                            keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05),
                                               activity_regularizer=keras.regularizers.L1(0.01)),
                            keras.layers.Dense(8, activation="tanh", bias_regularizer="l1")], name="first"),
          keras.Sequential([keras.Input((8,)), AddsLosses(),
                            keras.layers.Dense(CLASSES, kernel_regularizer=keras.regularizers.L1L2(0.01, 0.02))],
                           name="last")]


@pytest.mark.parametrize("shape, schedule", [("stage_x_batch", "1f1b"),
                                             pytest.param("stage", "gpipe", marks=pytest.mark.full_grid)])
def test_the_losses_the_stages_add_are_one_devices(shape, schedule):
  # The main test's fit (2 epochs, Adam, sample weights, validation data, the short last batch split 5 and 4 rows
  # over the batch axis, 3 microbatches of uneven rows) of stages adding every kind of loss, against one device's
  # fit of keras.Sequential(stages): the history's losses include them, each weight's penalty once a step.
  # Measured (both shapes, both schedules): the history 2.4e-7 from one device's at most (losses near 2.1), the
  # weights 6.0e-8, Adam's slots 1.1e-8, evaluate 1.2e-7, predict 1.6e-7; one device's own fit with the rows of each
  # batch in another order is as far from it (2.4e-7, 6.0e-8, 1.1e-8). Bound: 6e-7, the main test's. Without the
  # stages' losses the history is 0.73 off, the weights 0.12.
  x, y, weights = _data()
  reference = _compile(keras.Sequential(_regularized_stages()))
  with _replicator(SHAPES[shape]).context():
    ours = _compile(replicator.PipelineModel(_regularized_stages(), microbatches=3, schedule=schedule))
  fit = dict(sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
             validation_data=(x[:21], y[:21]))
  expected, got = reference.fit(x, y, **fit).history, ours.fit(x, y, **fit).history
  for key, values in expected.items():
    np.testing.assert_allclose(got[key], values, rtol=0, atol=6e-7, err_msg=key)
  assert_every_copy(ours.trainable_weights, reference.trainable_weights, atol=6e-7)
  assert_every_copy(ours.optimizer.variables, reference.optimizer.variables, atol=6e-7)
  assert int(ours.optimizer.iterations.numpy()) == 6
  np.testing.assert_allclose(ours.evaluate(x, y, batch_size=BATCH, verbose=0),
                             reference.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=0, atol=6e-7)
  np.testing.assert_allclose(ours.predict(x, batch_size=BATCH, verbose=0),
                             reference.predict(x, batch_size=BATCH, verbose=0), rtol=0, atol=6e-7)


def _two_input_stages(kind):
  # A first stage of two inputs (a dict of named inputs, or a list), joined, then a Dense stage.
  keras.utils.set_random_seed(1)
  a, b = keras.Input((FEATURES,), name="a"), keras.Input((2,), name="b")
  h = keras.layers.Dense(16, activation="tanh")(keras.layers.Concatenate()([a, b]))
  first = keras.Model({"a": a, "b": b} if kind == "dict" else [a, b], h, name="first")
  return [first, keras.Sequential([keras.Input((16,)), keras.layers.Dense(CLASSES)], name="last")]


@pytest.mark.parametrize("kind", ["dict", pytest.param("tuple", marks=pytest.mark.full_grid)])
def test_inputs_of_several_tensors_to_the_first_stage(kind):
  # x a dict (or a tuple) of two arrays, split into the batch replicas' rows and the microbatches leaf by leaf,
  # against one device's fit of the functional model of the stages in a row. Measured (both): the history 1.2e-7
  # from one device's, the weights 8.9e-8, Adam's slots 1.0e-8, predict 1.8e-7; bound 6e-7, the main test's.
  x, y, weights = _data()
  other = np.random.default_rng(1).normal(size=(ROWS, 2)).astype("float32")
  inputs = {"a": x, "b": other} if kind == "dict" else (x, other)
  stages = _two_input_stages(kind)
  reference = _compile(keras.Model(stages[0].inputs, stages[1](stages[0].outputs[0])))
  with _replicator({"stage": 2, "batch": 2}).context():
    ours = _compile(replicator.PipelineModel(_two_input_stages(kind), microbatches=3))
  fit = dict(sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
  expected, got = reference.fit(inputs, y, **fit).history, ours.fit(inputs, y, **fit).history
  for key, values in expected.items():
    np.testing.assert_allclose(got[key], values, rtol=0, atol=6e-7, err_msg=key)
  assert_every_copy(ours.trainable_weights, reference.trainable_weights, atol=6e-7)
  assert_every_copy(ours.optimizer.variables, reference.optimizer.variables, atol=6e-7)
  np.testing.assert_allclose(ours.predict(inputs, batch_size=BATCH, verbose=0),
                             reference.predict(inputs, batch_size=BATCH, verbose=0), rtol=0, atol=6e-7)


@pytest.fixture
def bfloat16_policy():
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    yield
  finally:
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_bfloat16_trains_as_one_device_within_bfloat16s_rounding(bfloat16_policy):  # pylint: disable=redefined-outer-name,unused-argument
  # mixed_bfloat16 (no loss scaling): the stages compute in bfloat16 on float32 weights, with an L2 kernel penalty.
  # 2 epochs against one device's fit under the same policy. Measured: the history 4.8e-4 from one device's, the
  # weights 5.1e-4, Adam's slots 2.1e-4 (with a batch axis: 1.9e-4, 5.0e-4, 1.8e-4); one device's own bfloat16 fit
  # is 7.9e-4, 5.9e-4 and 1.4e-4 from its float32 fit, and 3.8e-4, 1.5e-4 and 1.8e-4 from itself with the rows of
  # each batch in another order (bfloat16 sums of other rows). Bound 2e-3, 2.5 times one device's largest distance
  # from float32. Stages computing in float32 (the policy not followed) would be within it: the dtypes are checked.
  def stages():
    keras.utils.set_random_seed(1)
    return [keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(
        16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05))]),
            keras.Sequential([keras.Input((16,)), keras.layers.Dense(CLASSES)])]

  x, y, weights = _data()
  reference = _compile(keras.Sequential(stages()))
  with _replicator({"stage": 2}).context():
    ours = _compile(replicator.PipelineModel(stages(), microbatches=3))
  assert not isinstance(ours.optimizer, keras.optimizers.LossScaleOptimizer)
  assert ours.stages[0].layers[0].compute_dtype == "bfloat16" and ours.trainable_weights[0].dtype == "float32"
  fit = dict(sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
  expected, got = reference.fit(x, y, **fit).history, ours.fit(x, y, **fit).history
  for key, values in expected.items():
    np.testing.assert_allclose(got[key], values, rtol=0, atol=2e-3, err_msg=key)
  assert_every_copy(ours.trainable_weights, reference.trainable_weights, atol=2e-3)
  assert_every_copy(ours.optimizer.variables, reference.optimizer.variables, atol=2e-3)


def test_an_optimizer_coupling_every_stage_is_refused_at_compile():
  # Each stage's devices update their stage's weights alone: an optimizer whose update spans every weight is named.
  cases = [
      (lambda: keras.optimizers.Adam(gradient_accumulation_steps=4),
       ["has gradient_accumulation_steps=4", "Fix: a batch 4 times larger and 4 times the microbatches"]),
      (lambda: keras.optimizers.Adam(use_ema=True), ["has use_ema=True", "Fix: use_ema=False"]),
      (lambda: keras.optimizers.Adam(global_clipnorm=1.0), ["has global_clipnorm=1.0", "Fix: clipnorm="]),
  ]
  with _replicator({"stage": 2}).context():
    model = replicator.PipelineModel(_stages(), microbatches=2)
    for make, fragments in cases:
      _refused(replicator.UnsupportedError, "expected an optimizer that updates each weight from its own gradient",
               *fragments, make=lambda make=make: model.compile(optimizer=make(), loss="mse"))


def _float16_stages():
  keras.utils.set_random_seed(1)
  return [keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(
      16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05))]),
          keras.Sequential([keras.Input((16,)), keras.layers.Dense(CLASSES)])]


def _float16_compiled(model, initial_scale, growth):
  model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=initial_scale,
                                                              dynamic_growth_steps=growth),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
  return model


@pytest.fixture
def float16_policy():
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    yield
  finally:
    keras.mixed_precision.set_global_policy("float32")


# (initial scale, steps between doublings): the scale, the steps skipped after 6.
FLOAT16_CASES = {(2.0 ** 15, 2): (2.0 ** 18, 0), (2.0 ** 21, 1000): (2.0 ** 18, 3)}


@pytest.mark.parametrize("initial_scale, growth", sorted(FLOAT16_CASES))
def test_mixed_float16_scales_the_loss_and_skips_a_step_on_every_stage_as_one_device(float16_policy, initial_scale,  # pylint: disable=redefined-outer-name,unused-argument
                                                                                     growth):
  # Under mixed_float16 (Keras's compile wraps the optimizer in a LossScaleOptimizer; here given), on {"stage": 2,
  # "batch": 2}, 2 epochs: each backward pass is seeded with the scale times the replica's share of the rows (each
  # row's float16 gradient one device's), and a step is skipped on every stage if any stage's gradients are not
  # finite. 2^15, doubling every 2 steps: none skipped, the scale 2^18 after 6 steps; 2^21: the first 3 steps
  # overflow in float16 on one device and here, skipped on both stages. Against one device's fit under the same
  # policy: the scale, its counter and the optimizer's iterations exactly. Measured: the weights 4.0e-5 (3.0e-5)
  # from one device's, Adam's slots 2.5e-5 (1.4e-5), the history 1.0e-5 (0); one device's own float16 fit is 7.6e-5
  # (3.0e-2) from its float32 fit in the weights, and 0 from itself with each batch's rows in another order (1.2e-7
  # in the history): the 4.0e-5 is the microbatches' float16 products, each rounded before their float32 sum, not
  # row order. Bound 3e-4, four times the float32 distance. Seeded with the scale alone (each
  # replica's rows' gradients twice one device's, in float16), a start at 2^19 or 2^23 doubling every 2 steps
  # skipped a step one device did not. Near the overflow a step can still be decided otherwise: a microbatch's
  # float16 matmul sums fewer rows than one device's (a start at 2^20 doubling never: 2 steps skipped on both, not
  # the same ones).
  x, y, weights = _data()
  reference = _float16_compiled(keras.Sequential(_float16_stages()), initial_scale, growth)
  with _replicator({"stage": 2, "batch": 2}).context():
    ours = _float16_compiled(replicator.PipelineModel(_float16_stages(), microbatches=3), initial_scale, growth)
  fit = dict(sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
  expected, got = reference.fit(x, y, **fit).history, ours.fit(x, y, **fit).history
  assert isinstance(ours.optimizer, keras.optimizers.LossScaleOptimizer)
  assert ours.stages[0].layers[0].compute_dtype == "float16"
  scale, skipped = FLOAT16_CASES[initial_scale, growth]
  assert float(reference.optimizer.dynamic_scale.numpy()) == scale
  assert int(reference.optimizer.iterations.numpy()) == 6 - skipped
  for name in ("dynamic_scale", "step_counter", "iterations"):
    assert int(getattr(ours.optimizer, name).numpy()) == int(getattr(reference.optimizer, name).numpy()), name
  for key, values in expected.items():
    np.testing.assert_allclose(got[key], values, rtol=0, atol=3e-4, err_msg=key)
  assert_every_copy(ours.trainable_weights, reference.trainable_weights, atol=3e-4)
  assert_every_copy(ours.optimizer.variables, reference.optimizer.variables, atol=3e-4)


@pytest.mark.full_grid
def test_a_batch_of_unknown_rows_too_small_for_the_batch_replicas_is_refused_as_it_runs():
  # A last batch of 1 row after batches of 20: its rows unknown when traced (Keras's retrace), refused as it runs.
  with _replicator({"stage": 2, "batch": 2}).context():
    few = _compile(replicator.PipelineModel(_stages(), microbatches=2))
  x, y, _ = _data()
  _refused(tf.errors.InvalidArgumentError, "a batch of fewer rows cannot be split over the 2 batch replicas",
           make=lambda: few.fit(x[:21], y[:21], batch_size=20, epochs=1, shuffle=False, verbose=0))


def test_the_keras_private_name_it_uses():
  # _keras_pipeline.py updates Keras's loss mean (Trainer._loss_tracker: train_step and test_step update it, no
  # public method does). If Keras renames it, this fails first.
  model = _compile(keras.Sequential(_stages()))
  assert isinstance(model._loss_tracker, keras.metrics.Mean) and model._loss_tracker.name == "loss"  # pylint: disable=protected-access
  assert model.metrics[0] is model._loss_tracker  # pylint: disable=protected-access
