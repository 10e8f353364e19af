"""Rules for gathers (embedding lookups); their gradients' segment sums are in ``_segment``.

A table split along its other dimensions (the embedding dimension) is looked up
locally: each device's rows hold its columns. A table split along the gathered
dimension (the vocabulary) is looked up by every device in its own rows, with
the ids of other devices' rows masked to zero, and the lookups are summed
(all-reduce) over the vocabulary's axes: the Megatron vocabulary-parallel
embedding.

Rows picked by constant indices (a reorder of a sequence's chunks: the
balanced order of ring attention, ``replicator/core/_zigzag_ring.py``) along
a dimension split over mesh axes, as many rows out as in, keep the split:
each output row comes from a known input row, so each device keeps its own
rows where they stay and sends the others point to point (:func:`moves`:
rounds of ``permute``, each a partial permutation of the devices, a device
sending to two others in two rounds), never gathering the dimension.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrite.rules import _base


def moves(indices, rows: int, pieces: int):
  """How a gather of ``rows`` rows split in ``pieces`` at constant ``indices`` (as many) moves rows between pieces.

  Returns ``(own, rounds)``: ``own[d]``, piece ``d``'s output rows that are its own input rows, as ``(output
  row, input row)`` local pairs; ``rounds``, a list of ``(count, {(source, destination): [(input row, output
  row), ...]})``: each round a partial permutation of the pieces (a piece sends at most once and receives at
  most once), every message of a round ``count`` rows (so one ``permute`` of ``count`` rows a round).
  """
  tile = rows // pieces
  own = [[] for _ in range(pieces)]
  edges: dict = {}
  for i, j in enumerate(int(j) for j in indices):
    source, destination = j // tile, i // tile
    if source == destination:
      own[destination].append((i % tile, j % tile))
    else:
      edges.setdefault((source, destination), []).append((j % tile, i % tile))
  rounds: list = []
  for (source, destination), rows_moved in sorted(edges.items(), key=lambda e: (-len(e[1]), e[0])):
    for count, sent in rounds:
      if (count == len(rows_moved) and all(s != source for s, _ in sent)
              and all(d != destination for _, d in sent)):
        sent[(source, destination)] = rows_moved
        break
    else:
      rounds.append((len(rows_moved), {(source, destination): rows_moved}))
  return own, rounds


def _reorder(view, params, axis: int, indices):
  """The decision for rows of ``params`` (split along ``axis``) picked by constant ``indices``: see the module."""
  split = tuple(params[axis])
  shape, pieces = view.in_shape(0), view.shards(split)
  rows = shape[axis]
  own, rounds = moves(indices, rows, pieces)
  tile = rows // pieces
  itemsize = view.op.inputs[0].dtype.size
  row_bytes = int(np.prod([n // view.shards(a) for d, (n, a) in enumerate(zip(shape, params)) if d != axis])) * itemsize

  def lower(r, inputs, comm):
    x = inputs[0]
    p = view.mesh.axis_index(r, split)
    parts, where = [x], {}  # where: output row -> its row in the concatenation of x and what arrives
    for i, j in own[p]:
      where[i] = j
    at = tile
    for count, sent in rounds:
      mine = next((rows_moved for (s, _), rows_moved in sent.items() if s == p), None)
      picked = [j for j, _ in mine] if mine is not None else [0] * count  # (a piece sending nothing: not sent)
      got = comm.permute(tf.gather(x, picked, axis=axis), list(sent), split)
      arriving = next((rows_moved for (_, d), rows_moved in sent.items() if d == p), None)
      for k, (_, i) in enumerate(arriving or ()):
        where[i] = at + k
      parts.append(got)
      at += count
    order = [where[i] for i in range(tile)]
    if len(parts) == 1 and order == list(range(tile)):
      return [x]
    whole = parts[0] if len(parts) == 1 else tf.concat(parts, axis)
    return [tf.gather(whole, order, axis=axis)]

  def said(sent):
    return ", ".join(f"{s} to {d}" for s, d in sorted(sent))

  out = tuple(params)
  decision = _base.Decision(inputs=[out, ((),), None], outputs=[out], lower=lower)
  decision.communicates = tuple(
      ("permute", split, f"GatherV2 of constant rows along dim {axis}: {count} row{'s' if count > 1 else ''} "
       f"of a device's {tile} sent to another along {'/'.join(split)} ({said(sent)})", count * row_bytes) for count, sent in rounds)
  return decision


def _lookup(view, params, ids, axis, make_lookup):
  """The decision for looking up ids (layout ``ids``) along ``axis`` of a table (layout ``params``)."""
  table_split = params[axis]
  other = params[:axis] + params[axis + 1:]
  used = _base.axes_in(other) | set(table_split)
  ids_need = tuple(axes if used.isdisjoint(axes) else () for axes in ids)
  if len(_base.axes_in(ids_need)) != sum(len(a) for a in ids_need):
    ids_need = tuple(() for _ in ids_need)
  want = view.want()
  if want is not None:  # id dimensions the consumers want split: slice the ids instead
    wished = want[axis:axis + len(ids_need)]
    ids_need = _base.with_wanted(ids_need, wished) if not set(table_split) & _base.axes_in(wished) else ids_need
    # (an axis the table's other dimensions are split over cannot split the ids too: once a tensor)
    ids_need = tuple(() if set(axes) & used else axes for axes in ids_need)
  out = params[:axis] + ids_need + params[axis + 1:]
  inputs = [params, ids_need] + [None] * (len(view.op.inputs) - 2)
  if not table_split:
    return _base.Decision(inputs=inputs, outputs=[out])
  rows = (view.handle_shape(0) if view.op.type == "ResourceGather" else view.in_shape(0))[axis]
  local_rows = rows // view.shards(table_split)

  def lower(r, inputs):
    table, indices = inputs[0], inputs[1]
    start = view.offset(r, table_split, rows)
    local = indices - tf.cast(start, indices.dtype)
    inside = tf.logical_and(local >= 0, local < local_rows)
    looked_up = make_lookup(table, tf.where(inside, local, tf.zeros_like(local)), inputs)
    trailing = looked_up.shape.rank - axis - inside.shape.rank
    shape = inside.shape.as_list() if inside.shape.is_fully_defined() else tf.shape(inside)  # a batch of any size
    mask = tf.reshape(inside, tf.concat([[1] * axis, shape, [1] * trailing], 0) if tf.is_tensor(shape)
                      else [1] * axis + shape + [1] * trailing)
    return [tf.where(mask, looked_up, tf.zeros_like(looked_up))]

  # The lookups' partial sums reduce-scattered where the consumers want them split over the table's axes (ids
  # split over the axes the table's rows are: gathered, looked up in each device's rows, and the rows scattered
  # back), else all-reduced.
  out, scatter = _base.scatter_partials(view, out, table_split)
  return _base.Decision(inputs=inputs, outputs=[out], reduce=[("sum", table_split)], lower=lower,
                        scatter={0: scatter} if scatter else {})


def _reorders(view, params, axis: int, indices) -> bool:
  """Whether the gather is a reorder of rows of a dimension split over mesh axes (see the module)."""
  indices = np.asarray(indices)
  split = params[axis]
  if not split or isinstance(split, _base.Merged) or indices.ndim != 1:
    return False
  rows, pieces = view.in_shape(0)[axis], view.shards(tuple(split))
  return (rows != _base.UNKNOWN and rows == indices.size and rows % pieces == 0
          and bool(np.all((indices >= 0) & (indices < rows))))


@_base.register("GatherV2")
def gather(view, layouts):
  params, ids = layouts[0], layouts[1]
  axis = view.const(2)
  if axis is None or view.attr("batch_dims") != 0:
    return _base.fallback(view, layouts)
  axis = int(axis) % len(params)
  indices = view.const(1)
  if indices is not None and _reorders(view, params, axis, indices):
    return _reorder(view, params, axis, indices)

  def lookup(table, local_ids, inputs):
    return tf.gather(table, local_ids, axis=inputs[2])

  return _lookup(view, params, ids, axis, lookup)


@_base.register("ResourceGather")
def resource_gather(view, layouts):
  params, ids = layouts[0], layouts[1]
  if params is None or view.attr("batch_dims") != 0:
    return _base.fallback(view, layouts)
  dtype = view.attr("dtype")
  rows_shape = [int(n) for n in view.local_shape(view.handle_shape(0), params, "int64")[1:]]

  def lookup(handle, local_ids, inputs):
    looked_up = tf.raw_ops.ResourceGather(resource=handle, indices=local_ids, dtype=dtype)
    looked_up.set_shape(local_ids.shape.concatenate(rows_shape))  # a bare handle carries no shape
    return looked_up

  decision = _lookup(view, params, ids, 0, lookup)
  decision.inputs[0] = None  # the handle: each device's own piece
  return decision


@_base.register("GatherNd")
def gather_nd(view, layouts):
  """Slices of ``params`` at the positions ``indices`` lists (the gradient of ``ScatterNd``, a lookup by pairs).

  The listed positions keep the indices' splits (or take the split the
  consumers want), the slices' own dimensions the table's; an indexed
  dimension of the table that is split is gathered first (a position may
  point into any device's piece).
  """
  params, indices = layouts
  if params is None or indices is None or not indices:
    return _base.fallback(view, layouts)
  depth = view.in_shape(1)[-1]
  if depth <= 0 or depth > len(params):
    return _base.fallback(view, layouts)
  trailing = params[depth:]
  want = view.want()
  lead = _base.with_wanted(indices[:-1], None if want is None else want[:len(indices) - 1])
  used = _base.axes_in(trailing)
  kept = []
  for axes in lead:  # an axis once: the table's slices keep theirs
    kept.append(axes if used.isdisjoint(axes) else ())
    used.update(kept[-1])
  lead = tuple(kept)
  return _base.Decision(inputs=[((),) * depth + trailing, lead + ((),)], outputs=[lead + trailing])
