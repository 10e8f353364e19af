"""``repl.spatial_parallel`` (``replicator/integrations/_keras_spatial.py``): Keras conv nets on image tiles in a
local-view step, against one device running the whole images."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus

import mesh
import replicator

SIDE, ROWS, STEPS = 16, 4, 3


def _unet():
  """A small U-Net: same-padded, strided and dilated convolutions, BatchNormalization, pooling, nearest upsampling
  and skip connections; 16 x 16 x 3 images to 16 x 16 x 2."""
  keras.utils.set_random_seed(0)
  layers = keras.layers
  images = keras.Input((None, None, 3))  # (a tile of any size)
  a = layers.ReLU()(layers.BatchNormalization(momentum=0.8)(layers.Conv2D(8, 3, padding="same", use_bias=False)(images)))
  b = layers.MaxPooling2D(2)(a)
  b = layers.Conv2D(8, 3, padding="same", dilation_rate=2, activation="relu")(b)
  c = layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(b)
  b = layers.Conv2D(8, 5, padding="same", activation="relu")(layers.Concatenate()([b, layers.UpSampling2D(2)(c)]))
  out = layers.Conv2D(2, 1)(layers.Concatenate()([a, layers.UpSampling2D(2)(b)]))
  return keras.Model(images, out)


def _resnet():
  """A small classifier: a strided convolution, BatchNormalization, a residual block, global average pooling."""
  keras.utils.set_random_seed(1)
  layers = keras.layers
  images = keras.Input((None, None, 3))  # (a tile of any size)
  h = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(images)))
  h = layers.Add()([h, layers.Conv2D(8, 3, padding="same", activation="relu")(h)])
  return keras.Model(images, layers.Dense(5)(layers.GlobalAveragePooling2D()(h)))


def _data(kind):
  rng = np.random.default_rng(2)
  x = rng.normal(size=(ROWS * STEPS, SIDE, SIDE, 3)).astype("float32") + 0.3
  y = (rng.normal(size=(ROWS * STEPS, SIDE, SIDE, 2)).astype("float32") if kind == "unet"
       else rng.integers(0, 5, size=(ROWS * STEPS,)).astype("int32"))
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(ROWS, drop_remainder=True)


def _loss(kind, y, out):
  if kind == "unet":
    return tf.reduce_mean(tf.square(out - y))
  return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, out, from_logits=True))


def _one_device(kind):
  model = _unet() if kind == "unet" else _resnet()
  optimizer = keras.optimizers.SGD(0.05, momentum=0.9)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = _loss(kind, y, model(x, training=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  return model, optimizer, [float(step(x, y)) for x, y in _data(kind)]


def _tiled(kind, shape, batch_axes=()):
  devices = cpus(int(np.prod(list(shape.values()))))
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=devices), batch_axes=batch_axes)
  with repl.context():
    model = _unet() if kind == "unet" else _resnet()
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.05, momentum=0.9))
  rows, cols = shape.get("rows", 1), shape.get("cols", 1)

  def tile(t, r, c):
    return t[:, r * SIDE // rows:(r + 1) * SIDE // rows, c * SIDE // cols:(c + 1) * SIDE // cols]

  def step(batch):
    x, y = batch
    r = int(tf.get_static_value(repl.axis_index("rows"))) if "rows" in shape else 0
    c = int(tf.get_static_value(repl.axis_index("cols"))) if "cols" in shape else 0
    with tf.GradientTape() as tape:
      with repl.spatial_parallel("rows" if "rows" in shape else None, "cols" if "cols" in shape else None):
        out = model(tile(x, r, c), training=True)
      loss = _loss(kind, tile(y, r, c) if kind == "unet" else y, out)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return repl.all_reduce(loss, "mean")

  data = _data(kind)
  return repl, model, optimizer, step, [float(repl.run(step, data)[0]) for _ in range(STEPS)]


@pytest.mark.parametrize("kind,shape,batch_axes", [
    ("unet", {"rows": 2, "cols": 2}, ()), ("unet", {"rows": 4}, ()), ("resnet", {"rows": 2, "cols": 2}, ()),
    pytest.param("unet", {"batch": 2, "rows": 2}, ("batch",), marks=pytest.mark.full_grid),
    pytest.param("resnet", {"cols": 4}, (), marks=pytest.mark.full_grid)])
def test_a_conv_net_on_image_tiles_in_the_local_view_trains_as_on_one_device(kind, shape, batch_axes):
  # Each replica runs the model on its tile of every image: the convolutions' halos from its neighbours, the
  # statistics of BatchNormalization and global pooling over the tiles. 3 steps of SGD with momentum: every
  # weight, slot and moving statistic on every device within 1e-6 of one device's (measured: weights 1.2e-7 at
  # most, slots 2.6e-8, losses 2.4e-7).
  one, one_opt, expected = _one_device(kind)
  repl, model, optimizer, step, losses = _tiled(kind, shape, batch_axes)
  np.testing.assert_allclose(losses, expected, atol=1e-6)
  assert_every_copy(model.weights, one.weights, atol=1e-6)
  assert_every_copy(optimizer.variables, one_opt.variables, atol=1e-6)
  # Only halos travel: each a tile's boundary rows or columns (at most 2: the dilated and the 5 x 5 kernels'),
  # never a tile.
  permutes = [c for c in repl.explain(step, _data(kind)).collectives if c.kind == "permute"]
  assert permutes and all(min(c.shape[1], c.shape[2]) <= 2 for c in permutes), [c.shape for c in permutes]


def test_a_conv1d_net_on_pieces_of_its_sequences_equals_one_device():
  # Conv1D (which Keras computes in its own call) with "same" padding, a dilation and a stride, BatchNormalization,
  # global average pooling, on 4 pieces of each sequence: the output and every gradient as one device's (measured:
  # output 3.0e-8, gradients 1.8e-7; bound 1e-6).
  keras.utils.set_random_seed(3)
  x = np.random.default_rng(4).normal(size=(2, 32, 3)).astype("float32")

  def net():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((None, 3))
    h = keras.layers.Conv1D(4, 3, padding="same", dilation_rate=2, use_bias=False)(inputs)
    h = keras.layers.Conv1D(4, 3, strides=2, padding="same", activation="tanh")(keras.layers.BatchNormalization()(h))
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h)))

  one = net()
  with tf.GradientTape() as tape:
    expected = one(x, training=True)
  expected_grads = tape.gradient(expected, one.trainable_variables)
  repl = replicator.Replicator(mesh=mesh.Mesh({"rows": 4}, devices=cpus(4)), batch_axes=())
  with repl.context():
    ours = net()

  def step():
    r = int(tf.get_static_value(repl.axis_index("rows")))
    with tf.GradientTape() as tape:
      with repl.spatial_parallel("rows"):
        out = ours(x[:, 8 * r:8 * r + 8], training=True)
    return out, repl.all_reduce(tape.gradient(out, ours.trainable_variables), "mean")

  out, grads = repl.run(step)
  np.testing.assert_allclose(out[0].numpy(), expected.numpy(), atol=1e-6)
  for got, want in zip(grads, expected_grads):
    np.testing.assert_allclose(got[0].numpy(), want.numpy(), atol=1e-6)


def test_without_the_context_the_tiles_are_another_model():
  one, _, expected = _one_device("unet")
  _, _, _, _, losses = _tiled_without_context()
  assert abs(losses[0] - expected[0]) > 1e-3
  del one


def _tiled_without_context():
  repl = replicator.Replicator(mesh=mesh.Mesh({"rows": 2}, devices=cpus(2)), batch_axes=())
  with repl.context():
    model = _unet()

  def step(batch):
    x, y = batch
    r = int(tf.get_static_value(repl.axis_index("rows")))
    out = model(x[:, r * 8:(r + 1) * 8], training=True)
    return repl.all_reduce(_loss("unet", y[:, r * 8:(r + 1) * 8], out), "mean")

  data = _data("unet")
  return repl, model, None, step, [float(repl.run(step, data)[0])]


def test_what_would_cross_tiles_is_named():
  x = tf.ones([1, 6, 8, 2])

  def run(layer, inputs=x):
    repl = replicator.Replicator(mesh=mesh.Mesh({"rows": 2}, devices=cpus(2)), batch_axes=())
    with repl.context():
      layer.build(inputs.shape)

    def step():
      with repl.spatial_parallel("rows"):
        return layer(inputs)
    return repl.run(step)

  with pytest.raises(replicator.UnsupportedError, match=r"conv2d_transpose would compute across tiles of the split "
                                                          r"dimensions \[1\].*Conv2DTranspose. Fix: upsample"):
    run(keras.layers.Conv2DTranspose(2, 3, padding="same"))
  with pytest.raises(replicator.UnsupportedError, match=r"over a tile of 6 along dimension 1 \(split over \('rows',\)\): "
                                                          r"its stride 4 does not divide the tile"):
    run(keras.layers.Conv2D(2, 3, strides=4, padding="same"))
  with pytest.raises(replicator.UnsupportedError, match=r"a 'valid' window of 3 at stride 1 crosses tiles"):
    run(keras.layers.Conv2D(2, 3))
  with pytest.raises(replicator.UnsupportedError, match=r"its padding 'causal' pads each tile where only the image"):
    run(keras.layers.Conv1D(2, 3, padding="causal"), tf.ones([1, 6, 2]))
  with pytest.raises(replicator.UnsupportedError, match=r"windows of 3 at stride 2 do not stay within a tile"):
    run(keras.layers.MaxPooling2D(3, strides=2, padding="same"))
  with pytest.raises(replicator.UnsupportedError, match=r"flatten would compute across tiles.*GlobalAveragePooling2D"):
    run(keras.layers.Flatten())
  repl = replicator.Replicator(mesh=mesh.Mesh({"rows": 2}, devices=cpus(2)), batch_axes=())
  with pytest.raises(replicator.ArgumentError, match=r"expected a mesh axis for at least one spatial dimension"):
    repl.run(lambda: repl.spatial_parallel(None, None).__enter__())
