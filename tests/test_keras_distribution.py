"""``replicator.enable_keras_distribution()`` (``replicator/_keras_hooks.py``): Keras's distribution API on TensorFlow.

Code written after Keras's distribution guide (for JAX), with the one added
line, against the same code on one device: every device's copy of every
variable, Adam's slots and iteration included. Without the line, Keras 3.15 on
TensorFlow trains such code on one device without a word.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import assert_every_copy_float16
from conftest import cpus
from conftest import float16_noise

import replicator

X = np.random.RandomState(0).normal(size=(40, 6, 6, 1)).astype(np.float32)
Y = np.random.RandomState(1).randint(0, 10, size=(40,)).astype(np.int32)


@pytest.fixture(autouse=True)
def _enabled():
  replicator.enable_keras_distribution()
  yield
  keras.distribution.set_distribution(None)


def _dataset():
  return tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)  # as the guide: no drop_remainder (16, 16, 8 rows)


def _guide_model(optimizer="adam"):
  """The guide's model-parallel model (a Flatten, Dense "d1", Dropout, Dense "d2"), at a small size."""
  keras.utils.set_random_seed(0)
  inputs = keras.layers.Input(shape=(6, 6, 1))
  y = keras.layers.Flatten()(inputs)
  y = keras.layers.Dense(units=32, use_bias=False, activation="relu")(y)
  y = keras.layers.Dense(units=16, activation="relu", name="d1")(y)
  y = keras.layers.Dense(units=10, name="d2")(y)
  model = keras.Model(inputs=inputs, outputs=y)
  if optimizer == "scaled adam":  # what Keras's compile makes of "adam" under mixed_float16, in any policy
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
  else:
    optimizer = keras.optimizers.Adam(1e-2) if optimizer == "adam" else keras.optimizers.SGD(0.1)
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=optimizer)
  return model


def _one_device(optimizer="adam", epochs=2):
  keras.distribution.set_distribution(None)
  model = _guide_model(optimizer)
  history = model.fit(_dataset(), epochs=epochs, verbose=0)
  return model, history, model.evaluate(_dataset(), verbose=0), model.predict(X[:8], verbose=0)


def _assert_as_one_device(model, reference, atol=1e-6):
  ref_model, ref_history, ref_eval, ref_predictions = reference
  assert_every_copy(model.weights, ref_model.weights, atol=atol)
  assert_every_copy(model.optimizer.variables, ref_model.optimizer.variables, atol=atol)
  np.testing.assert_allclose(model.evaluate(_dataset(), verbose=0), ref_eval, atol=atol)
  np.testing.assert_allclose(model.predict(X[:8], verbose=0), ref_predictions, atol=atol)


def test_the_guides_data_parallel_script_runs_distributed():
  reference = _one_device("sgd")
  data_parallel = keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:4])
  keras.distribution.set_distribution(data_parallel)
  model = _guide_model("sgd")
  assert isinstance(model.layers[2].kernel.value, replicator.ReplicatedVariable)  # one copy a device
  assert len(model.layers[2].kernel.value.components) == 4
  history = model.fit(_dataset(), epochs=2, verbose=0)
  np.testing.assert_allclose(history.history["loss"], reference[1].history["loss"], atol=1e-6)
  _assert_as_one_device(model, reference)
  assert replicator.distribution_replicator().num_replicas == 4


def test_the_guides_model_parallel_script_splits_the_layout_maps_variables_and_equals_one_device():
  # Adam, 6 steps. Measured: one device (float32) is 6.0e-8 from a float64 run of the same fit, the split run
  # 6.0e-8 from it too, and 6.0e-8 from one device; 5e-7 leaves room for other kernels' orders, far below a wrong
  # step (a loss halved by the batch replicas left the weights 1.1e-2 off).
  reference = _one_device("adam")
  device_mesh = keras.distribution.DeviceMesh(shape=(2, 2), axis_names=["data", "model"], devices=cpus(4))
  layout_map = keras.distribution.LayoutMap(device_mesh)
  layout_map["d1/kernel"] = keras.distribution.TensorLayout([None, "model"])
  layout_map["d1/bias"] = keras.distribution.TensorLayout(["model"])
  layout_map["d2/output"] = keras.distribution.TensorLayout([None, "model"])  # Keras applies it: distribute_tensor
  model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
  keras.distribution.set_distribution(model_parallel)
  model = _guide_model("adam")
  kernel = model.get_layer("d1").kernel
  assert [c.shape.as_list() for c in kernel.value.components] == [[32, 8]] * 4  # split over "model"
  model.fit(_dataset(), epochs=2, verbose=0)
  _assert_as_one_device(model, reference, atol=5e-7)
  slots = [v for v in model.optimizer.variables if "d1_kernel" in v.path]
  assert slots and all(replicator.bytes_per_device([s]) == replicator.bytes_per_device([kernel]) for s in slots)
  keras.distribution.set_distribution(None)  # unset: models are one device's again, as before enabling
  assert not tf.distribute.has_strategy()
  assert not isinstance(_guide_model().layers[2].kernel.value, replicator.ReplicatedVariable)


