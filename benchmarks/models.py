"""The benchmark models: the same Keras 3 model, data and loss for every configuration.

Each :class:`Model` builds a fresh Keras model (call it inside the
configuration's variable scope), makes one synthetic global batch from a fixed
seed, and computes the per-replica loss (a mean over the local batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Model:
  """One benchmark model.

  Attributes:
    name: short name used in tables and JSON.
    description: what the model is (for the README table).
    global_batch: rows per global batch.
    x_shape: one example's input shape.
    y_shape: one example's target shape (``()``: a class index).
    build: returns a built (weights created) Keras model.
    classes: number of classes for a classification target, 0 for regression.
    vocab: for a token model, the vocabulary size: ``x`` holds token ids
      drawn uniformly from ``[0, vocab)`` (int32); 0: ``x`` is Gaussian.
  """

  name: str
  description: str
  global_batch: int
  x_shape: tuple[int, ...]
  y_shape: tuple[int, ...]
  build: Callable[[], keras.Model]
  classes: int = 0
  vocab: int = 0

  def batch(self, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic global batch ``(x, y)`` (NumPy), the same for every configuration."""
    rng = np.random.default_rng(seed)
    if self.vocab:
      x = rng.integers(0, self.vocab, (self.global_batch,) + self.x_shape).astype(np.int32)
    else:
      x = rng.standard_normal((self.global_batch,) + self.x_shape).astype(np.float32)
    if self.classes:
      y = rng.integers(0, self.classes, (self.global_batch,) + self.y_shape).astype(np.int32)
    else:
      y = rng.standard_normal((self.global_batch,) + self.y_shape).astype(np.float32)
    return x, y

  def loss(self, y, outputs):
    """Mean loss over the (local) batch."""
    if self.classes:
      return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, outputs, from_logits=True))
    return tf.reduce_mean(tf.square(outputs - y))


def _built(model: keras.Model, x_shape) -> keras.Model:
  model.build((None,) + tuple(x_shape))
  return model


def embedding_bag(vocab: int = 50_000) -> keras.Model:
  """A vocab x 128 token embedding, mean-pooled over 32 tokens, then Dense(4): a sparse gradient's cost.

  Keras's ``Embedding`` reads its whole table (``ReadVariableOp``) and gathers
  the rows from that tensor.
  """
  return keras.Sequential([keras.Input((32,), dtype="int32"), keras.layers.Embedding(vocab, 128),
                           keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4)])


class RowGather(keras.layers.Layer):
  """An embedding table read by rows: ``tf.gather`` on the variable (``ResourceGather``), mean-pooled."""

  def __init__(self, vocab: int, width: int = 128, **kwargs):
    super().__init__(**kwargs)
    self.table = self.add_weight(shape=(vocab, width), initializer="uniform", name="table")

  def call(self, tokens):
    return tf.reduce_mean(tf.gather(self.table.value, tokens), axis=1)


def gather_bag(vocab: int = 50_000) -> keras.Model:
  """:func:`embedding_bag` with the table read by rows (:class:`RowGather`)."""
  return keras.Sequential([keras.Input((32,), dtype="int32"), RowGather(vocab), keras.layers.Dense(4)])


def deep_mlp() -> keras.Model:
  layers = [keras.layers.Dense(128, activation="relu") for _ in range(15)] + [keras.layers.Dense(128)]
  return _built(keras.Sequential(layers), (128,))


def wide_mlp() -> keras.Model:
  return _built(keras.Sequential([keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(256)]), (256,))


def small_resnet() -> keras.Model:
  """3 residual blocks (two 3x3 convs each, no BatchNorm): 16 channels at 32x32, then 32 at 16x16 twice."""
  inputs = keras.Input((32, 32, 3))
  h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
  for channels, stride in ((16, 1), (32, 2), (32, 1)):
    shortcut = h
    if stride != 1 or shortcut.shape[-1] != channels:
      shortcut = keras.layers.Conv2D(channels, 1, strides=stride)(h)
    h = keras.layers.Conv2D(channels, 3, strides=stride, padding="same", activation="relu")(h)
    h = keras.layers.Conv2D(channels, 3, padding="same")(h)
    h = keras.layers.Activation("relu")(keras.layers.Add()([h, shortcut]))
  h = keras.layers.GlobalAveragePooling2D()(h)
  return keras.Model(inputs, keras.layers.Dense(10)(h))


def transformer_block() -> keras.Model:
  """One pre-LayerNorm block (4-head self-attention + 512-wide GELU MLP) on 64x128 inputs, mean-pooled to 10 logits."""
  inputs = keras.Input((64, 128))
  h = keras.layers.LayerNormalization()(inputs)
  h = inputs + keras.layers.MultiHeadAttention(num_heads=4, key_dim=32)(h, h)
  m = keras.layers.LayerNormalization()(h)
  m = keras.layers.Dense(128)(keras.layers.Dense(512, activation="gelu")(m))
  h = keras.layers.GlobalAveragePooling1D()(h + m)
  return keras.Model(inputs, keras.layers.Dense(10)(h))


MODELS = (
    Model("mlp_deep", "overhead-bound: 16 Dense(128), ReLU", 64, (128,), (128,), deep_mlp),
    Model("mlp_wide", "compute-bound: MLP 256->4096->256", 512, (256,), (256,), wide_mlp),
    Model("resnet", "3 residual conv blocks (16-32 ch) on 32x32x3, no BN", 64, (32, 32, 3), (), small_resnet, 10),
    Model("transformer", "self-attention (4 heads) + MLP, seq 64, d_model 128", 32, (64, 128), (), transformer_block,
          10),
    Model("embedding", "sparse: Embedding(50000, 128), 32 tokens mean-pooled, Dense(4)", 64, (32,), (), embedding_bag,
          4, vocab=50_000),
)


def by_name(name: str) -> Model:
  for model in MODELS:
    if model.name == name:
      return model
  raise ValueError(f"Unknown model {name!r}; expected one of {[m.name for m in MODELS]}.")
