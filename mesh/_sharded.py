"""Sharded values: a global tensor held as per-device pieces, and conversions.

:func:`shard` splits a global tensor by a layout, :func:`pack` wraps pieces
that are already on their devices, :func:`unpack` returns the pieces and
:func:`relayout` moves a value to another layout (or another mesh). A
:class:`ShardedTensor` converts to its global tensor wherever a tensor is
expected.

Examples:
  >>> import mesh
  >>> m = mesh.Mesh({"x": 2}, devices=["cpu:0", "cpu:1"])
  >>> value = mesh.shard(tf.reshape(tf.range(6.0), [2, 3]), mesh.Layout(("x", None), m))
  >>> [p.numpy().tolist() for p in mesh.unpack(value)]
  [[[0.0, 1.0, 2.0]], [[3.0, 4.0, 5.0]]]
  >>> mesh.relayout(value, mesh.Layout((None, None), m)).numpy().tolist()
  [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from mesh import _errors
from mesh._layout import Layout

PIECE_MISMATCH = (
    "pack() got a piece of shape {found} for device {device} ({name}), but layout {layout} "
    "puts pieces of shape {expected} there (global shape {global_shape}). Fix: pass, in mesh "
    "device order, each device's piece of the global tensor."
)


def global_shape(piece_shape: Sequence[int], layout: Layout) -> list[int]:
  """The global shape of a tensor whose pieces under ``layout`` have ``piece_shape``."""
  return [s * layout.num_shards(d) for d, s in enumerate(piece_shape)]


def split(value: tf.Tensor, layout: Layout) -> list[tf.Tensor]:
  """The pieces of global ``value``, one per mesh device (computed where ``value`` lives)."""
  value = tf.convert_to_tensor(value)
  shape = value.shape.as_list()
  layout.check(shape, what="the tensor")
  pieces: dict[tuple[int, ...], tf.Tensor] = {}
  result = []
  for device in range(layout.mesh.size):
    index = layout.shard_index(device)
    if index not in pieces:
      begin, size = layout.shard_slices(device, shape)
      pieces[index] = value if layout.is_fully_replicated else tf.slice(value, begin, size)
    result.append(pieces[index])
  return result


def assemble(pieces: Sequence[tf.Tensor], layout: Layout) -> tf.Tensor:
  """The global tensor from per-device ``pieces`` (the first copy of each piece is used)."""
  if len(pieces) != layout.mesh.size:
    raise _errors.LayoutError(
        f"assemble() needs one piece per mesh device ({layout.mesh.size}), found {len(pieces)}.")
  by_index: dict[tuple[int, ...], tf.Tensor] = {}
  for device, piece in enumerate(pieces):
    by_index.setdefault(layout.shard_index(device), piece)

  def build(dim: int, prefix: tuple[int, ...]) -> tf.Tensor:
    if dim == layout.rank:
      return by_index[prefix]
    parts = [build(dim + 1, prefix + (k,)) for k in range(layout.num_shards(dim))]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=dim)

  return build(0, ())


class ShardedTensor:
  """A global tensor stored as one piece per mesh device.

  Made by :func:`shard`, :func:`pack` or :func:`relayout`. ``pieces[i]`` lives
  on ``layout.mesh.devices[i]``. Converts to the global tensor wherever a
  tensor is expected (``tf.convert_to_tensor``, ``np.asarray``, ``.numpy()``).

  Attributes:
    layout: how the tensor is split.
    pieces: the per-device pieces, in mesh device order.
  """

  def __init__(self, pieces: Sequence[tf.Tensor], layout: Layout):
    self.layout = layout
    self.pieces = tuple(pieces)

  @property
  def shape(self) -> tf.TensorShape:
    """The global shape."""
    return tf.TensorShape(global_shape(self.pieces[0].shape.as_list(), self.layout))

  @property
  def dtype(self) -> tf.DType:
    return self.pieces[0].dtype

  def global_value(self) -> tf.Tensor:
    """The global tensor, assembled on the first mesh device."""
    with tf.device(self.layout.mesh.devices[0]):
      return assemble(self.pieces, self.layout)

  def numpy(self) -> np.ndarray:
    return self.global_value().numpy()

  def __array__(self, dtype=None, copy=None):  # NumPy 2's protocol
    if copy is False:
      raise ValueError("np.array(ShardedTensor, copy=False): its value is read into a new array, so it cannot be "
                       "given without a copy. Fix: np.asarray(x) or np.array(x).")
    return np.asarray(self.numpy(), dtype=dtype)

  def __repr__(self) -> str:
    return (f"ShardedTensor(shape={self.shape}, dtype={self.dtype.name}, "
            f"layout={self.layout!r})")


tf.register_tensor_conversion_function(
    ShardedTensor, lambda v, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(v.global_value(), dtype))


def shard(value, layout: Layout) -> ShardedTensor:
  """Splits the global ``value`` by ``layout``; each piece is copied to its device."""
  value = tf.convert_to_tensor(value)
  pieces = []
  for device, piece in zip(layout.mesh.devices, split(value, layout)):
    with tf.device(device):
      pieces.append(tf.identity(piece))
  return ShardedTensor(pieces, layout)


def pack(pieces: Sequence, layout: Layout) -> ShardedTensor:
  """Wraps per-device ``pieces`` (mesh device order) as one sharded value.

  Devices along replicated axes must hold identical copies; the first copy
  of each piece is the one :func:`unpack` of a relayout reads. Each piece is
  placed on its device.

  Raises:
    LayoutError: the wrong number of pieces, or a piece of the wrong shape.
  """
  if len(pieces) != layout.mesh.size:
    raise _errors.LayoutError(
        f"pack() needs one piece per mesh device: the mesh {layout.mesh.shape} has "
        f"{layout.mesh.size} devices, found {len(pieces)} pieces.")
  placed = []
  for device, piece in zip(layout.mesh.devices, pieces):
    with tf.device(device):
      placed.append(tf.identity(tf.convert_to_tensor(piece)))
  full = global_shape(placed[0].shape.as_list(), layout)
  layout.check(full, what="the packed tensor")
  expected = layout.shard_shape(full)
  for i, piece in enumerate(placed):
    if piece.shape.as_list() != expected:
      raise _errors.LayoutError(PIECE_MISMATCH.format(
          found=piece.shape.as_list(), device=i, name=layout.mesh.devices[i], layout=layout,
          expected=expected, global_shape=full))
  return ShardedTensor(placed, layout)


def _pieces_and_layout(value) -> tuple[tuple, Layout]:
  if isinstance(value, ShardedTensor):
    return value.pieces, value.layout
  layout = getattr(value, "layout", None)
  components = getattr(value, "components", None)
  if isinstance(layout, Layout) and components is not None:  # a sharded variable
    return tuple(c.read_value() for c in components), layout
  inner = getattr(value, "value", None)  # a Keras 3 variable: the backend variable it wraps (a method elsewhere)
  if inner is not None and not callable(inner) and hasattr(inner, "components"):
    return _pieces_and_layout(inner)
  raise _errors.ArgumentTypeError(
      f"Expected a mesh.ShardedTensor or a sharded variable (with `layout` and `components`), "
      f"found {type(value).__name__}. Fix: make one with mesh.shard(value, layout) or mesh.pack(pieces, layout).")


def unpack(value) -> tuple[tf.Tensor, ...]:
  """The per-device pieces of a sharded value or sharded variable, in mesh device order."""
  return _pieces_and_layout(value)[0]


def relayout(value, layout: Layout) -> ShardedTensor:
  """``value`` (sharded, a sharded variable, or a global tensor) split by ``layout`` instead.

  The new layout may be on another mesh. Pieces are moved through the global
  value, assembled on the source mesh's first device.
  """
  if isinstance(value, ShardedTensor) or hasattr(value, "components"):
    pieces, old = _pieces_and_layout(value)
    if old == layout:
      return ShardedTensor(pieces, layout)
    with tf.device(old.mesh.devices[0]):
      value = assemble(pieces, old)
  return shard(value, layout)