def test_a_one_axis_mesh_splits_the_batch_and_the_weights_over_the_same_axis():
  reference = _one_device("sgd", epochs=1)
  device_mesh = keras.distribution.DeviceMesh(shape=(4,), axis_names=["model"], devices=cpus(4))
  layout_map = keras.distribution.LayoutMap(device_mesh)
  layout_map["d1/kernel"] = ("model",)  # shorter than the kernel's rank: (model, None), as Keras-JAX pads
  layout_map["d2/kernel"] = ("model", None)
  with keras.distribution.ModelParallel(layout_map=layout_map).scope():  # batch_dim_name: the first axis
    model = _guide_model("sgd")
    assert [c.shape.as_list() for c in model.get_layer("d1").kernel.value.components] == [[8, 16]] * 4
    model.fit(_dataset(), epochs=1, verbose=0)
    _assert_as_one_device(model, reference)
  assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()


def test_a_custom_loop_runs_on_the_distributions_replicator():
  keras.distribution.set_distribution(None)
  one = _guide_model("sgd")  # one device's, made and trained without a distribution
  early = keras.optimizers.SGD(0.1)  # an optimizer made before the distribution is set
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8, drop_remainder=True)

  def make_step(model, optimizer=None):
    def train_step(batch):
      x, y = batch
      with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      (optimizer or model.optimizer).apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return train_step

  one_step = tf.function(make_step(one))
  expected = [float(one_step(b)) for b in data.take(3)]
  device_mesh = keras.distribution.DeviceMesh(shape=(2, 2), axis_names=["batch", "model"], devices=cpus(4))
  layout_map = keras.distribution.LayoutMap(device_mesh)
  layout_map[".*d1/kernel"] = (None, "model")
  keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
  model = _guide_model("sgd")
  repl = replicator.distribution_replicator()
  losses = [float(repl.run(make_step(model), data)) for _ in range(3)]
  np.testing.assert_allclose(losses, expected, atol=1e-6)
  assert_every_copy(model.weights, one.weights)
  # A model made before the distribution was set predicts as it was made (one device), also while it is set;
  # training it there is refused with the fix, not run on one device behind the distribution's back.
  np.testing.assert_allclose(one.predict(X[:8], verbose=0), model.predict(X[:8], verbose=0), atol=1e-6)
  with pytest.raises(replicator.UnsupportedError, match=r"model.fit of a model whose variables are not this "
                                                        r"Replicator's.*Fix: make and compile the model inside"):
    one.fit(data, verbose=0)
  # The same in a custom step: the model made before (its variables one device's), or only its optimizer (its
  # iterations one device's variable; it enters the one-device strategy current when it was made: TensorFlow said
  # "Must not nest tf.distribute.Strategy scopes." and nothing else, when the step was traced in the distribution's
  # cross-replica context; it is traced in a replica context now, as on one device).
  before = [w.numpy() for w in one.weights]
  with pytest.raises(replicator.UnreplicatedStateError, match=r"created outside every Replicator context.*not while "
                                                              r"a distribution was set.*inside `distribution.scope\(\)`"):
    repl.run(make_step(one, keras.optimizers.SGD(0.1)), data)  # an optimizer made while the distribution is set
  with pytest.raises(replicator.UnreplicatedStateError, match=r"writes the variable 'sgd_\d+/iteration:0'.*created "
                                                              r"outside every Replicator context.*Fix: .*create the "
                                                              r"optimizer.*inside `distribution.scope\(\)`"):
    repl.run(make_step(model, early), data)
  for w, value in zip(one.weights, before):  # nothing ran
    np.testing.assert_array_equal(w.numpy(), value)


