"""Rules for shape changes: shape operands become local values, splits follow their dimension."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from rewrite.rules import _base


@_base.register("Reshape")
def reshape(view, layouts):
  """A split survives a reshape where its dimension starts a dimension of the output it divides.

  Then each device's contiguous block of the flattened tensor is the same
  block of that output dimension (merging ``[batch, time]`` into rows, or
  splitting rows back). Dimensions merged into one with a split past the
  first of them (rows of ``[batch, seq]`` with the sequence split: a
  ``Dense`` layer's reshape) give a :class:`_base.Merged` dimension, which
  a reshape splitting those dimensions out again undoes. Other splits are
  gathered first.
  """
  layout = layouts[0]
  in_shape, out_shape = view.in_shape(0), view.out_shape()  # a shape computed at run time but known when traced too
  if _base.UNKNOWN in in_shape or _base.UNKNOWN in out_shape:
    return _base.fallback(view, layouts)
  starts_in = {math.prod(in_shape[:i]): i for i in range(len(in_shape))}
  starts_out = {math.prod(out_shape[:j]): j for j in range(len(out_shape))}

  def partner(d, shape, other_starts, other_shape, axes):
    j = other_starts.get(math.prod(shape[:d]))
    k = view.shards(axes)
    return j if j is not None and other_shape[j] % k == 0 and shape[d] % k == 0 else None

  need, out = list(layout), [()] * len(out_shape)
  merges = _merges(layout, in_shape, out_shape)
  grouped = {i for first, last, _ in merges for i in range(first, last)}
  for first, last, j in merges:
    out[j] = _base.merge([(in_shape[i], layout[i]) for i in range(first, last)], view.shards)
  for i, axes in enumerate(layout):
    if i in grouped or not axes:
      continue
    if isinstance(axes, _base.Merged):
      kept = _unmerge(axes, math.prod(in_shape[:i]), out_shape, starts_out)
      if kept is None:
        need[i] = ()
      else:
        for j, split in kept:
          out[j] = split
      continue
    j = partner(i, in_shape, starts_out, out_shape, axes)
    if j is not None:
      out[j] = axes
      continue
    spread = _spread(axes, math.prod(in_shape[:i]), in_shape[i], out_shape, starts_out, view.shards)
    if spread is None:
      need[i] = ()
    else:  # rows [batch * seq] split over ("batch", "seq") back into [batch, seq]
      j, parts = spread
      out[j:j + len(parts)] = parts
  want = view.want()
  if want is not None:  # whole output dimensions the consumers want split: slice the input instead
    used = _base.axes_in(out)
    for j, axes in enumerate(want):
      if axes and not isinstance(axes, _base.Merged) and not out[j] and used.isdisjoint(axes):
        i = partner(j, out_shape, starts_in, in_shape, axes)
        if i is not None and not need[i] and i not in grouped and in_shape[i] == out_shape[j]:
          need[i], out[j] = axes, axes
          used.update(axes)
    for i in range(len(in_shape)):  # rows split back into [batch, seq] wanted split: the rows taken so
      j = starts_out.get(math.prod(in_shape[:i]))
      if j is None or i in grouped or isinstance(need[i], _base.Merged):
        continue
      found = _split_into(i, j, in_shape, out_shape, want, out, used - set(need[i]), view.shards)
      if found is not None:
        need[i], parts = found
        out[j:j + len(parts)] = parts
        used.update(_base.axes_in(parts))
    for j, axes in enumerate(out):  # split output dimensions the consumers want whole: the input gathered instead
      if axes and not isinstance(axes, _base.Merged) and j < len(want) and not want[j] and len(want) == len(out):
        sources = [i for i in range(len(layout)) if need[i] and _base.axes_in((need[i],)) & _base.axes_in((axes,))]
        for i in sources:
          need[i] = ()
        out[j] = ()
  return _base.Decision(inputs=[tuple(need), None], outputs=[tuple(out)],
                        consts={1: view.local_shape(out_shape, out, view.op.inputs[1].dtype.as_numpy_dtype)})


def _split_into(i, j, in_shape, out_shape, want, out, used, shards):
  """``(split, parts)``: input dimension ``i``, reshaped into output dimensions ``j, j+1, ...``, split so that each
  of those keeps its split (``out``) or takes the one the consumers want (``parts``; ``split``: their
  :func:`_base.merge`); None if that changes nothing, or ``i`` is not reshaped into several dimensions."""
  end, size = j, 1
  while end < len(out_shape) and size < in_shape[i]:
    size *= out_shape[end]
    end += 1
  if size != in_shape[i] or end - j < 2:
    return None
  parts = []
  for q in range(j, end):
    w = want[q] if q < len(want) else ()
    if w and not out[q] and not isinstance(w, _base.Merged) and used.isdisjoint(w) and out_shape[q] % shards(tuple(w)) == 0:
      parts.append(tuple(w))
    else:
      parts.append(tuple(out[q]))
  if parts == [tuple(x) for x in out[j:end]] or len(_base.axes_in(parts)) != sum(len(w) for w in parts):
    return None
  return _base.merge([(out_shape[q], w) for q, w in zip(range(j, end), parts)], shards), parts


def _spread(axes, start, size, out_shape, starts_out, shards):
  """``(j, parts)``: a dimension split over ``axes`` (plainly), reshaped into output dimensions ``j, j+1, ...``, as
  their splits (the axes in order, each dimension taking some); None if no such splits give its pieces."""
  j = starts_out.get(start)
  if j is None:
    return None
  end, total = j, 1
  while end < len(out_shape) and total < size:
    total *= out_shape[end]
    end += 1
  if total != size or end - j < 2:
    return None
  sizes = out_shape[j:end]

  def assign(k, q, parts):
    if k == len(axes):
      if all(n % shards(p) == 0 for n, p in zip(sizes, parts) if p) and _base.merge(list(zip(sizes, parts)),
                                                                                  shards) == tuple(axes):
        return parts
      return None
    for r in range(q, len(sizes)):
      found = assign(k + 1, r, parts[:r] + [parts[r] + (axes[k],)] + parts[r + 1:])
      if found is not None:
        return found
    return None

  parts = assign(0, 0, [()] * len(sizes))
  return None if parts is None else (j, parts)


def _merges(layout, in_shape, out_shape) -> list:
  """``(first, last, j)`` of each run of input dimensions ``[first, last)`` merged into output dimension ``j``
  with a split past the first (plain splits only: a merged dimension is not merged again)."""
  found = []
  starts_in = {}
  for i in range(len(in_shape) + 1):
    starts_in.setdefault(math.prod(in_shape[:i]), []).append(i)
  for j, n in enumerate(out_shape):
    start = math.prod(out_shape[:j])
    for first in starts_in.get(start, ()):
      last = next((i for i in starts_in.get(start * n, ()) if i > first + 1), None)
      if last is None or math.prod(in_shape[first:last]) != n:
        continue
      splits = layout[first:last]
      if any(isinstance(a, _base.Merged) for a in splits) or not any(splits[1:]):
        continue
      found.append((first, last, j))
      break
  return found


def _unmerge(merged, start, out_shape, starts_out):
  """The output dimensions ``(j, axes)`` a merged dimension starting at ``start`` (flattened) splits into, or None.

  Its parts again (their own splits), or one dimension of its size (still merged).
  """
  j = starts_out.get(start)
  if j is None:
    return None
  sizes = [n for n, _ in merged.parts]
  if list(out_shape[j:j + len(sizes)]) == sizes:
    return [(j + q, axes) for q, (_, axes) in enumerate(merged.parts)]
  if out_shape[j] == merged.size:
    return [(j, merged)]
  return None


@_base.register("Transpose", position_blind=True)
def transpose(view, layouts):
  perm = view.const(1)
  if perm is None:
    return _base.fallback(view, layouts)
  perm = [int(p) for p in perm]
  want = view.want()
  layout = layouts[0]
  if want is not None:
    inverse = [0] * len(perm)
    for j, p in enumerate(perm):
      inverse[p] = j
    wished = tuple(want[inverse[d]] for d in range(len(perm)))
    layout = _whole_where_wanted(_base.with_wanted(layout, wished), wished)
  return _base.Decision(inputs=[layout, None], outputs=[tuple(layout[p] for p in perm)])


def _whole_where_wanted(layout, want):
  """``layout`` with the dimensions ``want`` leaves whole made whole (the input gathered, not the output).

  For an op whose output has its input's elements (a transpose, a slice adding
  a dimension): the same bytes, and the wish moves on to the op before it,
  which may gather less (a mask's ``[batch, 1, keys]`` before its broadcast
  to every query, keys before grouped-query attention repeats their heads).
  """
  if want is None or len(want) != len(layout):
    return layout
  return tuple(() if not w else axes for axes, w in zip(layout, want))


def _passthrough(view, layout, dims, out_map):
  """Keeps the splits of input ``dims`` (whole elsewhere); ``out_map``: per output dim, its input dim or None."""
  need = _base.keep(layout, dims)
  want = view.want()
  if want is not None:
    wished = [()] * len(need)
    for j, d in enumerate(out_map):
      if d is not None and d in dims:
        wished[d] = want[j]
    need = _base.with_wanted(need, tuple(wished))
    if math.prod(view.in_shape(0)) == math.prod(view.out_shape()):  # the same elements: gather the input instead
      kept = {d for d in out_map if d is not None}
      need = tuple(() if d in kept and not wished[d] else axes for d, axes in enumerate(need))
  return need, tuple(() if d is None else need[d] for d in out_map)


@_base.register("Slice")
def slice_(view, layouts):
  begin, size = view.const(1), view.const(2)
  shape = view.in_shape(0)
  if begin is None or size is None:
    return _base.fallback(view, layouts)
  full = {d for d, (b, n) in enumerate(zip(begin, size)) if b == 0 and n in (-1, shape[d])}
  need, out = _passthrough(view, layouts[0], full, list(range(len(shape))))
  local = np.asarray([-1 if need[d] else int(n) for d, n in enumerate(size)], dtype=size.dtype)
  return _base.Decision(inputs=[need, None, None], outputs=[out], consts={2: local})


def strided_dims(view, shape):
  """For a StridedSlice's spec: (input dims taken whole, per output dim its input dim or None)."""
  begin, end, strides = view.const(1), view.const(2), view.const(3)
  if begin is None or end is None or strides is None:
    return None
  mask = {name: view.attr(name) for name in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                            "shrink_axis_mask")}
  n = len(begin)
  consuming = sum(1 for i in range(n) if not (mask["ellipsis_mask"] >> i) & 1 and not (mask["new_axis_mask"] >> i) & 1)
  rank = len(shape)
  full, out_map, d = set(), [], 0
  for i in range(n):
    if (mask["ellipsis_mask"] >> i) & 1:
      for _ in range(rank - consuming):
        full.add(d)
        out_map.append(d)
        d += 1
    elif (mask["new_axis_mask"] >> i) & 1:
      out_map.append(None)
    elif (mask["shrink_axis_mask"] >> i) & 1:
      d += 1
    else:
      whole_begin = (mask["begin_mask"] >> i) & 1 or begin[i] == 0
      whole_end = (mask["end_mask"] >> i) & 1 or (shape[d] is not None and end[i] >= shape[d])  # unknown: a part
      if strides[i] == 1 and whole_begin and whole_end:
        full.add(d)
      out_map.append(d)
      d += 1
  while d < rank:
    full.add(d)
    out_map.append(d)
    d += 1
  return full, out_map


