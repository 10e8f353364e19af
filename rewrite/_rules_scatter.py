"""Rules for scatters: updates written (summed) into a new tensor at given indices.

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

from rewrite import _rules


@_rules.register("ScatterNd")
def scatter_nd(view, layouts):
  indices, updates, _ = layouts
  shape = view.const(2)
  if shape is None or indices is None or updates is None or not indices:
    return _rules.fallback(view, layouts)
  depth = view.in_shape(0)[-1]
  lead = len(indices) - 1  # the dimensions that list the pairs
  if depth <= 0 or len(updates) != lead + len(shape) - depth:
    return _rules.fallback(view, layouts)
  trailing = updates[lead:]
  used = _rules.axes_in(trailing)
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
  out, scatter = _rules.scatter_partials(view, computed, summed)
  return _rules.Decision(inputs=[pairs + ((),), pairs + trailing, None], outputs=[out],
                         reduce=[("sum", summed) if summed else None], scatter={0: scatter},
                         consts={2: view.local_shape(shape, computed, shape.dtype)})
