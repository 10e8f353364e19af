"""Rules for scatters: updates written (summed) into a new tensor, or into a given one, at given indices.

``ScatterNd(indices, updates, shape)`` sums ``updates[i]`` into position
``indices[i]`` of a zero tensor of ``shape``: the gradient of a lookup by
``GatherNd``, and of ``TopKV2`` (a router's choice of experts), where the
indices and updates come split over the batch. Each device scatters its own
pairs into a whole zero tensor, and the pieces are summed over the axes the
pairs were split over (any device's pair may land anywhere: the indices are
data). Where the consumers take the result split along those axes (a
gradient whose rows are split over the batch), the sum is a reduce-scatter.
The dimensions the updates carry past the indexed ones keep their splits.
"""

from __future__ import annotations

import tensorflow as tf

from rewrite.rules import _base


@_base.register("ScatterNd")
def scatter_nd(view, layouts):
  indices, updates, _ = layouts
  shape = view.const(2)
  if shape is None or indices is None or updates is None or not indices:
    return _base.fallback(view, layouts)
  depth = view.in_shape(0)[-1]
  lead = len(indices) - 1  # the dimensions that list the pairs
  if depth <= 0 or len(updates) != lead + len(shape) - depth:
    return _base.fallback(view, layouts)
  trailing = updates[lead:]
  used = _base.axes_in(trailing)
  pairs = []
  for own, other in zip(indices[:lead], updates[:lead]):  # the pairs' split: the indices', else the updates'
    axes = own or other
    if axes and used.isdisjoint(axes):
      pairs.append(axes)
      used.update(axes)
    else:
      pairs.append(())
  pairs = tuple(pairs)
  computed = ((),) * depth + trailing
  summed = tuple(a for axes in pairs for a in axes)
  out, scatter = _base.scatter_partials(view, computed, summed)
  return _base.Decision(inputs=[pairs + ((),), pairs + trailing, None], outputs=[out],
                        reduce=[("sum", summed) if summed else None], scatter={0: scatter},
                        consts={2: view.local_shape(shape, computed, shape.dtype)})


_TENSOR_SCATTERS = {"TensorScatterAdd": "sum", "TensorScatterSub": "sum", "TensorScatterMax": "max",
                    "TensorScatterMin": "min", "TensorScatterUpdate": None}


@_base.register(*_TENSOR_SCATTERS)
def tensor_scatter(view, layouts):
  """``tensor`` with ``updates[i]`` written (added, subtracted, maxed, mined) at position ``indices[i]``.

  The indexed dimensions of ``tensor`` are whole (a position may be anywhere),
  the dimensions past them keep their splits, in the updates too. Pairs split
  over axes (rows of a batch): each device adds its own pairs into a zero
  tensor and the sums are all-reduced and added to ``tensor`` (subtracted);
  a max or min is taken on each device and all-reduced (the same max as one
  device's); an update, where the last write of duplicates is undefined,
  gathers the pairs.
  """
  tensor, indices, updates = layouts
  if tensor is None or indices is None or updates is None or not indices:
    return _base.fallback(view, layouts)
  depth = view.in_shape(1)[-1]
  lead = len(indices) - 1
  if depth <= 0 or depth > len(tensor) or len(updates) != lead + len(tensor) - depth:
    return _base.fallback(view, layouts)
  trailing = tensor[depth:]
  used = _base.axes_in(trailing)
  combine = _TENSOR_SCATTERS[view.op.type]
  pairs = []
  for own, other in zip(indices[:lead], updates[:lead]):
    axes = (own or other) if combine else ()
    pairs.append(axes if axes and used.isdisjoint(axes) else ())
    used.update(pairs[-1])
  pairs = tuple(pairs)
  out = ((),) * depth + trailing
  inputs = [out, pairs + ((),), pairs + trailing]
  summed = tuple(a for axes in pairs for a in axes)
  if not summed:
    return _base.Decision(inputs=inputs, outputs=[out])
  subtract = view.op.type == "TensorScatterSub"

  def lower(r, ins, comm):
    base, where, values = ins
    if combine == "sum":
      delta = comm.all_reduce(tf.scatter_nd(where, values, tf.shape(base, out_type=where.dtype)), "sum", summed)
      return [base - delta if subtract else base + delta]
    local = getattr(tf.raw_ops, view.op.type)(tensor=base, indices=where, updates=values)
    return [comm.all_reduce(local, combine, summed)]

  why = f"{view.op.type} of split pairs: " + ("their sum" if combine == "sum" else f"the {combine}")
  return _base.Decision(inputs=inputs, outputs=[out], lower=lower, communicates=(("all_reduce", summed, why),))