@_base.register("StridedSlice")
def strided_slice(view, layouts):
  dims = strided_dims(view, view.in_shape(0))
  if dims is None:
    return _base.fallback(view, layouts)
  need, out = _passthrough(view, layouts[0], *dims)
  return _base.Decision(inputs=[need, None, None, None], outputs=[out])


@_base.register("StridedSliceGrad")
def strided_slice_grad(view, layouts):
  """The gradient of a StridedSlice: ``dy`` scattered into zeros of the input's shape."""
  shape = view.const(0)
  dims = None if shape is None else strided_dims(view, [int(n) for n in shape])
  if dims is None:
    return _base.fallback(view, layouts)
  full, out_map = dims
  dy = layouts[4]
  out = [()] * len(shape)
  for j, d in enumerate(out_map):
    if d is not None and d in full:
      out[d] = dy[j]
  need = tuple(out[d] if d is not None else () for d in out_map)
  return _base.Decision(inputs=[None, None, None, None, need], outputs=[tuple(out)],
                        consts={0: view.local_shape(shape, out, shape.dtype)})


def _first_splits(layouts, rank, skip=()):
  """Per dimension, the first split an input has there (axes used once)."""
  out, used = [()] * rank, set()
  for layout in layouts:
    for d, axes in enumerate(layout):
      if d not in skip and axes and not out[d] and used.isdisjoint(axes):
        out[d] = axes
        used.update(axes)
  return tuple(out)


