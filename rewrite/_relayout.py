"""How a piece in one layout becomes its piece in another: the collectives a relayout needs, in order.

A dimension whose split changes is gathered (``all_gather``), then the
dimensions the target splits are sliced locally (free). Where the same mesh
axes move from one dimension to another that was whole (tokens split over
the batch axis to be grouped by expert along the same axis, as GShard
dispatches them), one ``all_to_all`` does both: each device sends every other
the chunk of its piece that belongs there, 1/k of the gather's bytes. The
expander (``_expansion``) and the report (``_partition_report``) both follow
these steps.
"""

from __future__ import annotations

import dataclasses

from rewrite import _memory


@dataclasses.dataclass(frozen=True)
class Steps:
  """The collectives of one relayout, in order; the local slice that follows them is free.

  Attributes:
    moved: ``(from_dim, to_dim, axes)`` of each ``all_to_all``: the axes split
      ``from_dim`` before and ``to_dim`` after.
    gathered: ``(dim, axes)`` of each ``all_gather``, after the moves.
  """

  moved: tuple = ()
  gathered: tuple = ()


def steps(have, want, global_shape, axis_size) -> Steps:
  """The steps from layout ``have`` to ``want`` of a tensor of ``global_shape``.

  Args:
    have: the piece's layout (mesh axes per dimension).
    want: the layout wanted.
    global_shape: the tensor's global shape (a move needs the target
      dimension divisible by the axes' size; None: unknown, never moved).
    axis_size: ``axes -> int``, the number of devices along ``axes``.
  """
  current = list(have)
  moved = []
  for d1, (h, w) in enumerate(zip(have, want)):
    if not h or w:
      continue
    for d2, (h2, w2) in enumerate(zip(have, want)):
      n = global_shape[d2] if global_shape is not None and d2 < len(global_shape) else None
      if d2 != d1 and not h2 and tuple(w2) == tuple(h) and not current[d2] and n and n % axis_size(h) == 0:
        moved.append((d1, d2, tuple(h)))
        current[d1], current[d2] = (), tuple(h)
        break
  gathered = tuple((d, tuple(c)) for d, (c, w) in enumerate(zip(current, want)) if c and c != w)
  return Steps(tuple(moved), gathered)


def reuse_key(tensor, target, consumer: str) -> tuple:
  """What a relayout of ``tensor`` to ``target`` for the op ``consumer`` is shared by: its cache key.

  One relayout per tensor and layout serves every consumer after the first, except a variable's read
  relayouted for the backward pass: the backward pass makes its own (an FSDP kernel gathered again for its
  gradient, as PyTorch's FSDP and ZeRO-3 do, instead of the forward pass's gathered kernel held through the
  step; ``rewrite._deferred`` makes it wait for the backward pass). One more collective a step, a layer's
  kernel less held from the forward pass to the backward pass.
  """
  backward = tensor.op.type == "ReadVariableOp" and _memory.is_backward(consumer)
  return (tensor.name, target, backward)
