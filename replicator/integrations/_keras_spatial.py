"""Keras's convolution layers in a local-view step over images split into tiles: halos, global statistics.

In the local view each replica holds its tile of every image (its rows and columns of ``[batch, height, width,
channels]``, split over mesh axes) and runs the model on it. A convolution at a tile's edge needs its
neighbours' rows, BatchNormalization the statistics of the whole image, a global pooling the whole image's mean.
Inside ``repl.spatial_parallel(*axes)`` (entered in the step; ``axes[i]``: the mesh axis splitting spatial
dimension ``i + 1``, or None), while the step is traced:

* ``Conv1D``, ``Conv2D``, ``Conv3D`` (Keras's ``BaseConv.convolution_op``): each split dimension's tile is
  extended by the rows its windows need of its neighbours (``repl.halo_exchange``: two point-to-point
  permutes, zeros at the image's edges, which is ``"same"``'s padding), the dimensions not split padded with
  zeros as ``"same"`` pads them, then convolved ``"valid"``: each tile gets its rows of the whole image's
  convolution, for any kernel, stride and dilation whose stride divides the tile (``"valid"`` padding: windows
  that do not cross tiles, a kernel no larger than its stride);
* pooling (``MaxPooling*``, ``AveragePooling*``) runs on the tile where its windows do not cross tiles (the
  stride divides the tile and the pool is no larger than the stride: a U-Net's and a ResNet's);
* ``GlobalAveragePooling*`` and ``GlobalMaxPooling*``: the tiles' results combined over the split axes (a mean:
  the tiles are equal; a maximum);
* ``BatchNormalization`` in training: its statistics over every tile and the Replicator's batch axes (two
  all-reduces), so each tile is normalized as the whole batch of images is on one device;
* ``UpSampling*`` with ``"nearest"`` runs on the tile; layers that would compute across tiles and are not above
  (transposed, separable and depthwise convolutions, bilinear upsampling, padding, cropping, ``Flatten``) are a
  named ``UnsupportedError`` rather than a tile's wrong answer.

Other ops over the spatial dimensions (a hand-written ``tf.nn.conv2d``, a ``Reshape``) compute on the tile; the
global view (``input_layouts=``) splits any step by its rules instead. Channels-last only.

Private Keras API, in this module only (Keras 3.15.1; tests/test_keras_spatial.py fails if it changes): the base
classes ``keras.src.layers.convolutional.base_conv.BaseConv`` (its ``convolution_op``, and its ``call``, which
``Conv1D`` overrides to pad causally: inside the context ``Conv1D`` runs ``BaseConv.call``), ``base_pooling.BasePooling``
and ``base_global_pooling.BaseGlobalPooling`` (their ``call``), and the attributes named.
"""

from __future__ import annotations

import contextlib
import functools

import keras
import tensorflow as tf
from keras.src.layers.convolutional import base_conv
from keras.src.layers.pooling import base_global_pooling
from keras.src.layers.pooling import base_pooling

from replicator.core import _context
from replicator.core import _errors
from replicator.integrations import _batch_norm

TILE = ("repl.spatial_parallel at {location}: {layer} ({kind}) over a tile of {tile} along dimension {dim} (split "
        "over {axis!r}): {why}. Fix: {fix}")
REFUSED = ("repl.spatial_parallel at {location}: {layer} would compute across tiles of the split dimensions {dims}, "
           "which this context does not do for {kind}. Fix: {fix}")
FIXES = {
    "transpose": "upsample with UpSampling (nearest) and a Conv, or split the images in the global view "
                 "(input_layouts=).",
    "separable": "use a Conv (or split the images in the global view, input_layouts=).",
    "bilinear": "use interpolation='nearest', or split the images in the global view (input_layouts=).",
    "reshaping": "pad or crop the images before the step, or split them in the global view (input_layouts=).",
    "flatten": "pool the whole image first (GlobalAveragePooling2D), or split the images in the global view.",
}


def _split_dims(layer, inputs, dims, location: str) -> dict[int, tuple]:
  """``{dimension: axes}`` of ``inputs``'s split spatial dimensions (channels last, checked)."""
  if getattr(layer, "data_format", "channels_last") != "channels_last":
    raise _errors.UnsupportedError(f"repl.spatial_parallel at {location}: {layer.name} has data_format="
                                   f"{layer.data_format!r}. Fix: channels_last (Keras's default).")
  return {d: axes for d, axes in dims.items() if d < inputs.shape.rank - 1}