@_base.register("ConcatV2")
def concat(view, layouts):
  axis = view.const(len(layouts) - 1)
  values = layouts[:-1]
  if axis is None:
    return _base.fallback(view, layouts)
  rank = len(view.out_shape())
  axis = int(axis) % rank
  layout = _base.with_wanted(_first_splits(values, rank, skip=(axis,)),
                             _base.keep(view.want(), set(range(rank)) - {axis}) if view.want() else None)
  return _base.Decision(inputs=[layout] * len(values) + [None], outputs=[layout])


@_base.register("Pack")
def pack(view, layouts):
  rank = len(view.in_shape(0))
  axis = view.attr("axis") % (rank + 1)
  layout = _first_splits(layouts, rank)
  want = view.want()
  if want is not None:
    layout = _base.with_wanted(layout, want[:axis] + want[axis + 1:])
  return _base.Decision(inputs=[layout] * len(layouts), outputs=[layout[:axis] + ((),) + layout[axis:]])


@_base.register("Unpack")
def unpack(view, layouts):
  layout = layouts[0]
  axis = view.attr("axis") % len(layout)
  need = layout[:axis] + ((),) + layout[axis + 1:]
  out = need[:axis] + need[axis + 1:]
  return _base.Decision(inputs=[need], outputs=[out] * len(view.op.outputs))


