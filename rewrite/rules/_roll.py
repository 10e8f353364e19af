"""``Roll`` over a split dimension: whole tiles move point to point, a ring's step.

``tf.roll(x, shift, axis)`` along a dimension split into ``n`` tiles of
``tile`` rows, by a multiple ``k * tile`` of the tile: device ``j``'s output
tile is device ``(j - k) mod n``'s input tile, so each device sends its tile
to the one ``k`` further (a ``permute``, one tile's bytes a device) and rolls
nothing locally. This is how a ring is written at global shapes: ring
attention's keys and values (``replicator/core/_blockwise_ring.py``) roll by
one tile a step, and the gradient of a roll, a roll back, carries their
gradients back around the ring. A shift that is not a multiple of the tile
takes the dimension whole (gathered; ``repl.explain`` says why); rolls along
whole dimensions are each device's own.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrite.rules import _base


def _shifts(view) -> dict | None:
  """``{dimension: shift modulo its size}`` of the roll (repeated axes added), or None if not constant."""
  shift, axis = view.const(1), view.const(2)
  shape = view.in_shape(0)
  if shift is None or axis is None or any(n == _base.UNKNOWN for n in shape):
    return None
  out: dict = {}
  for s, a in zip(np.atleast_1d(shift).tolist(), np.atleast_1d(axis).tolist()):
    d = int(a) % len(shape)
    out[d] = (out.get(d, 0) + int(s)) % shape[d]
  return {d: s for d, s in out.items() if s}


@_base.register("Roll")
def roll(view, layouts):
  shifts = _shifts(view)
  if shifts is None:
    return _base.fallback(view, layouts)
  layout, shape = layouts[0], view.in_shape(0)
  need = _base.with_wanted(layout, view.want())
  moved, local, reasons = {}, {}, []
  for d, s in sorted(shifts.items()):
    axes = tuple(need[d])
    pieces = view.shards(axes)
    if pieces > 1 and s % (shape[d] // pieces) == 0:
      moved[d] = (axes, pieces, s // (shape[d] // pieces))
    else:
      if pieces > 1:
        reasons.append(f"a roll by {s} along dimension {d} of {shape[d]} moves part of a tile of {shape[d] // pieces} "
                       f"(only multiples of the tile move whole tiles point to point)")
      local[d] = s
  need = tuple(() if d in local else axes for d, axes in enumerate(need))
  decision = _base.Decision(inputs=[need, None, None], outputs=[need], reasons={0: "; ".join(reasons)} if reasons else {})
  if not moved:
    return decision  # (the copies roll their whole dimensions, by the same shifts)
  itemsize = view.op.inputs[0].dtype.size
  piece = int(np.prod([n // view.shards(axes) for n, axes in zip(shape, need)])) * itemsize

  def lower(r, inputs, comm):
    x = inputs[0]
    for axes, pieces, k in (moved[d] for d in sorted(moved)):
      x = comm.permute(x, [(j, (j + k) % pieces) for j in range(pieces)], axes)
    if local:
      x = tf.roll(x, [local[d] for d in sorted(local)], sorted(local))
    return [x]

  decision.lower = lower
  decision.communicates = tuple(
      ("permute", axes, f"Roll by {k} tile{'s' if k > 1 else ''} along dim {d}: each device's tile to the one {k} "
       "further", piece) for d, (axes, pieces, k) in sorted(moved.items()))
  return decision
