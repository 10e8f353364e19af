"""The global view on a Keras 3 conv net (Conv2D, BatchNormalization, pooling, depthwise): equal to one device.

Batch only, and channels over "model" (a column-split convolution, its batch
normalisation's parameters and statistics split alike, then a row-split
convolution whose partial sums are all-reduced), on meshes 1x4, 2x2, 4x1 and
2x4; CI runs representative cases, ``--full-grid`` all of them.
"""

import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import global_step_of
from conftest import keras_step
from conftest import mesh_sweep

import mesh
import replicator

BATCH, STEPS = 8, 3
LAYOUTS = {
    "batch": {},
    "channels": {r"conv1/kernel$": (None, None, None, "model"), r"bn1/(gamma|beta|moving_mean|moving_variance)$": ("model",),
                 r"conv2/kernel$": (None, None, "model", None), r"dw/kernel$": (None, None, "model", None),
                 r"dw/bias$": ("model",), r"conv2/bias$": ("model",)},
}
# Every 8-device (2x4) case runs in CI too (about 2 s each since issue 40).
REPRESENTATIVE = {((2, 2), "batch"), ((2, 2), "channels"), ((4, 1), "batch"), ((2, 4), "channels"), ((2, 4), "batch")}


def make_convnet():
  keras.utils.set_random_seed(1)
  return keras.Sequential([
      keras.Input((12, 12, 3)),
      keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv1"),
      keras.layers.BatchNormalization(name="bn1"), keras.layers.ReLU(), keras.layers.MaxPooling2D(2),
      keras.layers.Conv2D(16, 3, activation="relu", name="conv2"),
      keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="dw"),
      keras.layers.AveragePooling2D(2), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10, name="head")])


def train(repl):
  with repl.context() if repl else contextlib.nullcontext():
    model = make_convnet()
    opt = keras.optimizers.Adam(1e-2)
  step_fn = keras_step(model, opt)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, 12, 12, 3)).astype("float32")
  y = rng.integers(0, 10, size=BATCH * STEPS).astype("int32")
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
  if repl is None:
    step = tf.function(step_fn)
    return model, opt, [float(step(batch)) for batch in data], step_fn
  return model, opt, [float(repl.run(step_fn, data)) for _ in range(STEPS)], step_fn


@pytest.fixture(scope="module")
def one_device():
  return train(None)


@pytest.mark.parametrize("shape,layout", list(mesh_sweep(LAYOUTS, REPRESENTATIVE)))
def test_convnet_equals_one_device(shape, layout, one_device):
  m = mesh.Mesh({"batch": shape[0], "model": shape[1]}, devices=cpus(shape[0] * shape[1]))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(LAYOUTS[layout]) if LAYOUTS[layout] else None,
                               batch_axes=("batch",), view="global")
  model, opt, losses, step_fn = train(repl)  # a fallback would warn: warnings are errors in the tests
  one_model, one_opt, one_losses, _ = one_device
  np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-5)
  mine, theirs = model.variables + opt.variables, one_model.variables + one_opt.variables
  assert [re.sub(r"_\d+", "", v.path) for v in mine] == [re.sub(r"_\d+", "", v.path) for v in theirs]
  assert_every_copy(mine, theirs)
  if layout == "channels" and shape[1] > 1:
    step = global_step_of(repl)
    calls = {c.members[0].call.split()[0] for c in step.plan.collectives if c.axes == ("model",)}
    assert "Conv2D" in calls  # the row-split conv2's partial sums
    kernel = model.get_layer("conv1").kernel.value
    assert [c.shape.as_list() for c in kernel.components] == [[3, 3, 3, 8 // shape[1]]] * m.size
  del step_fn


def test_model_fit_with_channels_split_equals_one_device():
  # Keras's own steps partitioned: moving statistics split with their channels, metrics' state, Adam slots.
  # The sweep's data. With rng(1), one of conv1's first gradients is 1.3e-6, 4,500x below the median, and Adam's
  # first update there, lr * g / (|g| + 1e-7), turns the ~2e-8 a different summation order (partial sums added
  # across devices) makes into 1.1e-5 on that weight: measured, the rest within 1e-5.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, 12, 12, 3)).astype("float32")
  y = rng.integers(0, 10, size=BATCH * STEPS).astype("int32")

  def fitted(repl):
    with repl.context() if repl else contextlib.nullcontext():
      model = make_convnet()
      model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model, history.history, model.evaluate(x, y, batch_size=BATCH, verbose=0)

  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(LAYOUTS["channels"]), batch_axes=("batch",),
                               view="global")
  (model, history, evaluated), (one_model, one_history, one_evaluated) = fitted(repl), fitted(None)
  for key, want in one_history.items():
    np.testing.assert_allclose(history[key], want, rtol=0, atol=1e-5, err_msg=key)
  np.testing.assert_allclose(evaluated, one_evaluated, rtol=0, atol=1e-5)
  assert_every_copy(model.variables + model.optimizer.variables,
                    one_model.variables + one_model.optimizer.variables)
