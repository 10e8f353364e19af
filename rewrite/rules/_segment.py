"""Rules for segment reductions: rows combined into segments by id (a lookup's gradient, pooling by graph).

``UnsortedSegment{Sum,Max,Min,Prod}(data, ids, n)`` combine the rows of
``data`` with the same id into ``n`` segments; ``Segment{Sum,Mean,Max,Min,Prod}``
(ids sorted, as many segments as the largest id + 1) likewise. Rows split
over devices (a batch) leave each device its rows' partial segments, which
are combined over the rows' axes: an all-reduce of the sum, max or min; a
product is all-gathered and multiplied (collectives have no product). A
sorted op's segment count is the largest id over every device's rows, and
its empty segments are zero (an unsorted max leaves the lowest value), so
it runs as its unsorted form with the count and the rows a segment has
all-reduced. Where the consumers want the segments of an unsorted sum, max,
min or product split (the gradient of a vocabulary-split embedding), each
device keeps only its own segments. The dimensions past the ids keep their
splits.
"""

from __future__ import annotations

import tensorflow as tf

from rewrite.rules import _base

_UNSORTED = {"Sum": tf.math.unsorted_segment_sum, "Max": tf.math.unsorted_segment_max,
             "Min": tf.math.unsorted_segment_min, "Prod": tf.math.unsorted_segment_prod}


def _kind(op_type: str) -> str:
  """``"UnsortedSegmentMax"`` -> ``"Max"``."""
  return op_type.removeprefix("Unsorted").removeprefix("Segment")


def _rows(data, prefix, keep=()):
  """The split the rows (the dimensions the ids cover) keep: axes not used past them, nor in ``keep``."""
  rest = _base.axes_in(data[prefix:])
  return tuple(axes if set(axes).isdisjoint(keep) and rest.isdisjoint(axes) else () for axes in data[:prefix])


def _combined(comm, x, kind, summed):
  """Every device's partial segments ``x`` combined over ``summed``."""
  if kind != "Prod":
    return comm.all_reduce(x, kind.lower(), summed)
  return tf.reduce_prod(comm.all_gather(x[None], 0, summed), axis=0)


@_base.register("UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin", "UnsortedSegmentProd")
def unsorted_segment(view, layouts):
  data = layouts[0]
  segments = view.const(2)
  if segments is None or data is None:
    return _base.fallback(view, layouts)
  kind = _kind(view.op.type)
  segments = int(segments)
  prefix = len(view.in_shape(1))
  rest = data[prefix:]
  want = view.want()
  table_split = ()
  if want is not None and want[0] and _base.axes_in(rest).isdisjoint(want[0]) and segments % view.shards(want[0]) == 0:
    table_split = want[0]
  rows = _rows(data, prefix, table_split)
  summed = tuple(a for axes in rows for a in axes)
  out = (table_split,) + rest
  inputs = [rows + rest, rows, None]
  if not table_split and kind != "Prod":
    return _base.Decision(inputs=inputs, outputs=[out], reduce=[(kind.lower(), summed) if summed else None])
  local_segments = segments // view.shards(table_split)

  def lower(r, ins, comm=None):
    values, ids = ins[0], ins[1]
    if table_split:
      local = ids - tf.cast(view.offset(r, table_split, segments), ids.dtype)
      inside = tf.logical_and(local >= 0, local < local_segments)
      ids = tf.where(inside, local, -tf.ones_like(local))  # a negative id is dropped
    partial = _UNSORTED[kind](values, ids, local_segments)
    return [partial if comm is None else _combined(comm, partial, kind, summed)]

  if kind != "Prod" or not summed:
    return _base.Decision(inputs=inputs, outputs=[out], reduce=[(kind.lower(), summed) if summed else None],
                          lower=lower)
  return _base.Decision(inputs=inputs, outputs=[out], lower=lower,
                        communicates=(("all_gather", summed, "segment product of split rows: the partial products"),))


@_base.register("SegmentSum", "SegmentMean", "SegmentMax", "SegmentMin", "SegmentProd")
def sorted_segment(view, layouts):
  data = layouts[0]
  if data is None:
    return _base.fallback(view, layouts)
  kind = _kind(view.op.type)
  rows = _rows(data, 1)
  summed = rows[0]
  rest = data[1:]
  inputs = [rows + rest, rows]
  if not summed:
    return _base.Decision(inputs=inputs, outputs=[((),) + rest])

  def lower(r, ins, comm):
    values, ids = ins[0], ins[1]
    n = comm.all_reduce(tf.reduce_max(tf.concat([ids, [-1]], 0)) + 1, "max", summed)  # the largest id + 1
    if kind in ("Mean", "Max", "Min"):
      filled = comm.all_reduce(tf.math.unsorted_segment_sum(tf.ones_like(ids, tf.int32), ids, n), "sum", summed)
    if kind == "Mean":
      total = comm.all_reduce(tf.math.unsorted_segment_sum(values, ids, n), "sum", summed)
      count = tf.reshape(tf.cast(tf.maximum(filled, 1), values.dtype), [-1] + [1] * (len(rest)))
      return [total / count]
    combined = _combined(comm, _UNSORTED[kind](values, ids, n), kind, summed)
    if kind in ("Max", "Min"):  # an empty segment is 0 here, the lowest (highest) value unsorted
      empty = tf.reshape(tf.equal(filled, 0), [-1] + [1] * len(rest))
      combined = tf.where(empty, tf.zeros_like(combined), combined)
    return [combined]

  why = f"{view.op.type} of split rows: "
  communicates = (("all_reduce", summed, why + "the number of segments"),) + (
      (("all_reduce", summed, why + "the rows of each segment"),) if kind in ("Mean", "Max", "Min") else ()) + (
      ("all_gather" if kind == "Prod" else "all_reduce", summed, why + "the partial segments"),)
  return _base.Decision(inputs=inputs, outputs=[((),) + rest], lower=lower, communicates=communicates)