@_base.register("Split", "SplitV")
def split(view, layouts):
  value, axis_index = (1, 0) if view.op.type == "Split" else (0, 2)
  axis = view.const(axis_index)
  if axis is None:
    return _base.fallback(view, layouts)
  layout = layouts[value]
  axis = int(axis) % len(layout)
  need = layout[:axis] + ((),) + layout[axis + 1:]
  inputs = [None] * len(layouts)
  inputs[value] = need
  return _base.Decision(inputs=inputs, outputs=[need] * len(view.op.outputs))


@_base.register("Fill")
def fill(view, layouts):
  """A filled tensor is made at the local shape the consumers want."""
  dims = view.const(0)
  if dims is None:
    return _base.fallback(view, layouts)
  out = tuple(axes if axes and int(n) % view.shards(axes) == 0 else ()
              for n, axes in zip(dims, view.want() or ((),) * len(dims)))
  used = [a for axes in out for a in axes]
  if len(used) != len(set(used)):
    out = ((),) * len(dims)
  return _base.Decision(inputs=[None, ()], outputs=[out], consts={0: view.local_shape(dims, out, dims.dtype)})


@_base.register("BroadcastTo")
def broadcast_to(view, layouts):
  shape = view.const(1)
  if shape is None:
    return _base.fallback(view, layouts)
  in_shape, out_shape = view.in_shape(0), [int(n) for n in shape]
  offset = len(out_shape) - len(in_shape)
  out = [()] * len(out_shape)
  for i, axes in enumerate(layouts[0]):
    if in_shape[i] == out_shape[i + offset]:
      out[i + offset] = axes
  out = list(_base.with_wanted(tuple(out), view.want()))
  need = tuple(out[i + offset] if in_shape[i] == out_shape[i + offset] else () for i in range(len(in_shape)))
  return _base.Decision(inputs=[need, None], outputs=[tuple(out)],
                        consts={1: view.local_shape(out_shape, out, shape.dtype)})


@_base.register("Pad", "PadV2", "MirrorPad")
def pad(view, layouts):
  paddings = view.const(1)
  if paddings is None:
    return _base.fallback(view, layouts)
  whole = {d for d, (lo, hi) in enumerate(paddings) if lo == 0 and hi == 0}
  rank = len(whole) + sum(1 for lo, hi in paddings if lo or hi)
  need, out = _passthrough(view, layouts[0], whole, list(range(rank)))
  return _base.Decision(inputs=[need] + [None] * (len(layouts) - 1), outputs=[out])


@_base.register("MatrixBandPart")
def matrix_band_part(view, layouts):
  """A mask by position in the last two dimensions: those are whole, the rest keep their splits."""
  rank = len(layouts[0])
  need, out = _passthrough(view, layouts[0], set(range(rank - 2)), list(range(rank)))
  return _base.Decision(inputs=[need, None, None], outputs=[out])


@_base.register("Tile")
def tile(view, layouts):
  multiples = view.const(1)
  if multiples is None:
    return _base.fallback(view, layouts)
  # A split dimension tiled more than once is gathered first (its pieces would interleave).
  layout = tuple(() if m != 1 else axes for axes, m in zip(layouts[0], multiples))
  # A whole dimension tiled m times is split as wanted by tiling m/k times on each device; one not tiled
  # (m = 1) by slicing the input.
  layout = _whole_where_wanted(layout, view.want())  # the input is no bigger than the output: gathered there
  want = view.want() or ((),) * len(layout)
  need, out, local = list(layout), list(layout), [int(m) for m in multiples]
  used = _base.axes_in(layout)
  shape = view.in_shape(0)
  for d, (have, wish) in enumerate(zip(layout, want)):
    k = view.shards(wish)
    if have or not wish or not used.isdisjoint(wish):
      continue
    if local[d] % k == 0:
      out[d], local[d] = wish, local[d] // k
    elif local[d] == 1 and shape[d] > 0 and shape[d] % k == 0:
      need[d] = out[d] = wish
    else:
      continue
    used.update(wish)
  return _base.Decision(inputs=[tuple(need), None], outputs=[tuple(out)],
                        consts={1: np.asarray(local, dtype=multiples.dtype)})


