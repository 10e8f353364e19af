"""Halo exchange: each device's tile of a split dimension, extended by its neighbours' boundary rows.

A convolution (or pooling) over a height or width split across devices needs,
at each tile's edge, the rows its neighbours hold: ``(k - 1) / 2`` of them on
each side for an odd kernel ``k`` at stride 1 with ``"SAME"`` padding. Each
device sends its first ``before`` rows to its predecessor and its last
``after`` rows to its successor (two point-to-point ``permute``s, never the
whole tile), and concatenates what it receives around its tile. The first
and last devices receive zeros (the zero padding ``"SAME"`` means), unless
``periodic``. Split over two axes (rows and columns), exchanging the rows and
then the columns of the extended tile gives the corners too.
"""

from __future__ import annotations

import tensorflow as tf

from replicator.core import _errors
from replicator.core import _primitives


def _widths(width) -> tuple[int, int]:
  if isinstance(width, int) and not isinstance(width, bool):
    return width, width
  try:
    before, after = width
  except (TypeError, ValueError):
    before = after = None
  if not all(isinstance(w, int) and not isinstance(w, bool) for w in (before, after)):
    raise _errors.ArgumentTypeError(f"repl.halo_exchange(width={width!r}): expected an int or a pair (before, after) "
                                    "of ints, the rows wanted from the predecessor and from the successor.")
  return before, after


def _take(x, dim: int, start: int, size: int):
  begin = [0] * x.shape.rank
  begin[dim] = start
  sizes = [-1] * x.shape.rank
  sizes[dim] = size
  return tf.slice(x, begin, sizes)


def halo_exchange(ctx, x, dim: int, width, axes: tuple[str, ...], periodic: bool, location: str):
  """``x`` with ``before`` rows of its predecessor's tile before it and ``after`` of its successor's after it."""
  before, after = _widths(width)
  x = tf.convert_to_tensor(x)
  if x.shape.rank is None or not -x.shape.rank <= dim < x.shape.rank:
    raise _errors.ArgumentError(f"repl.halo_exchange(dim={dim}) at {location}: x has shape {x.shape}. Fix: pass "
                                "the dimension the tiles split (e.g. 1 for the height of [batch, height, width, "
                                "channels]).")
  dim %= x.shape.rank
  size = x.shape[dim]
  if size is None or before < 0 or after < 0 or max(before, after) > size:
    raise _errors.ArgumentError(
        f"repl.halo_exchange(width={width!r}) at {location}: each side takes at most the {size} rows of a tile "
        f"(dimension {dim} of {x.shape}), and no fewer than 0. Fix: use fewer, or larger tiles (fewer devices).")
  n = ctx.replicator.mesh.axis_size(axes)
  parts = []
  if before:  # my predecessor's last rows: each device sends its last `before` rows to its successor
    ring = [(i, i + 1) for i in range(n - 1)] + ([(n - 1, 0)] if periodic and n > 1 else [])
    tail = _take(x, dim, size - before, before)
    parts.append(_primitives.permute(ctx, tail, ring, axes, location) if ring else tf.zeros_like(tail))
  parts.append(x)
  if after:  # my successor's first rows
    ring = [(i + 1, i) for i in range(n - 1)] + ([(0, n - 1)] if periodic and n > 1 else [])
    head = _take(x, dim, 0, after)
    parts.append(_primitives.permute(ctx, head, ring, axes, location) if ring else tf.zeros_like(head))
  return tf.concat(parts, axis=dim) if len(parts) > 1 else x
