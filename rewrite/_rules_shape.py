"""Rules for shape changes: shape operands become local values, splits follow their dimension."""

from __future__ import annotations

import math

import numpy as np

from rewrite import _rules


@_rules.register("Reshape")
def reshape(view, layouts):
  layout = layouts[0]
  target = view.const(1)
  in_shape, out_shape = view.in_shape(0), view.out_shape()
  if target is None or None in in_shape or None in out_shape:
    return _rules.fallback(view, layouts)
  out = [()] * len(out_shape)
  for i, axes in enumerate(layout):
    if not axes:
      continue
    before = math.prod(in_shape[:i])
    j = next((j for j in range(len(out_shape) + 1) if math.prod(out_shape[:j]) == before), None)
    if j is None or j >= len(out_shape) or out_shape[j] != in_shape[i]:
      return _rules.fallback(view, layouts)  # the split dimension does not survive the reshape
    out[j] = axes
  local = [n // view.shards(a) for n, a in zip(out_shape, out)]
  return _rules.Decision(inputs=[layout, None], outputs=[tuple(out)],
                         consts={1: np.asarray(local, dtype=target.dtype)})


@_rules.register("Tile")
def tile(view, layouts):
  layout = layouts[0]
  multiples = view.const(1)
  if multiples is None or any(a and m != 1 for a, m in zip(layout, multiples)):
    return _rules.fallback(view, layouts)
  # A whole dimension tiled m times is split as wanted by tiling m/k times on each device.
  want = view.want() or ((),) * len(layout)
  out, local = list(layout), [int(m) for m in multiples]
  used = {a for axes in layout for a in axes}
  for d, (have, wish) in enumerate(zip(layout, want)):
    k = view.shards(wish)
    if not have and wish and used.isdisjoint(wish) and local[d] % k == 0:
      out[d], local[d] = wish, local[d] // k
      used.update(wish)
  return _rules.Decision(inputs=[layout, None], outputs=[tuple(out)],
                         consts={1: np.asarray(local, dtype=multiples.dtype)})


@_rules.register("ExpandDims")
def expand_dims(view, layouts):
  layout = layouts[0]
  dim = view.const(1)
  if dim is None:
    return _rules.fallback(view, layouts)
  dim = int(dim) % (len(layout) + 1)
  want = view.want()
  if want is not None and len(want) == len(layout) + 1 and not want[dim]:
    layout = _rules.with_wanted(layout, want[:dim] + want[dim + 1:])
  return _rules.Decision(inputs=[layout, None], outputs=[layout[:dim] + ((),) + layout[dim:]])


@_rules.register("Squeeze")
def squeeze(view, layouts):
  layout = layouts[0]
  in_shape = view.in_shape(0)
  dims = {d % len(layout) for d in view.attr("squeeze_dims")} or {d for d, n in enumerate(in_shape) if n == 1}
  return _rules.Decision(inputs=[layout], outputs=[tuple(a for d, a in enumerate(layout) if d not in dims)])


@_rules.register("Shape", "Size", "Rank")
def shape_query(view, layouts):
  """A shape query answers with the GLOBAL shape, whatever the layout (the traced shapes are static)."""
  shape = view.in_shape(0)
  if None in shape:
    return _rules.fallback(view, layouts)
  dtype = view.op.outputs[0].dtype.as_numpy_dtype
  value = {"Shape": shape, "Size": math.prod(shape), "Rank": len(shape)}[view.op.type]
  return _rules.Decision(inputs=[None], outputs=[_rules.replicated(view.op.outputs[0].shape.rank)],
                         values={0: np.asarray(value, dtype=dtype)})
