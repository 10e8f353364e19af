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
from rewrite.rules import _base


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
    if not h or w or isinstance(h, _base.Merged):  # (a merged dimension's pieces are gathered, then put in order)
      continue
    for d2, (h2, w2) in enumerate(zip(have, want)):
      n = global_shape[d2] if global_shape is not None and d2 < len(global_shape) else None
      if (d2 != d1 and not h2 and not isinstance(w2, _base.Merged) and tuple(w2) == tuple(h) and not current[d2]
          and n and n % axis_size(h) == 0):
        moved.append((d1, d2, tuple(h)))
        current[d1], current[d2] = (), tuple(h)
        break
  gathered = tuple((d, _gathered_axes(c, w)) for d, (c, w) in enumerate(zip(current, want))
                   if c and c != w and not refined(c, w))
  return Steps(tuple(moved), gathered)


def refined(have, want) -> bool:
  """Whether a dimension split over ``have`` reaches ``want`` by a local slice: ``want`` splits each of its blocks.

  ``("batch",)`` to ``("batch", "model")``: the devices along ``"model"`` take consecutive parts of their
  ``"batch"`` block, which each holds.
  """
  return (not isinstance(have, _base.Merged) and not isinstance(want, _base.Merged)
          and len(want) > len(have) and tuple(want[:len(have)]) == tuple(have))


def _gathered_axes(have, want) -> tuple:
  """The axes a dimension split over ``have`` is gathered over on its way to ``want``.

  Only the trailing ones where ``want`` splits it over a leading part of
  ``have`` (``("batch", "model")`` to ``("batch",)``: the devices along
  ``"model"`` hold consecutive blocks of their ``"batch"`` block); all of them
  otherwise (a slice follows).
  """
  if (want and not isinstance(have, _base.Merged) and not isinstance(want, _base.Merged)
          and tuple(have[:len(want)]) == tuple(want)):
    return tuple(have[len(want):])
  return tuple(have)


def reuse_key(tensor, target, consumer: str, have=None) -> tuple:
  """What a relayout of ``tensor`` (layout ``have``) to ``target`` for the op ``consumer`` is shared by: its cache key.

  One relayout per tensor and layout serves every consumer after the first, except where the backward pass
  reads a gathered value: it makes its own. A variable's read (an FSDP kernel gathered again for its gradient, as
  PyTorch's FSDP and ZeRO-3 do, instead of the forward pass's gathered kernel held through the step), and an
  activation gathered from its pieces (the keys and values of attention over a split sequence, gathered again
  for the backward pass, as context parallelism does; the forward pass's whole copy is not kept for it).
  ``rewrite._deferred`` makes the backward pass's relayout wait for the backward pass. One more collective a
  step; the gathered value no longer held from the forward pass to the backward pass.
  """
  regathered = tensor.op.type == "ReadVariableOp" or (
      have is not None and any(h and h != w for h, w in zip(have, target)))  # a gather, not a slice
  backward = regathered and _memory.is_backward(consumer)
  return (tensor.name, target, backward)