@_base.register("Bitcast")
def bitcast(view, layouts):
  """Same bits, another type: a wider type takes the last dimension away, a narrower one adds it."""
  (layout,) = layouts
  rank_in, rank_out = len(view.in_shape(0)), len(view.out_shape())
  if rank_out == rank_in:  # types of one size: elementwise
    return _base.Decision(inputs=[layout], outputs=[layout])
  if rank_out > rank_in:  # [..., n] of a type k times as wide -> [..., n, k]
    return _base.Decision(inputs=[layout], outputs=[layout + ((),)])
  kept = layout[:-1] + ((),)  # [..., k] -> [...]: the bytes of one element stay together
  return _base.Decision(inputs=[kept], outputs=[kept[:-1]])


@_base.register("OneHot")
def one_hot(view, layouts):
  """Indices to one-hot rows: the indices' splits, and the new (depth) dimension whole."""
  layout = layouts[0]
  axis = view.attr("axis") % (len(layout) + 1)
  return _base.Decision(inputs=[layout, (), (), ()], outputs=[layout[:axis] + ((),) + layout[axis:]])


@_base.register("ExpandDims", position_blind=True)
def expand_dims(view, layouts):
  layout = layouts[0]
  dim = view.const(1)
  if dim is None:
    return _base.fallback(view, layouts)
  dim = int(dim) % (len(layout) + 1)
  want = view.want()
  if want is not None and len(want) == len(layout) + 1 and not want[dim]:
    layout = _whole_where_wanted(_base.with_wanted(layout, want[:dim] + want[dim + 1:]), want[:dim] + want[dim + 1:])
  return _base.Decision(inputs=[layout, None], outputs=[layout[:dim] + ((),) + layout[dim:]])


@_base.register("Squeeze", position_blind=True)
def squeeze(view, layouts):
  layout = layouts[0]
  in_shape = view.in_shape(0)
  dims = {d % len(layout) for d in view.attr("squeeze_dims")} or {d for d, n in enumerate(in_shape) if n == 1}
  return _base.Decision(inputs=[layout], outputs=[tuple(a for d, a in enumerate(layout) if d not in dims)])


@_base.register("Shape", "Size", "Rank", "ShapeN", position_blind=True)
def shape_query(view, layouts):
  """A shape query answers with the GLOBAL shape, whatever the layout (the traced shapes are static).

  ``ShapeN`` asks for several shapes, one per input and output.
  """
  shapes = [view.in_shape(i) for i in range(len(layouts))]
  outputs = view.op.outputs
  if any(_base.UNKNOWN in shape for shape in shapes):  # asked at run time: the local shape, split dims scaled
    if any(layout is None for layout in layouts):
      return _base.fallback(view, layouts)
    scales = [[view.shards(axes) for axes in layout] for layout in layouts]  # a dim of unknown size is whole

    def lower(r, inputs):
      whole = [tf.shape(x, out_type=t.dtype if view.op.type != "Size" else tf.int64) * np.asarray(scale)
               for x, scale, t in zip(inputs, scales, outputs)]  # (ShapeN: an output per input)
      if view.op.type == "Size":
        return [tf.cast(tf.reduce_prod(whole[0]), outputs[0].dtype)]
      if view.op.type == "Rank":
        return [tf.size(whole[0], out_type=tf.int32)]
      return whole

    return _base.Decision(inputs=list(layouts), outputs=[_base.replicated(t.shape.rank) for t in outputs],
                          lower=lower)
  answer = {"Shape": lambda shape: shape, "ShapeN": lambda shape: shape, "Size": math.prod, "Rank": len}[view.op.type]
  return _base.Decision(inputs=[None] * len(layouts), outputs=[_base.replicated(t.shape.rank) for t in outputs],
                        values={k: np.asarray(answer(shape), dtype=t.dtype.as_numpy_dtype)
                                for k, (shape, t) in enumerate(zip(shapes, outputs))})