def _ours(replicator) -> bool:
  """Whether a step of ``replicator`` is being traced (the context's layers change only there)."""
  ctx = _context.current_context()
  return ctx is not None and ctx.replicator is replicator


def _same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
  """TensorFlow's ``"same"`` zero padding (before, after) of a dimension of ``size``."""
  out = -(-size // stride)
  total = max((out - 1) * stride + kernel - size, 0)
  return total // 2, total - total // 2


def _conv(original, replicator, dims, location):
  def convolution_op(self, inputs, kernel):
    if not _ours(replicator):
      return original(self, inputs, kernel)
    inputs = tf.convert_to_tensor(inputs)
    split = _split_dims(self, inputs, dims, location)
    if not split:
      return original(self, inputs, kernel)
    padding = [[0, 0] for _ in range(inputs.shape.rank)]
    for d in range(1, inputs.shape.rank - 1):
      k = (self.kernel_size[d - 1] - 1) * self.dilation_rate[d - 1] + 1  # (the window, dilated)
      s, tile = self.strides[d - 1], inputs.shape[d]
      if d not in split:
        if self.padding == "same":  # (as "same" pads it: a stride of 1 pads the same at any size)
          if tile is None and s != 1:
            raise _errors.UnsupportedError(
                f"repl.spatial_parallel at {location}: {self.name} pads dimension {d} (not split, of a size known "
                f"only at run time) 'same' at stride {s}. Fix: give that dimension a static size.")
          padding[d] = list(_same_padding(tile if tile is not None else k, k, s))
        continue
      why = None
      if self.padding not in ("same", "valid"):
        why = f"its padding {self.padding!r} pads each tile where only the image's edge is padded"
      elif tile is None or tile % s:
        why = f"its stride {s} does not divide the tile"
      elif self.padding == "valid" and k > s:
        why = f"a 'valid' window of {k} at stride {s} crosses tiles (the tiles' outputs would not be the image's)"
      if why:
        raise _errors.UnsupportedError(TILE.format(
            location=location, layer=self.name, kind=type(self).__name__, tile=tile, dim=d, axis=split[d], why=why,
            fix="padding 'same' or 'valid', each tile a multiple of the stride (fewer devices along that axis, or a "
                "larger image), and a 'valid' window no larger than its stride."))
      if self.padding == "same":
        inputs = replicator.halo_exchange(inputs, axis=split[d], dim=d, width=_same_padding(tile, k, s))
    if any(p != [0, 0] for p in padding):
      inputs = tf.pad(inputs, padding)
    return keras.ops.conv(inputs, kernel, strides=list(self.strides), padding="valid",
                          dilation_rate=self.dilation_rate, data_format="channels_last")

  return convolution_op


def _conv1d(original, replicator, dims, location):
  def call(self, inputs):  # (Keras's Conv1D calls ops.conv itself, for its causal padding: BaseConv's call instead)
    if not _ours(replicator) or self.padding == "causal" and not _split_dims(self, tf.convert_to_tensor(inputs),
                                                                             dims, location):
      return original(self, inputs)
    return base_conv.BaseConv.call(self, inputs)

  return call


def _pooling(original, replicator, dims, location):
  def call(self, inputs):
    if not _ours(replicator):
      return original(self, inputs)
    inputs = tf.convert_to_tensor(inputs)
    for d, axis in _split_dims(self, inputs, dims, location).items():
      pool, s, tile = self.pool_size[d - 1], self.strides[d - 1], inputs.shape[d]
      if tile is None or tile % s or pool > s:
        raise _errors.UnsupportedError(TILE.format(
            location=location, layer=self.name, kind=type(self).__name__, tile=tile, dim=d, axis=axis,
            why=f"its windows of {pool} at stride {s} do not stay within a tile",
            fix="pool with a stride equal to the pool size, dividing the tile (a U-Net's and a ResNet's pooling)."))
    return original(self, inputs)

  return call


def _global_pooling(original, replicator, dims, location):
  def call(self, inputs, *args, **kwargs):  # (GlobalAveragePooling1D takes a mask)
    if not _ours(replicator):
      return original(self, inputs, *args, **kwargs)
    inputs = tf.convert_to_tensor(inputs)
    split = _split_dims(self, inputs, dims, location)
    if split and (args or kwargs.get("mask") is not None):  # (tiles' means of their unmasked rows: not the image's)
      raise _errors.UnsupportedError(f"repl.spatial_parallel at {location}: {self.name} pools with a mask over "
                                     "split tiles. Fix: pool without a mask, or split the input in the global view.")
    out = original(self, inputs, *args, **kwargs)
    axes = tuple(a for d in sorted(split) for a in _tuple(split[d]))
    if not axes:
      return out
    return replicator.all_reduce(out, "max" if "Max" in type(self).__name__ else "mean", axis=axes)

  return call


def _moments(original, replicator, dims, location):
  def _moments(self, inputs, mask):
    if not _ours(replicator):
      return original(self, inputs, mask)
    inputs = tf.convert_to_tensor(inputs)
    spatial = [a for d in sorted(_split_dims(self, inputs, dims, location)) for a in _tuple(dims[d])]
    axes = tuple(spatial) + tuple(a for a in (replicator.batch_axes or ()) if a not in spatial)
    return _batch_norm.moments(replicator, inputs, mask, list(self._reduction_axes), axes)

  return _moments


def _refused(kind: str, fix: str, location: str, dims):
  def make(original, replicator, _dims, _location):
    def call(self, inputs, *args, **kwargs):
      if not _ours(replicator) or (kind == "UpSampling" and getattr(self, "interpolation", "nearest") == "nearest"):
        return original(self, inputs, *args, **kwargs)
      raise _errors.UnsupportedError(REFUSED.format(location=location, layer=self.name, dims=sorted(dims),
                                                    kind=type(self).__name__, fix=FIXES[fix]))
    return call

  return make


def _tuple(axes) -> tuple:
  return axes if isinstance(axes, tuple) else (axes,)


def _patches(location: str, dims):
  """(class, method, maker) of each Keras layer class the context changes."""
  layers = keras.layers
  refused = [(c, "transpose") for c in (layers.Conv1DTranspose, layers.Conv2DTranspose, layers.Conv3DTranspose)]
  refused += [(c, "separable") for c in (layers.SeparableConv1D, layers.SeparableConv2D, layers.DepthwiseConv1D,
                                         layers.DepthwiseConv2D)]
  refused += [(c, "bilinear") for c in (layers.UpSampling2D, layers.UpSampling3D)]
  refused += [(c, "reshaping") for c in (layers.ZeroPadding1D, layers.ZeroPadding2D, layers.ZeroPadding3D,
                                         layers.Cropping1D, layers.Cropping2D, layers.Cropping3D)]
  refused += [(layers.Flatten, "flatten")]
  found = [(base_conv.BaseConv, "convolution_op", _conv), (keras.layers.Conv1D, "call", _conv1d),
           (base_pooling.BasePooling, "call", _pooling),
           (keras.layers.BatchNormalization, "_moments", _moments)]
  found += [(c, "call", _global_pooling) for c in base_global_pooling.BaseGlobalPooling.__subclasses__()]
  for cls, fix in refused:
    kind = "UpSampling" if fix == "bilinear" else cls.__name__
    found.append((cls, "call", _refused(kind, fix, location, dims)))
  return found


@contextlib.contextmanager
def split(replicator, axes, location: str):
  """While entered, Keras's convolution layers compute over this replica's tiles (see the module)."""
  dims = {i + 1: axis for i, axis in enumerate(axes) if axis is not None}
  if not dims:
    raise _errors.ArgumentError(f"repl.spatial_parallel{tuple(axes)!r} at {location}: expected a mesh axis for at "
                                "least one spatial dimension (the first for the height, the second for the width).")
  replaced = []
  try:
    for cls, method, make in _patches(location, dims):
      own = method in cls.__dict__
      original = getattr(cls, method)
      setattr(cls, method, functools.wraps(original)(make(original, replicator, dims, location)))
      replaced.append((cls, method, own, original))
    yield
  finally:
    for cls, method, own, original in reversed(replaced):
      if own:
        setattr(cls, method, original)
      else:
        delattr(cls, method)