def test_checkpoints_under_model_parallel_reload_under_another_layout_map(tmp_path):
  def mesh_and_map(shape, axes, key, spec):
    device_mesh = keras.distribution.DeviceMesh(shape=shape, axis_names=axes, devices=cpus(4))
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[key] = spec
    return keras.distribution.ModelParallel(layout_map=layout_map)

  with mesh_and_map((2, 2), ["batch", "model"], "d1/kernel", (None, "model")).scope():
    model = _guide_model("adam")
    model.fit(_dataset(), epochs=1, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "ckpt"))
  with mesh_and_map((4,), ["model"], "d1/kernel", ("model", None)).scope():  # rows over 4, not columns over 2
    restored = _guide_model("adam")
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(path).assert_consumed()
  assert_every_copy(restored.weights, model.weights, atol=0)
  assert_every_copy(restored.optimizer.variables, model.optimizer.variables, atol=0)


def test_device_count_distribute_tensor_and_what_cannot_be_honoured():
  assert keras.distribution.get_device_count() == len(tf.config.list_logical_devices("CPU"))
  assert keras.distribution.get_device_count("cpu") == len(cpus(8))
  layout = keras.distribution.TensorLayout([None, "model"])
  x = tf.reshape(tf.range(6.0), [2, 3])
  np.testing.assert_array_equal(keras.distribution.distribute_tensor(x, layout), x)
  np.testing.assert_array_equal(tf.function(lambda t: keras.distribution.distribute_tensor(t, layout))(x), x)
  with pytest.raises(replicator.ClusterConfigError, match=r"on TensorFlow every process serves the job at its own "
                                                          r"address.*Fix: pass all"):
    keras.distribution.initialize(job_addresses="localhost:1", num_processes=2, process_id=0)  # JAX's style

  class Pipeline:  # a distribution of the user's own, as Keras allows: Keras's front end reads what it needs
    device_mesh = keras.distribution.DeviceMesh((2,), ["batch"], cpus(2))

  with pytest.raises(replicator.UnsupportedError, match=r"distributes keras.distribution.DataParallel and "
                                                        r"ModelParallel; a Pipeline has no counterpart"):
    keras.distribution.set_distribution(Pipeline())
  assert keras.distribution.distribution() is None  # the refused call set nothing
  repl = replicator.Replicator(cpus(2))
  with repl.context(), pytest.raises(replicator.ArgumentError, match=r"inside the scope of a KerasStrategy.*Fix: set "
                                                                     r"the distribution outside that scope"):
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=cpus(2)))
  assert keras.distribution.distribution() is None
  with pytest.raises(replicator.ReplicaContextError, match=r"needs a Keras distribution set.*found no distribution"):
    replicator.distribution_replicator()


def _fit_both_kinds(model):
  """An epoch of the guide's batches (16, 16, 8 rows: Keras traces a batch of unknown size), then of 8 rows each."""
  static = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8, drop_remainder=True)
  return [model.fit(data, epochs=1, verbose=0).history["loss"][0] for data in (_dataset(), static)]


@pytest.mark.parametrize("kind", ["data_parallel", "model_parallel"])
def test_mixed_float16_fit_equals_one_device(mixed_float16, kind):
  # Was: "apply() must be called in a replica context" (Keras's LossScaleOptimizer, traced in the distribution's
  # cross-replica context). Model parallel: then also its tf.cond, in which Adam's update of d2's (replicated)
  # kernel gathered the kernel's gradient, split over "model" by d1's split. Measured: 1.4e-4 (data parallel)
  # and 2.8e-4 (model parallel: d2 sums d1's split outputs in float16) from one device; float16 noise 2.4e-4.
  keras.distribution.set_distribution(None)
  keras.mixed_precision.set_global_policy("float32")  # the same fit, loss scaling and all, in float32
  exact = _guide_model("scaled adam")
  _fit_both_kinds(exact)
  mixed_float16()
  ref = _guide_model("adam")
  assert isinstance(ref.optimizer, keras.optimizers.LossScaleOptimizer)  # Keras's compile, under mixed_float16
  ref_history = _fit_both_kinds(ref)
  noise = float16_noise(ref.weights + ref.optimizer.variables, exact.weights + exact.optimizer.variables)
  if kind == "data_parallel":
    distribution = keras.distribution.DataParallel(devices=cpus(4))
  else:
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2, 2), ["data", "model"], cpus(4)))
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
  keras.distribution.set_distribution(distribution)
  model = _guide_model("adam")
  history = _fit_both_kinds(model)
  assert_every_copy_float16(model.weights + model.optimizer.variables, ref.weights + ref.optimizer.variables, noise)
  np.testing.assert_allclose(history, ref_history, atol=2 * noise)
  assert model.optimizer.dynamic_scale.numpy() == ref.optimizer.dynamic_scale.numpy()
  assert model.optimizer.iterations.numpy() == ref.optimizer.iterations.numpy() == 3 + 5
