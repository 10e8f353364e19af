"""Rules for convolutions and pooling (NHWC): batch and channels split, spatial dimensions whole.

A convolution is a contraction over its input channels: labelled like an
einsum (input ``nhwc``, filter ``yxco``, output ``npqo``) with the spatial
labels never split, a split of the input channels leaves partial sums and a
split of the output channels (a column-split filter) splits the output. The
gradients with respect to the input and the filter are the same contraction
read the other way (the filter's gradient sums over the batch). Spatial
partitioning (halo exchange) is not supported: a split height or width is
gathered first.
"""

from __future__ import annotations

from rewrite.rules import _base
from rewrite.rules._contraction import contract

_NHWC = (b"NHWC", "NHWC")


def _whole(layout, dims):
  return tuple(() if d in dims else axes for d, axes in enumerate(layout))


def _local_shape(view, index, layout):
  """The constant shape operand ``index`` made local to ``layout``."""
  shape = view.const(index)
  return view.local_shape(shape, layout, shape.dtype)


@_base.register("Conv2D")
def conv2d(view, layouts):
  if view.attr("data_format") not in _NHWC:
    return _base.fallback(view, layouts)
  x, f = _whole(layouts[0], (1, 2)), _whole(layouts[1], (0, 1))
  return contract(view, [x, f], ["nhwc", "yxco"], "npqo")


@_base.register("Conv2DBackpropInput")
def conv2d_backprop_input(view, layouts):
  if view.attr("data_format") not in _NHWC or view.const(0) is None:
    return _base.fallback(view, layouts)
  f, dy = _whole(layouts[1], (0, 1)), _whole(layouts[2], (1, 2))
  decision = contract(_Operands(view, (1, 2)), [f, dy], ["yxco", "npqo"], "nhwc")
  decision.inputs = [None] + decision.inputs
  decision.consts = {0: _local_shape(view, 0, decision.outputs[0])}
  return decision


@_base.register("Conv2DBackpropFilter")
def conv2d_backprop_filter(view, layouts):
  if view.attr("data_format") not in _NHWC or view.const(1) is None:
    return _base.fallback(view, layouts)
  x, dy = _whole(layouts[0], (1, 2)), _whole(layouts[2], (1, 2))
  decision = contract(_Operands(view, (0, 2)), [x, dy], ["nhwc", "npqo"], "yxco")
  decision.inputs = [decision.inputs[0], None, decision.inputs[1]]
  decision.consts = {1: _local_shape(view, 1, decision.outputs[0])}
  return decision


class _Operands:
  """An :class:`_base.OpView` whose operands are the op's inputs ``indices`` (the rest are shape operands)."""

  def __init__(self, view, indices):
    self._view, self._indices = view, indices

  def in_shape(self, i):
    return self._view.in_shape(self._indices[i])

  def __getattr__(self, name):
    return getattr(self._view, name)


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
  if view.attr("data_format") not in _NHWC:
    return _base.fallback(view, layouts)
  x, f = layouts
  n, c = _depthwise_splits([x], [x[3], f[2]])
  return _base.Decision(inputs=[(n, (), (), c), ((), (), c, ())], outputs=[(n, (), (), c)])


@_base.register("DepthwiseConv2dNativeBackpropInput")
def depthwise_backprop_input(view, layouts):
  if view.attr("data_format") not in _NHWC or view.const(0) is None:
    return _base.fallback(view, layouts)
  _, f, dy = layouts
  n, c = _depthwise_splits([dy], [f[2], dy[3]])
  out = (n, (), (), c)
  return _base.Decision(inputs=[None, ((), (), c, ()), out], outputs=[out], consts={0: _local_shape(view, 0, out)})


@_base.register("DepthwiseConv2dNativeBackpropFilter")
def depthwise_backprop_filter(view, layouts):
  if view.attr("data_format") not in _NHWC or view.const(1) is None:
    return _base.fallback(view, layouts)
  x, _, dy = layouts
  n, c = _depthwise_splits([x, dy], [x[3], dy[3]])
  out = ((), (), c, ())
  return _base.Decision(inputs=[(n, (), (), c), None, (n, (), (), c)], outputs=[out],
                        reduce=[("sum", n) if n else None], consts={1: _local_shape(view, 1, out)})


@_base.register("MaxPool", "AvgPool")
def pool(view, layouts):
  if view.attr("data_format") not in _NHWC:
    return _base.fallback(view, layouts)
  layout = _base.with_wanted(_whole(layouts[0], (1, 2)), _whole(view.want(), (1, 2)) if view.want() else None)
  return _base.Decision(inputs=[layout], outputs=[layout])


@_base.register("MaxPoolGrad")
def max_pool_grad(view, layouts):
  if view.attr("data_format") not in _NHWC:
    return _base.fallback(view, layouts)
  layout = _first(layouts, view.want())
  return _base.Decision(inputs=[layout] * 3, outputs=[layout])


@_base.register("AvgPoolGrad")
def avg_pool_grad(view, layouts):
  if view.attr("data_format") not in _NHWC or view.const(0) is None:
    return _base.fallback(view, layouts)
  layout = _first(layouts[1:], view.want())
  return _base.Decision(inputs=[None, layout], outputs=[layout], consts={0: _local_shape(view, 0, layout)})


def _first(layouts, want):
  """Batch and channels: the first split an input has (space whole)."""
  n = next((x[0] for x in layouts if x[0]), ())
  c = next((x[3] for x in layouts if x[3] and set(x[3]).isdisjoint(n)), ())
  layout = (n, (), (), c)
  return _base.with_wanted(layout, _whole(want, (1, 2)) if want else None)
