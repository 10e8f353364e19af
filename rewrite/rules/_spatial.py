"""Windows of split spatial dimensions: the input rows each device's output rows read, and the halo exchange.

An op that slides a window along a dimension (a convolution, a pooling) on a
height or width split into tiles computes each device's rows of its output
from a window of its input rows: the device's own tile and a few boundary
rows of its neighbours' (the *halo*), or rows outside the image (the op's
padding). Along one dimension (:class:`Window`): of a global input of
``size`` rows split into ``pieces`` tiles of ``tile = size / pieces`` rows,
device ``p`` reads rows ``[start + p * step, start + p * step + length)``
(for a convolution of kernel ``k``, dilation ``d``, stride ``s`` and ``o``
output rows a device: ``start`` is minus the padding before, ``step = o *
s``, ``length = (o - 1) * s + (k - 1) * d + 1``).

:func:`extend` brings each device its window: every device sends the last
:attr:`Window.before` rows of its tile to its successor and the first
:attr:`Window.after` rows to its predecessor (two point-to-point
``permute``s; ``before`` and ``after`` are the most any device needs, so all
send alike), concatenates what it receives around its tile and slices its
window. Rows outside the input (the first device's before, the last's after)
are the ``fill`` value: zeros for a convolution's padding, the lowest value
for a max pooling's (so that the padding never wins). Split over two
dimensions (rows and columns), the rows are exchanged, then the columns of
the row-extended tile: the corners come along. :func:`retract` is its
transpose, for the gradients: the rows of a window's gradient that belong to
a neighbour's tile are sent back to it and added to its rows.

The rules (``_convolution``) run the op on the window with ``VALID``
padding. A window that would need rows of a device two tiles away (a halo
wider than a tile) is not exchanged: :attr:`Window.problem` says why, and the
rule gathers the dimension whole instead.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Window:
  """Along one dimension of an op's input: the rows each device's piece of the output reads.

  Attributes:
    dim: the input's dimension.
    axes: the mesh axes it is split over (empty: whole; a window then only pads).
    pieces: the number of tiles (1 if whole).
    size: the input's global size along ``dim``.
    start: the first row the first device reads (minus the padding before).
    step: how many rows further each next device's window starts.
    length: the rows of each device's window.
  """

  dim: int
  axes: tuple
  pieces: int
  size: int
  start: int
  step: int
  length: int

  @property
  def tile(self) -> int:
    """The rows of each device's tile."""
    return self.size // self.pieces

  def begin(self, p: int) -> int:
    """The first (global) row device ``p``'s window reads (negative: in the padding)."""
    return self.start + p * self.step

  @property
  def before(self) -> int:
    """Rows each device sends its successor: the most that any device but the first needs before its tile."""
    return max([p * self.tile - self.begin(p) for p in range(1, self.pieces)] + [0])

  @property
  def after(self) -> int:
    """Rows each device sends its predecessor: the most that any device but the last needs after its tile."""
    return max([self.begin(p) + self.length - (p + 1) * self.tile for p in range(self.pieces - 1)] + [0])

  @property
  def problem(self) -> str:
    """Why the window cannot be made from the neighbours' tiles ("" if it can)."""
    if self.before > self.tile or self.after > self.tile:
      return (f"a window needs {max(self.before, self.after)} rows of a neighbour's tile, more than the "
              f"{self.tile} a tile has (a halo wider than a tile)")
    return ""

  def padding(self, p: int) -> tuple[int, int]:
    """Rows of device ``p``'s window outside the input, before and after."""
    lo = self.begin(p)
    return max(0, -lo), max(0, lo + self.length - self.size)


