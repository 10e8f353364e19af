"""Rules for convolutions, pooling and resizing (channels last): batch and channels split, height and width in tiles.

A convolution is a contraction over its input channels: labelled like an
einsum (input ``nhwc``, filter ``yxco``, output ``npqo``), a split of the
input channels leaves partial sums and a split of the output channels (a
column-split filter) splits the output. The gradients with respect to the
input and the filter are the same contraction read the other way (the
filter's gradient sums over the batch).

Height and width (and a 3-D convolution's depth) split into tiles stay
split: each device runs the op on its tile extended by the boundary rows its
neighbours hold (``_spatial``'s halo exchange: two point-to-point permutes a
dimension, never the whole tile), with ``VALID`` padding, and its piece of
the output is its rows of the op's output. The rows outside the image are
the padding: zeros, or for a max pooling the lowest value (an average
pooling with ``SAME`` padding divides by the rows inside). The gradient with
respect to the input is computed for the window and its rows of the
neighbours' tiles sent back and added there; the filter's gradient is
computed on the window and summed over the tiles (an all-reduce, as over
the batch). A dimension whose output rows do not split evenly into the tiles,
or whose window needs more than a neighbour's tile, is gathered whole first
(``repl.explain`` says why).

A dilated convolution, which TensorFlow runs on CPU as ``SpaceToBatchND``, a
convolution and ``BatchToSpaceND``, keeps its tiles through the three (the
phases' windows are exchanged as a convolution's; the batch is taken whole).
Nearest-neighbour resizing by an integer factor keeps them without
communication.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import tensorflow as tf

from rewrite.rules import _base
from rewrite.rules import _spatial
from rewrite.rules._contraction import contract

_CHANNELS_LAST = (b"NHWC", "NHWC", b"NDHWC", "NDHWC")


def _whole(layout, dims):
  return tuple(() if d in dims else axes for d, axes in enumerate(layout))


def _local_shape(view, index, layout):
  """The constant shape operand ``index`` made local to ``layout``."""
  shape = view.const(index)
  return view.local_shape(shape, layout, shape.dtype)


def _spatial_dims(rank: int) -> tuple:
  return tuple(range(1, rank - 1))


class _Operands:
  """An :class:`_base.OpView` whose operands are the op's inputs ``indices`` (the rest are shape operands)."""

  def __init__(self, view, indices):
    self._view, self._indices = view, indices

  def in_shape(self, i):
    return self._view.in_shape(self._indices[i])

  def __getattr__(self, name):
    return getattr(self._view, name)


# -- tiles -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Slide:
  """How an op slides along its spatial dimensions: per dimension, kernel, stride, dilation and explicit padding."""

  kernel: tuple
  stride: tuple
  dilation: tuple
  padding: str
  explicit: tuple


def _slide(view, kernel) -> _Slide:
  """The sliding of a convolution (``kernel``: its filter's spatial sizes) or, with ``kernel`` None, a pooling."""
  if kernel is None:
    kernel = tuple(view.attr("ksize"))[1:-1]
  stride = tuple(view.attr("strides"))[1:-1]
  try:
    dilation = tuple(view.attr("dilations"))[1:-1]
  except ValueError:  # (a pooling has none)
    dilation = (1,) * len(stride)
  padding = view.attr("padding")
  padding = padding.decode() if isinstance(padding, bytes) else padding
  explicit = ((0, 0),) * len(stride)
  if padding == "EXPLICIT":
    flat = list(view.attr("explicit_paddings"))
    explicit = tuple((flat[2 * d], flat[2 * d + 1]) for d in range(1, len(stride) + 1))
  return _Slide(tuple(kernel), stride, dilation, padding, explicit)


@dataclasses.dataclass
class _Tiles:
  """Per spatial dimension of an op's input, its window; the dimensions kept split, and why others are not."""

  windows: list
  split: dict  # dimension -> mesh axes
  why: list

  def layout(self, layout):
    """``layout`` (the op's batch and channels) with the kept spatial splits."""
    return tuple(self.split.get(d, axes) for d, axes in enumerate(layout))

  def positions(self, mesh, r) -> list:
    return [mesh.axis_index(r, w.axes) if w.axes else 0 for w in self.windows]

  @property
  def axes(self) -> tuple:
    return tuple(a for d in sorted(self.split) for a in self.split[d])


