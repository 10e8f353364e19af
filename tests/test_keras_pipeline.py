"""``replicator.PipelineModel``: Keras's fit, evaluate and predict of a model cut into stages, a local-view pipeline."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus

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
  with repl.context():
    keras.utils.set_random_seed(1)
    regularized = _compile(replicator.PipelineModel(
        [keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, kernel_regularizer="l2")]),
         keras.Sequential([keras.Input((8,)), keras.layers.Dense(CLASSES)])], microbatches=2))
  _refused(replicator.UnsupportedError, "has a regularizer", "Fix:",
           make=lambda: regularized.fit(x, y, batch_size=BATCH, epochs=1, verbose=0))
  with pytest.raises(replicator.UnsupportedError, match="write the step with repl.pipeline"):
    repl.explain(few.train_step, tf.data.Dataset.from_tensors((x, y)))
  with pytest.raises(replicator.UnsupportedError, match="write the step with repl.pipeline"):
    repl.memory(few.test_step, tf.data.Dataset.from_tensors((x, y)))
  global_repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)), view="global")
  with global_repl.context():
    _refused(replicator.UnsupportedError, "global-view Replicator", "StackedBlocks",
             make=lambda: replicator.PipelineModel(_stages(), microbatches=2))


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
