"""The global view on a Keras 3 conv net (Conv2D, BatchNormalization, pooling, depthwise): equal to one device.

Batch only, and channels over "model" (a column-split convolution, its batch
normalisation's parameters and statistics split alike, then a row-split
convolution whose partial sums are all-reduced), on meshes 1x4, 2x2, 4x1 and
2x4; CI runs representative cases, ``--full-grid`` all of them. Then images
split into tiles (``input_layouts`` over "rows" and "cols"): a residual
U-Net-like model trained as on one device, with halo permutes of the
analytical size and a quarter of the activations saved a device, and a
convolution that cannot keep its tiles gathering them, saying why.
"""

import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import copies_distance
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


# -- images split into tiles (height and width over "rows" and "cols") -------------------------------------------

L = keras.layers
TILED = {"2x2": ({"rows": 2, "cols": 2}, (None, "rows", "cols", None), ()),
         "batch-2x2": ({"batch": 2, "rows": 2, "cols": 2}, ("batch", "rows", "cols", None), ("batch",))}
IMAGE = 16


def make_unet():
  """A small residual U-Net-like classifier: every layer family a tiled image passes through."""
  keras.utils.set_random_seed(1)
  inputs = keras.Input((IMAGE, IMAGE, 3))
  x = L.Conv2D(8, 3, padding="same", use_bias=False, name="stem")(inputs)
  x = L.ReLU()(L.BatchNormalization(name="bn1")(x))
  y = L.Conv2D(8, 3, padding="same", activation="relu", name="res_a")(x)
  y = L.Conv2D(8, 3, padding="same", name="res_b")(y)
  x = L.Add()([x, y])  # the residual
  down = L.MaxPooling2D(2)(x)
  down = L.Conv2D(16, 3, padding="same", use_bias=False, name="down")(down)  # (a bias before a batch norm: its
  down = L.BatchNormalization(name="bn2")(L.ReLU()(down))  # gradient is rounding noise, which Adam would amplify)
  x = L.Concatenate()([x, L.UpSampling2D(2)(down)])  # the U's skip connection
  x = L.Conv2D(8, 1, name="mix")(x)
  x = L.DepthwiseConv2D(3, padding="same", name="dw")(x)
  x = L.AveragePooling2D(2)(x)
  x = L.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, L.Dense(10, name="head")(x))


def train_unet(repl, batch=4):
  with repl.context() if repl else contextlib.nullcontext():
    model = make_unet()
    opt = keras.optimizers.Adam(1e-2)
  step_fn = keras_step(model, opt)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch * STEPS, IMAGE, IMAGE, 3)).astype("float32")
  y = rng.integers(0, 10, size=batch * STEPS).astype("int32")
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
  if repl is None:
    step = tf.function(step_fn)
    return model, opt, [float(step(b)) for b in data], step_fn, data
  return model, opt, [float(repl.run(step_fn, data)) for _ in range(STEPS)], step_fn, data


def tiled(name):
  shape, spec, batch_axes = TILED[name]
  m = mesh.Mesh(shape, devices=cpus(int(np.prod(list(shape.values())))))
  return replicator.Replicator(mesh=m, view="global", batch_axes=batch_axes, input_layouts=spec)


@pytest.fixture(scope="module")
def one_device_unet():
  return train_unet(None)