def _tiles(view, size, slide: _Slide, candidates, used) -> _Tiles | None:
  """The windows of an op whose input (global ``size``) takes the spatial splits of the first of ``candidates``.

  ``used``: the mesh axes the op's other dimensions are split over. None if
  no spatial dimension is split (the op is copied as it is).
  """
  rank = len(size)
  if any(size[d] <= 0 for d in _spatial_dims(rank)):
    return None  # (a spatial dimension of unknown size: the op is copied, the dimension whole)
  windows, split, why, used = [], {}, [], set(used)
  for j, d in enumerate(_spatial_dims(rank)):
    axes = _axes(view, candidates, d, rank, used)
    if axes and size[d] % view.shards(axes):
      axes = ()
    used.update(axes)
    args = (size[d], slide.kernel[j], slide.stride[j], slide.dilation[j], slide.padding, slide.explicit[j])
    window, problem = _spatial.sliding(d, axes, view.shards(axes) if axes else 1, *args)
    if window is None and axes:
      why.append(f"dimension {d} split over {', '.join(axes)}, but {problem}")
      window, problem = _spatial.sliding(d, (), 1, *args)
    if window is None:
      return None
    if window.axes:
      split[d] = window.axes
    windows.append(window)
  if not split and not why:
    return None
  return _Tiles(windows, split, why)


def _axes(view, candidates, d, rank, used) -> tuple:
  """The mesh axes that split dimension ``d`` in the first of ``candidates`` (layouts) that splits it, if unused."""
  axes = next((tuple(c[d]) for c in candidates if c is not None and len(c) == rank and c[d]), ())
  return () if set(axes) & set(used) else axes


