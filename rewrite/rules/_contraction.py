"""Rules for contractions: a split contracted dimension leaves partial sums (all-reduce "sum").

``MatMul``, ``BatchMatMulV2`` and ``Einsum`` are all written as one labelled
contraction (an einsum equation): every label (dimension) takes one split,
the first that an operand has at full size; labels that no operand splits take
the split the consumers want. An operand whose dimension is split otherwise is
relayouted to it; a contracted label that is split leaves partial sums, summed
by an all-reduce, or reduce-scattered along an output dimension the consumers
want split over the same axes.
"""

from __future__ import annotations

import string

from rewrite.rules import _base


def contract(view, layouts, labels: list[str], out_labels: str) -> _base.Decision:
  """The decision for a contraction of operands labelled ``labels`` into ``out_labels``.

  A label repeated within one operand (a diagonal) is not a contraction this
  rule understands: the op falls back.
  """
  if any(len(set(ls)) != len(ls) for ls in labels + [out_labels]):
    return _base.fallback(view, layouts)
  shapes = [view.in_shape(i) for i in range(len(labels))]
  size = {}
  for ls, shape in zip(labels, shapes):
    for label, n in zip(ls, shape):
      size[label] = max(size.get(label, 1), n)
  # A dimension of unknown size (a batch of any size): a contracted one equals the others' (contractions do not
  # broadcast), so it is at full size; another may be a broadcast 1 or not, so the op is not split along it.
  unknown = {label for ls, shape in zip(labels, shapes) for label, n in zip(ls, shape) if n == _base.UNKNOWN}
  shapes = [[size[label] if n == _base.UNKNOWN and label not in out_labels else n for label, n in zip(ls, shape)]
            for ls, shape in zip(labels, shapes)]
  split: dict = {}
  used: set = set()
  for ls, layout, shape in zip(labels, layouts, shapes):  # the first operand's splits win
    for label, axes, n in zip(ls, layout, shape):
      if axes and label not in split and n == size[label] and used.isdisjoint(axes):
        split[label] = axes
        used.update(axes)
  want = view.want()
  if want is not None:  # whole output dimensions the consumers want split: slice the operands instead
    for label, axes in zip(out_labels, want):
      if axes and label in size and label not in split and used.isdisjoint(axes) and size[label] % view.shards(axes) == 0:
        split[label] = axes
        used.update(axes)
  inputs = [tuple(split.get(label, ()) if n == size[label] else () for label, n in zip(ls, shape))
            for ls, shape in zip(labels, shapes)]
  if any(label in unknown and label in out_labels for label in split):
    return _base.fallback(view, layouts)
  summed = tuple(a for label in sorted(split) if label not in out_labels for a in split[label])
  out, scatter = _base.scatter_partials(view, tuple(split.get(label, ()) for label in out_labels), summed)
  return _base.Decision(inputs=inputs, outputs=[out], reduce=[("sum", summed) if summed else None],
                        scatter={0: scatter})


@_base.register("MatMul", position_blind=True)
def matmul(view, layouts):
  a = "km" if view.attr("transpose_a") else "mk"
  b = "nk" if view.attr("transpose_b") else "kn"
  return contract(view, layouts, [a, b], "mn")


@_base.register("BatchMatMulV2", "BatchMatMulV3", "BatchMatMul", position_blind=True)
def batch_matmul(view, layouts):
  ra, rb = len(view.in_shape(0)), len(view.in_shape(1))
  rank = len(view.out_shape())
  batch = string.ascii_lowercase[:rank - 2]
  a = batch[rank - ra:] + ("km" if view.attr("adj_x") else "mk")
  b = batch[rank - rb:] + ("nk" if view.attr("adj_y") else "kn")
  return contract(view, layouts, [a, b], batch + "mn")


@_base.register("Einsum", position_blind=True)
def einsum(view, layouts):
  equation = view.attr("equation")
  equation = equation.decode() if isinstance(equation, bytes) else equation
  parsed = _parse_einsum(equation.replace(" ", ""), [len(view.in_shape(i)) for i in range(len(layouts))],
                         len(view.out_shape()))
  if parsed is None:
    return _base.fallback(view, layouts)
  labels, out_labels = parsed
  return contract(view, layouts, labels, out_labels)


def _parse_einsum(equation: str, ranks: list[int], out_rank: int):
  """``(operand labels, output labels)`` with each ``...`` spelled out (labels are single characters)."""
  if "->" not in equation:
    return None
  ins, out = equation.split("->")
  ins = ins.split(",")
  if len(ins) != len(ranks):
    return None
  fresh = [c for c in string.digits]  # labels no equation uses
  ellipsis_rank = max([r - (len(s) - 3) for s, r in zip(ins, ranks) if "..." in s] + [0])
  dots = "".join(fresh[:ellipsis_rank])
  labels = []
  for s, r in zip(ins, ranks):
    if "..." in s:
      n = r - (len(s) - 3)
      s = s.replace("...", dots[ellipsis_rank - n:])  # broadcast ellipsis dimensions align right
    if len(s) != r:
      return None
    labels.append(s)
  out = out.replace("...", dots)
  if len(out) != out_rank:
    return None
  return labels, out