def sliding(dim: int, axes: tuple, pieces: int, size: int, kernel: int, stride: int, dilation: int, padding: str,
            explicit: tuple[int, int] = (0, 0)) -> tuple[Window | None, str]:
  """The window of a sliding op (a convolution or a pooling) along one dimension, or ``(None, why not)``.

  Args:
    dim: the input's dimension.
    axes: the mesh axes it is split over (empty: whole).
    pieces: the number of tiles (1 if whole).
    size: the input's global size along it.
    kernel, stride, dilation: the op's, along it.
    padding: ``"SAME"``, ``"VALID"`` or ``"EXPLICIT"`` (then ``explicit`` gives the rows before and after).

  Returns:
    ``(window, "")``, or ``(None, why)`` if the output's rows do not split
    evenly into ``pieces`` or the window needs more than a neighbour's tile.
  """
  effective = (kernel - 1) * dilation + 1
  if padding == "SAME":
    out = -(-size // stride)
    before = max((out - 1) * stride + effective - size, 0) // 2
  elif padding == "VALID":
    out, before = (size - effective) // stride + 1, 0
  else:
    before, after = explicit
    out = (size + before + after - effective) // stride + 1
  if out <= 0:
    return None, "it has no output rows"
  if out % pieces:
    return None, (f"its {out} output rows do not split into {pieces} equal pieces (input {size}, kernel {kernel}, "
                  f"stride {stride}, {padding} padding)")
  rows = out // pieces
  window = Window(dim, tuple(axes), pieces, size, -before, rows * stride, (rows - 1) * stride + effective)
  return (None, window.problem) if window.problem else (window, "")


def _take(x, dim: int, start: int, size: int):
  if start == 0 and size == x.shape[dim]:
    return x
  begin = [0] * x.shape.rank
  begin[dim] = start
  sizes = [-1] * x.shape.rank
  sizes[dim] = size
  return tf.slice(x, begin, sizes)


def _filled(x, dim: int, rows: int, value):
  shape = x.shape.as_list()
  shape[dim] = rows
  return tf.fill(shape, tf.constant(value, x.dtype))


def _concat(parts, dim):
  return tf.concat(parts, axis=dim) if len(parts) > 1 else parts[0]


def _forward_pairs(n: int) -> list:
  return [(i, i + 1) for i in range(n - 1)]  # each device's last rows to its successor


def _backward_pairs(n: int) -> list:
  return [(i + 1, i) for i in range(n - 1)]  # each device's first rows to its predecessor


def extend(x, windows, positions, comm, fill=0):
  """Device's tile ``x`` extended to its window along each of ``windows``, in order.

  ``positions``: this device's position along each window's axes;
  ``comm``: the expander's collectives (``permute``); ``fill``: the value
  of rows outside the input.
  """
  for window, p in zip(windows, positions):
    x = _extend(x, window, p, comm, fill)
  return x


def _extend(x, w: Window, p: int, comm, fill):
  tile, dim = w.tile, w.dim
  lo = w.begin(p)
  ext_lo, ext_hi = p * tile - w.before, (p + 1) * tile + w.after
  pad_lo, pad_hi = max(0, ext_lo - lo), max(0, lo + w.length - ext_hi)
  parts = []
  if pad_lo:
    parts.append(_filled(x, dim, pad_lo, fill))
  if w.before:
    got = comm.permute(_take(x, dim, tile - w.before, w.before), _forward_pairs(w.pieces), w.axes)
    if p == 0 and fill:  # the first device receives zeros: outside the input, the fill value
      got = got + tf.constant(fill, got.dtype)
    parts.append(got)
  parts.append(x)
  if w.after:
    got = comm.permute(_take(x, dim, 0, w.after), _backward_pairs(w.pieces), w.axes)
    if p == w.pieces - 1 and fill:
      got = got + tf.constant(fill, got.dtype)
    parts.append(got)
  if pad_hi:
    parts.append(_filled(x, dim, pad_hi, fill))
  return _take(_concat(parts, dim), dim, lo - (ext_lo - pad_lo), w.length)


def retract(g, windows, positions, comm):
  """The transpose of :func:`extend`: ``g`` (a gradient with respect to the windows) as one for the tile.

  The windows' rows of a neighbour's tile are sent back to it and added to
  its rows, the dimensions in the reverse order of :func:`extend`'s; rows
  outside the input are dropped.
  """
  for window, p in reversed(list(zip(windows, positions))):
    g = _retract(g, window, p, comm)
  return g


def _retract(g, w: Window, p: int, comm):
  tile, dim = w.tile, w.dim
  lo, hi = w.begin(p), w.begin(p) + w.length
  frame_lo, frame_hi = min(lo, p * tile - w.before), max(hi, (p + 1) * tile + w.after)
  if lo != frame_lo or hi != frame_hi:
    paddings = [[0, 0]] * g.shape.rank
    paddings[dim] = [lo - frame_lo, frame_hi - hi]
    g = tf.pad(g, paddings)
  own = _take(g, dim, p * tile - frame_lo, tile)
  if w.before:  # my rows of the predecessor's tile: back to it, added to its last rows
    got = comm.permute(_take(g, dim, p * tile - w.before - frame_lo, w.before), _backward_pairs(w.pieces), w.axes)
    own = own + _placed(got, dim, tile - w.before, tile)
  if w.after:  # my rows of the successor's tile: back to it, added to its first rows
    got = comm.permute(_take(g, dim, (p + 1) * tile - frame_lo, w.after), _forward_pairs(w.pieces), w.axes)
    own = own + _placed(got, dim, 0, tile)
  return own


def _placed(x, dim: int, at: int, size: int):
  """``x`` at rows ``[at, at + rows)`` of ``size`` rows along ``dim``, zeros elsewhere."""
  rows = x.shape[dim]
  if at == 0 and rows == size:
    return x
  paddings = [[0, 0]] * x.shape.rank
  paddings[dim] = [at, size - at - rows]
  return tf.pad(x, paddings)


def exchanges(windows, shape, itemsize: int, why: str) -> tuple:
  """``Decision.communicates`` of :func:`extend` on a tile of local ``shape``: its permutes, with their bytes."""
  shape, out = list(shape), []
  for w in windows:
    for rows, side in ((w.before, "before"), (w.after, "after")):
      if rows:
        sent = shape[:w.dim] + [rows] + shape[w.dim + 1:]
        out.append(("permute", w.axes, f"{why}: halo, {rows} {side} the tile along dim {w.dim}",
                    math.prod(sent) * itemsize))
    shape[w.dim] = w.length
  return tuple(out)



def returns(windows, shape, itemsize: int, why: str) -> tuple:
  """``Decision.communicates`` of :func:`retract` of a gradient of local ``shape`` (the windows')."""
  shape, out = list(shape), []
  for w in reversed(list(windows)):
    for rows, side in ((w.before, "before"), (w.after, "after")):
      if rows:
        sent = shape[:w.dim] + [rows] + shape[w.dim + 1:]
        out.append(("permute", w.axes, f"{why}: the halo's gradient, {rows} {side} the tile along dim {w.dim}, "
                    "sent back", math.prod(sent) * itemsize))
    shape[w.dim] = w.tile
  return tuple(out)


def counts(windows, positions, kernel, stride, rank: int) -> np.ndarray:
  """How many input rows (not padding) each output position's pooling window covers on a device: ``[1, ..., 1]``-shaped.

  ``kernel``, ``stride``: per window, the pooling's along its dimension
  (undilated). An average pooling with ``SAME`` padding divides by it.
  """
  total = np.ones([1] * rank, np.float64)
  for w, p, k, s in zip(windows, positions, kernel, stride):
    out = (w.length - k) // s + 1
    first = w.begin(p) + s * np.arange(out)
    rows = first[:, None] + np.arange(k)[None, :]
    along = ((rows >= 0) & (rows < w.size)).sum(axis=1)
    dims = [1] * rank
    dims[w.dim] = out
    total = total * along.reshape(dims)
  return total