def _local(view, shape, layout) -> list:
  return [int(n) // view.shards(axes) if axes else int(n) for n, axes in zip(shape, layout)]


def _windowed(tiles: _Tiles, local) -> list:
  """A tile's ``local`` shape with each spatial dimension its window's."""
  shape = list(local)
  for w in tiles.windows:
    shape[w.dim] = w.length
  return shape


def _valid(view):
  """``call(**inputs)``: the op (as ``tf.raw_ops``) with its attributes, but ``VALID`` padding."""
  fn = getattr(tf.raw_ops, view.op.type)
  params = inspect.signature(fn).parameters
  names = [arg.name for arg in view.op.op_def.input_arg]
  attrs = {k: view.attr(k) for k in view.op.node_def.attr if k in params and k not in names}
  attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
  attrs["padding"] = "VALID"
  if "explicit_paddings" in params:
    attrs["explicit_paddings"] = []

  def call(*inputs):
    return fn(**dict(zip(names, inputs)), **attrs)

  return call


def _why(view) -> str:
  return f"{view.op.type} on tiles"


def _itemsize(view, index) -> int:
  return view.op.inputs[index].dtype.size


def _gathered(decision, tiles, index) -> _base.Decision:
  """``decision``, with why input ``index``'s spatial dimensions that could not stay split are gathered."""
  if tiles is not None and tiles.why:
    decision.reasons = {**decision.reasons, index: "; ".join(tiles.why)}
  return decision


def _forward(view, decision, x: int, tiles: _Tiles | None, fill=0, scale=None) -> _base.Decision:
  """``decision`` (batch and channels) with input ``x``'s spatial splits kept: each device runs the op on its window."""
  if tiles is None or not tiles.split:
    return _gathered(decision, tiles, x)
  decision.inputs = list(decision.inputs)
  decision.inputs[x] = tiles.layout(decision.inputs[x])
  decision.outputs = [tiles.layout(decision.outputs[0])]
  call, mesh = _valid(view), view.mesh
  local = _local(view, view.in_shape(x), decision.inputs[x])

  def lower(r, inputs, comm=None):
    positions = tiles.positions(mesh, r)
    inputs = list(inputs)
    inputs[x] = _spatial.extend(inputs[x], tiles.windows, positions, comm, fill)
    y = call(*inputs)
    if scale is not None:
      y = y * tf.constant(scale(positions), y.dtype)
    return [y]

  decision.lower = lower
  decision.communicates = _spatial.exchanges(tiles.windows, local, _itemsize(view, x), _why(view))
  return _gathered(decision, tiles, x)


def _backward(view, decision, dy: int, sizes: int, tiles: _Tiles | None, scale=None) -> _base.Decision:
  """``decision`` of a gradient with respect to an input (``sizes``: its shape operand), tiled as ``dy``.

  Each device computes the gradient with respect to its window, and sends the
  window's rows of its neighbours' tiles back to them (:func:`_spatial.retract`).
  """
  if tiles is None or not tiles.split:
    return _gathered(decision, tiles, dy)
  decision.inputs = list(decision.inputs)
  decision.inputs[dy] = tiles.layout(decision.inputs[dy])
  decision.outputs = [tiles.layout(decision.outputs[0])]
  call, mesh = _valid(view), view.mesh
  window = _windowed(tiles, _local(view, view.out_shape(), decision.outputs[0]))
  shape_dtype = view.op.inputs[sizes].dtype

  def lower(r, inputs, comm=None):
    positions = tiles.positions(mesh, r)
    inputs = list(inputs)
    inputs[sizes] = tf.constant(window, shape_dtype)
    if scale is not None:
      inputs[dy] = inputs[dy] * tf.constant(scale(positions), inputs[dy].dtype)
    return [_spatial.retract(call(*inputs), tiles.windows, positions, comm)]

  decision.lower = lower
  decision.communicates = _spatial.returns(tiles.windows, window, view.op.outputs[0].dtype.size, _why(view))
  return _gathered(decision, tiles, dy)


def _filter(view, decision, x: int, dy: int, tiles: _Tiles | None) -> _base.Decision:
  """``decision`` of a filter's gradient with input ``x`` and ``dy`` tiled: on each window, summed over the tiles."""
  if tiles is None or not tiles.split:
    return _gathered(decision, tiles, x)
  decision.inputs = list(decision.inputs)
  decision.inputs[x] = tiles.layout(decision.inputs[x])
  decision.inputs[dy] = tiles.layout(decision.inputs[dy])
  summed = decision.reduce[0][1] if decision.reduce[0] else ()
  decision.reduce = [("sum", tuple(summed) + tiles.axes)]
  call, mesh = _valid(view), view.mesh
  local = _local(view, view.in_shape(x), decision.inputs[x])

  def lower(r, inputs, comm=None):
    inputs = list(inputs)
    inputs[x] = _spatial.extend(_after(inputs[x], inputs[dy]), tiles.windows, tiles.positions(mesh, r), comm)
    return [call(*inputs)]

  decision.lower = lower
  decision.communicates = _spatial.exchanges(tiles.windows, local, _itemsize(view, x), _why(view))
  return _gathered(decision, tiles, x)


def _after(x, dy):
  """``x``, once ``dy`` is computed too: a gradient's window of the forward's input is made in the backward pass.

  Without it, the window's ops are ready as soon as ``x`` is (in the forward
  pass), and the window would be held until the gradient needs it, as if
  saved for it: a tile and its halo instead of the tile.
  """
  return tf.raw_ops.IdentityN(input=[x, dy])[0]


def _used(*layouts) -> set:
  return {a for layout in layouts for a in _base.axes_in(layout)}


# -- convolutions ------------------------------------------------------------------

_LABELS = {4: ("nhwi", "yxio", "npqo"), 5: ("ndhwi", "zyxio", "nkpqo")}  # input, filter, output


def _labels(view, rank):
  if view.attr("data_format") not in _CHANNELS_LAST or rank not in _LABELS:
    return None
  return _LABELS[rank]


def _contracted(view, layouts, rank, roles: dict, result: int, shape_index=None):
  """A convolution (or one of its gradients) as a contraction, spatial dimensions whole; None if it is not one.

  ``roles``: input index -> its operand's role (0 the input, 1 the filter, 2 the output, as ``_LABELS``);
  ``result``: the role of the op's result; ``shape_index``: the input stating the result's shape (a
  gradient's), made local to the result's layout.
  """
  labels = _labels(view, rank)
  if labels is None or (shape_index is not None and view.const(shape_index) is None):
    return None
  spatial = _spatial_dims(rank)
  whole = [_whole(layouts[i], range(rank - 2) if role == 1 else spatial) for i, role in roles.items()]
  target = view if shape_index is None else _Operands(view, tuple(roles))
  decision = contract(target, whole, [labels[role] for role in roles.values()], labels[result])
  if decision.fallback or shape_index is None:
    return decision
  taken = iter(decision.inputs)
  decision.inputs = [None if i == shape_index else next(taken) for i in range(len(roles) + 1)]
  decision.consts = {shape_index: _local_shape(view, shape_index, decision.outputs[0])}
  return decision


@_base.register("Conv2D", "Conv3D")
def conv(view, layouts):
  decision = _contracted(view, layouts, len(view.in_shape(0)), {0: 0, 1: 1}, 2)
  if decision is None or decision.fallback:
    return decision or _base.fallback(view, layouts)
  tiles = _tiles(view, view.in_shape(0), _slide(view, view.in_shape(1)[:-2]), [layouts[0], view.want()],
                 _used(*decision.inputs, *decision.outputs))
  return _forward(view, decision, 0, tiles)


@_base.register("Conv2DBackpropInput", "Conv3DBackpropInputV2")
def conv_backprop_input(view, layouts):
  decision = _contracted(view, layouts, len(view.in_shape(2)), {1: 1, 2: 2}, 0, shape_index=0)
  if decision is None or decision.fallback:
    return decision or _base.fallback(view, layouts)
  size = [int(n) for n in view.const(0)]
  tiles = _tiles(view, size, _slide(view, view.in_shape(1)[:-2]), [layouts[2], view.want()],
                 _used(*decision.inputs[1:], *decision.outputs))
  return _backward(view, decision, 2, 0, tiles)


@_base.register("Conv2DBackpropFilter", "Conv3DBackpropFilterV2")
def conv_backprop_filter(view, layouts):
  decision = _contracted(view, layouts, len(view.in_shape(0)), {0: 0, 2: 2}, 1, shape_index=1)
  if decision is None or decision.fallback:
    return decision or _base.fallback(view, layouts)
  filter_size = [int(n) for n in view.const(1)]
  tiles = _tiles(view, view.in_shape(0), _slide(view, filter_size[:-2]), [layouts[0], layouts[2]],
                 _used(decision.inputs[0], decision.inputs[2], *decision.outputs))
  return _filter(view, decision, 0, 2, tiles)


def _depthwise_splits(batch_layouts, channel_splits):
  """Batch from the data, channels from the first operand that splits them (space and multiplier whole).

  A depthwise convolution's output channel ``c * multiplier + m`` comes from
  input channel ``c`` alone, so a block of input channels gives a contiguous
  block of output channels: no communication.
  """
  n = next((layout[0] for layout in batch_layouts if layout[0]), ())
  c = next((a for a in channel_splits if a and set(a).isdisjoint(n)), ())
  return n, c


@_base.register("DepthwiseConv2dNative")
def depthwise(view, layouts):
  if view.attr("data_format") not in _CHANNELS_LAST:
    return _base.fallback(view, layouts)
  x, f = layouts
  n, c = _depthwise_splits([x], [x[3], f[2]])
  decision = _base.Decision(inputs=[(n, (), (), c), ((), (), c, ())], outputs=[(n, (), (), c)])
  tiles = _tiles(view, view.in_shape(0), _slide(view, view.in_shape(1)[:2]), [x, view.want()], set(n) | set(c))
  return _forward(view, decision, 0, tiles)


@_base.register("DepthwiseConv2dNativeBackpropInput")
def depthwise_backprop_input(view, layouts):
  if view.attr("data_format") not in _CHANNELS_LAST or view.const(0) is None:
    return _base.fallback(view, layouts)
  _, f, dy = layouts
  n, c = _depthwise_splits([dy], [f[2], dy[3]])
  out = (n, (), (), c)
  decision = _base.Decision(inputs=[None, ((), (), c, ()), out], outputs=[out], consts={0: _local_shape(view, 0, out)})
  size = [int(k) for k in view.const(0)]
  tiles = _tiles(view, size, _slide(view, view.in_shape(1)[:2]), [dy, view.want()], set(n) | set(c))
  return _backward(view, decision, 2, 0, tiles)


@_base.register("DepthwiseConv2dNativeBackpropFilter")
def depthwise_backprop_filter(view, layouts):
  if view.attr("data_format") not in _CHANNELS_LAST or view.const(1) is None:
    return _base.fallback(view, layouts)
  x, _, dy = layouts
  n, c = _depthwise_splits([x, dy], [x[3], dy[3]])
  out = ((), (), c, ())
  decision = _base.Decision(inputs=[(n, (), (), c), None, (n, (), (), c)], outputs=[out],
                            reduce=[("sum", n) if n else None], consts={1: _local_shape(view, 1, out)})
  filter_size = [int(k) for k in view.const(1)]
  tiles = _tiles(view, view.in_shape(0), _slide(view, filter_size[:2]), [x, dy], set(n) | set(c))
  return _filter(view, decision, 0, 2, tiles)


# -- pooling -----------------------------------------------------------------------


def _lowest(dtype):
  return tf.as_dtype(dtype).min


def _average_scale(view, tiles, slide):
  """For an average pooling with ``SAME`` padding: per device, kernel size over the rows inside its windows."""
  if tiles is None or slide.padding != "SAME":
    return None
  rank = len(view.in_shape(1 if view.op.type.endswith("Grad") else 0))
  area = float(np.prod(slide.kernel))

  def scale(positions):
    return area / _spatial.counts(tiles.windows, positions, slide.kernel, slide.stride, rank)

  return scale


@_base.register("MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D")
def pool(view, layouts):
  if view.attr("data_format") not in _CHANNELS_LAST:
    return _base.fallback(view, layouts)
  rank = len(view.in_shape(0))
  spatial = _spatial_dims(rank)
  layout = _base.with_wanted(_whole(layouts[0], spatial), _whole(view.want(), spatial) if view.want() else None)
  decision = _base.Decision(inputs=[layout], outputs=[layout])
  slide = _slide(view, None)
  tiles = _tiles(view, view.in_shape(0), slide, [layouts[0], view.want()], _used(layout))
  if view.op.type.startswith("MaxPool"):
    return _forward(view, decision, 0, tiles, fill=_lowest(view.op.inputs[0].dtype))
  return _forward(view, decision, 0, tiles, scale=_average_scale(view, tiles, slide))


@_base.register("MaxPoolGrad", "MaxPool3DGrad")
def max_pool_grad(view, layouts):
  if view.attr("data_format") not in _CHANNELS_LAST:
    return _base.fallback(view, layouts)
  layout = _first(layouts, view.want())
  decision = _base.Decision(inputs=[layout] * 3, outputs=[layout])
  tiles = _tiles(view, view.in_shape(0), _slide(view, None), [layouts[0], layouts[2], view.want()], _used(layout))
  if tiles is None or not tiles.split:
    return _gathered(decision, tiles, 0)
  decision.inputs = [tiles.layout(layout)] * 3
  decision.outputs = [tiles.layout(layout)]
  call, mesh = _valid(view), view.mesh
  local = _local(view, view.in_shape(0), decision.inputs[0])
  fill = _lowest(view.op.inputs[0].dtype)

  def lower(r, inputs, comm=None):
    x, y, dy = inputs
    positions = tiles.positions(mesh, r)
    window = _spatial.extend(_after(x, dy), tiles.windows, positions, comm, fill)
    return [_spatial.retract(call(window, y, dy), tiles.windows, positions, comm)]

  itemsize, why = _itemsize(view, 0), _why(view)
  decision.lower = lower
  decision.communicates = (_spatial.exchanges(tiles.windows, local, itemsize, why)
                           + _spatial.returns(tiles.windows, _windowed(tiles, local), itemsize, why))
  return _gathered(decision, tiles, 0)


@_base.register("AvgPoolGrad", "AvgPool3DGrad")
def avg_pool_grad(view, layouts):
  if view.attr("data_format") not in _CHANNELS_LAST or view.const(0) is None:
    return _base.fallback(view, layouts)
  layout = _first(layouts[1:], view.want())
  decision = _base.Decision(inputs=[None, layout], outputs=[layout], consts={0: _local_shape(view, 0, layout)})
  slide = _slide(view, None)
  size = [int(n) for n in view.const(0)]
  tiles = _tiles(view, size, slide, [layouts[1], view.want()], _used(layout))
  return _backward(view, decision, 1, 0, tiles, scale=_average_scale(view, tiles, slide))


def _first(layouts, want):
  """Batch and channels: the first split an input has (space whole)."""
  n = next((x[0] for x in layouts if x[0]), ())
  c = next((x[-1] for x in layouts if x[-1] and set(x[-1]).isdisjoint(n)), ())
  layout = (n,) + ((),) * (len(layouts[0]) - 2) + (c,)
  return _base.with_wanted(layout, _whole(want, range(1, len(layout) - 1)) if want else None)


# -- dilation as space to batch ----------------------------------------------------


def _blocks(view):
  """``(block shape, paddings or crops)`` of a ``SpaceToBatchND`` or ``BatchToSpaceND``, or None if not constant."""
  block, pads = view.const(1), view.const(2)
  if block is None or pads is None:
    return None
  return [int(b) for b in block], [(int(lo), int(hi)) for lo, hi in pads]


@_base.register("SpaceToBatchND")
def space_to_batch(view, layouts):
  """A dilated convolution's first step (``tf.nn.convolution`` on CPU): tiles stay tiles of the phases.

  ``[n, h, w, c]`` padded and cut into ``b x b`` phases (``[b * b * n, (h +
  pads) / b, ...]``): device ``p``'s rows of the output are rows ``[p * o
  * b - pad, (p + 1) * o * b - pad)`` of the input (``o`` output rows a
  device), a window as a convolution's, made by the halo exchange, then cut
  locally without padding. The batch is taken whole (the output's batch is
  the phases, each of every image).
  """
  found = _blocks(view)
  layout = layouts[0]
  if found is None or layout is None:
    return _base.fallback(view, layouts)
  block, pads = found
  size, rank = view.in_shape(0), len(layout)
  spatial = range(1, len(block) + 1)
  need = ((),) + tuple(() if d in spatial else axes for d, axes in enumerate(layout) if d)
  decision = _base.Decision(inputs=[need, None, None], outputs=[need])
  used, candidates = set(_base.axes_in(need)), [layout, view.want()]
  windows, split, why = [], {}, []
  for j, d in enumerate(spatial):
    axes = _axes(view, candidates, d, rank, used)
    used.update(axes)
    pieces = view.shards(axes) if axes else 1
    padded = size[d] + pads[j][0] + pads[j][1]
    rows, window, problem = padded // block[j], None, ""
    if axes and (size[d] % pieces or rows % pieces):
      problem = f"its {rows} output rows do not split into {pieces} equal pieces"
    elif axes:
      o = rows // pieces
      window = _spatial.Window(d, axes, pieces, size[d], -pads[j][0], o * block[j], o * block[j])
      problem = window.problem
    if axes and problem:
      why.append(f"dimension {d} split over {', '.join(axes)}, but {problem}")
      window = None
    if window is None:
      window = _spatial.Window(d, (), 1, size[d], -pads[j][0], 0, padded)
    else:
      split[d] = window.axes
    windows.append(window)
  tiles = _Tiles(windows, split, why)
  if not split:
    return _gathered(decision, tiles, 0)
  zeros = [[0, 0]] * len(block)
  return _on_extended(view, decision, tiles, need, windows, size, lambda x: tf.space_to_batch_nd(x, block, zeros),
                      "SpaceToBatchND on tiles")


def _on_extended(view, decision, tiles, need, windows, size, apply, what):
  """``decision`` made to run ``apply`` on each device's tile extended by its halo (``windows``), as ``what``."""
  decision.inputs = [tiles.layout(need), None, None]
  decision.outputs = [tiles.layout(need)]
  mesh, local = view.mesh, _local(view, size, decision.inputs[0])

  def lower(r, inputs, comm=None):
    return [apply(_spatial.extend(inputs[0], windows, tiles.positions(mesh, r), comm))]

  decision.lower = lower
  decision.communicates = _spatial.exchanges(windows, local, _itemsize(view, 0), what)
  return _gathered(decision, tiles, 0)


@_base.register("BatchToSpaceND")
def batch_to_space(view, layouts):
  """A dilated convolution's last step: the phases interleaved back into tiles of the image, cropped.

  Device ``p``'s ``hout`` rows of the output come from ``hout / b`` rows of
  each phase (a window of the input's tiles, by the halo exchange if the
  crops shift it), interleaved and cropped locally. Needs ``hout`` to be a
  multiple of the block; the batch is taken whole.
  """
  found = _blocks(view)
  layout = layouts[0]
  if found is None or layout is None:
    return _base.fallback(view, layouts)
  block, crops = found
  size, out_size, rank = view.in_shape(0), view.out_shape(), len(layout)
  spatial = range(1, len(block) + 1)
  need = ((),) + tuple(() if d in spatial else axes for d, axes in enumerate(layout) if d)
  decision = _base.Decision(inputs=[need, None, None], outputs=[need])
  used, candidates = set(_base.axes_in(need)), [layout, view.want()]
  windows, split, why, local_crops = [], {}, [], []
  for j, d in enumerate(spatial):
    axes = _axes(view, candidates, d, rank, used)
    used.update(axes)
    pieces = view.shards(axes) if axes else 1
    b, (before, _) = block[j], crops[j]
    window, problem = None, ""
    if axes and (out_size[d] % pieces or size[d] % pieces or (out_size[d] // pieces) % b):
      problem = (f"its {out_size[d]} output rows do not split into {pieces} pieces of a multiple of the block "
                 f"({b})")
    elif axes:
      rows = out_size[d] // pieces
      length = -(-(rows + before % b) // b)
      window = _spatial.Window(d, axes, pieces, size[d], before // b, rows // b, length)
      problem = window.problem
    if axes and problem:
      why.append(f"dimension {d} split over {', '.join(axes)}, but {problem}")
      window = None
    rows = out_size[d] // (window.pieces if window is not None else 1)
    if window is None:
      length = -(-(rows + before % b) // b)
      window = _spatial.Window(d, (), 1, size[d], before // b, 0, length)
    else:
      split[d] = window.axes
    windows.append(window)
    local_crops.append([before % b, window.length * b - rows - before % b])
  tiles = _Tiles(windows, split, why)
  if not split:
    return _gathered(decision, tiles, 0)
  return _on_extended(view, decision, tiles, need, windows, size, lambda x: tf.batch_to_space(x, block, local_crops),
                      "BatchToSpaceND on tiles")


# -- nearest-neighbour resizing ----------------------------------------------------


@_base.register("ResizeNearestNeighbor", "ResizeNearestNeighborGrad")
def resize_nearest(view, layouts):
  """Nearest-neighbour resizing by an integer factor (up or down): tiles stay tiles, no communication.

  Without ``align_corners``, output row ``i`` reads input row ``i // f``
  (``f`` times larger; with ``half_pixel_centers`` too, ``floor((i + 0.5) /
  f)`` is the same row) or ``i * f`` (``+ f // 2`` with half-pixel centers;
  ``f`` times smaller): a tile of the output reads the same device's tile of
  the input, when both split evenly. The gradient (``...Grad``) sums a tile's
  rows into the same tile. Batch and channels keep their splits; a dimension
  whose sizes are not in an integer ratio is taken whole.
  """
  layout, size = layouts[0], view.const(1)
  if layout is None or size is None or len(layout) != 4:
    return _base.fallback(view, layouts)
  in_shape, out_shape = view.in_shape(0), view.out_shape()
  want = view.want()
  whole_ratio = not view.attr("align_corners")
  out = list(_base.with_wanted(layout, want if want is not None and len(want) == 4 else None))
  for d in (1, 2):
    axes = out[d]
    k = view.shards(axes) if axes else 1
    a, b = in_shape[d], out_shape[d]
    if axes and not (whole_ratio and a > 0 and b > 0 and (a % b == 0 or b % a == 0) and a % k == 0 and b % k == 0):
      out[d] = ()
  used = [a for axes in out for a in axes]
  if len(used) != len(set(used)):
    out = list(layout[:1]) + [(), ()] + list(layout[3:])
  out = tuple(out)
  return _base.Decision(inputs=[out, None], outputs=[out],
                        consts={1: view.local_shape(size, out[1:3], size.dtype)})