@pytest.mark.parametrize("name", sorted(TILED))
def test_a_unet_on_tiles_trains_as_on_one_device(name, one_device_unet):
  repl = tiled(name)
  model, opt, losses, step_fn, data = train_unet(repl)  # a fallback would warn: warnings are errors in the tests
  one_model, one_opt, one_losses, _, _ = one_device_unet
  np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-6)
  # Measured: every variable and Adam slot within 5.6e-6 of one device's (down/kernel; the sums over tiles, then
  # over the devices, are in another order, and Adam's first steps divide by the gradients' size).
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables, atol=1e-5)
  assert copies_distance(model.variables + opt.variables, one_model.variables + one_opt.variables) > 0

  report = repl.explain(step_fn, data)
  rows = report.collective_rows
  # The activations stay tiles: no all_gather but of the returned loss (none: it is a scalar, all-reduced), only
  # the halos' permutes, the statistics' and gradients' all-reduces (and the sharded update's broadcasts).
  assert {r.kind for r in rows} <= {"permute", "all_reduce", "broadcast"}, {r.kind for r in rows}
  largest_variable = max(v.bytes_per_device for v in report.variables)
  assert max(r.bytes_per_device for r in rows if r.kind == "all_reduce") <= largest_variable
  # The halos: a 3x3 convolution's 1 row (then 1 column of the row-extended tile) each side, of each image.
  batch = 4 // (2 if TILED[name][2] else 1)
  for layer in ("stem", "res_a", "res_b", "down", "dw"):
    n, h, w, c = model.get_layer(layer).input.shape
    h, w = h // 2, w // 2
    sent = sorted(r.bytes_per_device for r in rows if r.kind == "permute" and r.op_type in (
        "Conv2D", "DepthwiseConv2dNative") and re.search(rf"/{layer}(_\d+)?/", r.op_name))
    assert sent == [1 * w * c * batch * 4] * 2 + [(h + 2) * 1 * c * batch * 4] * 2, (layer, sent)
  # The cost model counts the bytes a permute sends (not the op's output), as the plan does.
  priced = sorted((c.op_name, c.bytes) for c in report.work.collectives if c.kind == "permute")
  assert priced == sorted((r.op_name, r.bytes_per_device) for r in rows if r.kind == "permute")
  assert "Conv2D on tiles: halo, 1 before the tile along dim 1" in str(report)


def test_a_unet_on_tiles_saves_a_quarter_of_its_activations_for_backward():
  # Measured (batch 4, 16x16 images): one device saves 299,628 bytes for the backward pass; each of 2x2 tiles
  # 75,372: a quarter (74,907), plus the few small values every device holds whole (the batch norms' statistics,
  # the pooled features, the logits). The halos are not held: the gradients' windows are made again.
  def saved(repl):
    model, _, _, step_fn, data = train_unet(repl)
    return repl.explain(step_fn, data).memory

  one = saved(replicator.Replicator(mesh=mesh.Mesh({"rows": 1}, devices=cpus(1)), view="global", batch_axes=()))
  tiles = saved(tiled("2x2"))
  (whole,) = [d.saved_bytes for d in one.devices]
  assert len(tiles.devices) == 4
  for device in tiles.devices:
    assert whole / 4 <= device.saved_bytes <= whole / 4 + 1024, (device.saved_bytes, whole)
  inputs = [s.bytes for s in tiles.saved_on() if s.kind == "input"]
  assert inputs == [4 * 8 * 8 * 3 * 4]  # the tile of the images, not the images


@pytest.mark.parametrize("layer,why", [
    (lambda: L.Conv2D(4, 3, padding="valid", name="narrow"), "its 14 output rows do not split into 4 equal pieces"),
    (lambda: L.Conv2D(4, 11, padding="same", name="wide"),
     "a window needs 5 rows of a neighbour's tile, more than the 4 a tile has (a halo wider than a tile)"),
])
def test_a_convolution_that_cannot_keep_its_tiles_gathers_them_and_explain_says_why(layer, why):
  # On 4 strips of 4 rows: 14 output rows do not split into 4; an 11x11 kernel needs 5 rows of each neighbour.
  def train(repl):
    with repl.context() if repl else contextlib.nullcontext():
      keras.utils.set_random_seed(2)
      model = keras.Sequential([keras.Input((IMAGE, IMAGE, 3)), layer(), L.ReLU(), L.GlobalAveragePooling2D(),
                                L.Dense(10)])
      opt = keras.optimizers.SGD(0.1)
    step_fn = keras_step(model, opt)
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensors((rng.normal(size=(2, IMAGE, IMAGE, 3)).astype("float32"),
                                         np.array([1, 7], np.int32)))
    loss = repl.run(step_fn, data) if repl else tf.function(step_fn)(next(iter(data)))
    return model, float(loss), step_fn, data

  m = mesh.Mesh({"rows": 4}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, view="global", batch_axes=(), input_layouts=(None, "rows", None, None))
  model, loss, step_fn, data = train(repl)  # runs, gathered (no fallback: a warning would fail the test)
  one_model, one_loss, _, _ = train(None)
  np.testing.assert_allclose(loss, one_loss, rtol=1e-6)
  assert_every_copy(model.variables, one_model.variables, atol=1e-6)
  gathers = [r for r in repl.explain(step_fn, data).collective_rows if r.kind == "all_gather"]
  assert gathers and all(r.op_type in ("Conv2D", "Conv2DBackpropFilter") and why in r.why for r in gathers)
