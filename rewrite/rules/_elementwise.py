"""Rules for elementwise ops (with broadcasting): the output takes its inputs' splits."""

from __future__ import annotations

from rewrite.rules import _base

UNARY = ("Identity", "Relu", "Neg", "Sqrt", "Rsqrt", "Square", "Cast", "Exp", "Log", "Abs", "Sign",
         "Tanh", "Sigmoid", "Reciprocal", "StopGradient", "Softplus", "Floor", "Round", "ZerosLike",
         "OnesLike", "Log1p", "Elu", "Relu6", "LeakyRelu", "Erf", "Erfc", "Expm1", "Selu", "Softsign", "Sin",
         "Cos", "Ceil", "Inv", "IsFinite", "IsNan", "IsInf", "LogicalNot", "CheckNumerics", "Snapshot",
         "PreventGradient", "Atan", "Asinh", "Erfinv", "Rint", "Invert")
BINARY = ("AddV2", "Add", "Sub", "Mul", "RealDiv", "DivNoNan", "Pow", "Maximum", "Minimum",
          "SquaredDifference", "ReluGrad", "Relu6Grad", "EluGrad", "TanhGrad", "SigmoidGrad",
          "SqrtGrad", "RsqrtGrad", "MulNoNan", "FloorDiv", "FloorMod", "Equal", "NotEqual", "Less",
          "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "SelectV2", "LeakyReluGrad",
          "AddN", "SeluGrad", "SoftplusGrad", "SoftsignGrad", "ReciprocalGrad", "Xdivy", "Xlogy", "Atan2",
          "ClipByValue", "TruncateDiv", "TruncateMod", "BitwiseAnd", "BitwiseOr", "BitwiseXor")


def broadcast(view: _base.OpView, layouts: list, shapes: list, out_shape: list) -> tuple:
  """The output layout of a broadcasting op, and the layout each input must have.

  Each output dimension takes the split of the first input that splits it at
  full size; dimensions no input splits take the split the consumers want
  (the inputs are then sliced, for free, instead of the output).
  """
  rank = len(out_shape)
  out = [()] * rank
  used: set = set()
  for j in range(rank):  # each output dim takes the first split among inputs of full size there
    for layout, shape in zip(layouts, shapes):
      i = j - (rank - len(shape))
      if layout is None or i < 0 or shape[i] != out_shape[j] or not layout[i]:
        continue
      if used.isdisjoint(layout[i]):
        out[j] = layout[i]
        used.update(layout[i])
      break
  out = list(_base.with_wanted(tuple(out), view.want()))
  want = view.want()
  if want is not None and len(want) == rank:
    # A dimension the consumers want whole, split in one input only: gather that input instead of the output
    # (as cheap, and the gather moves up to where several consumers can share it: a gradient that feeds both
    # of Adam's slot updates is gathered once).
    for j in range(rank):
      split = [k for k, (layout, shape) in enumerate(zip(layouts, shapes))
               if layout is not None and j - (rank - len(shape)) >= 0 and layout[j - (rank - len(shape))]
               and shape[j - (rank - len(shape))] == out_shape[j]]
      if out[j] and not want[j] and len(split) <= 1:
        out[j] = ()
  required = []
  for shape in shapes:
    offset = rank - len(shape)
    required.append(tuple(() if shape[i] == 1 and out_shape[i + offset] != 1 else out[i + offset]
                          for i in range(len(shape))))
  return tuple(out), required


@_base.register(*UNARY, position_blind=True)
def unary(view, layouts):
  layout = _base.with_wanted(layouts[0], view.want())
  want = view.want()
  if want is not None and layout is not None and len(want) == len(layout):  # wanted whole: gather the input
    layout = tuple(() if not w else axes for axes, w in zip(layout, want))
  return _base.Decision(inputs=[layout], outputs=[layout])


@_base.register(*BINARY, position_blind=True)
def binary(view, layouts):
  shapes = [view.in_shape(i) for i in range(len(layouts))]
  out, required = broadcast(view, layouts, shapes, view.out_shape())
  return _base.Decision(inputs=required, outputs=[out])


@_base.register("Select", position_blind=True)
def select(view, layouts):
  """``Select`` (v1): elementwise when the condition has the values' shape (a rank-1 one picks rows: fallback)."""
  if len({len(view.in_shape(i)) for i in range(3)}) != 1:
    return _base.fallback(view, layouts)
  return binary(view, layouts)


@_base.register("BiasAdd", position_blind=True)
def bias_add(view, layouts):
  if view.attr("data_format") not in (b"NHWC", "NHWC"):
    return _base.fallback(view, layouts)
  value, bias = layouts
  shapes = [view.in_shape(0), view.in_shape(1)]
  out, required = broadcast(view, [value, bias], shapes, view.out_shape())
  return _base.Decision(inputs=required, outputs=[out])


@_base.register("IdentityN", position_blind=True)
def identity_n(view, layouts):
  layouts = [_base.with_wanted(layout, view.want(k)) for k, layout in enumerate(layouts)]
  return _base.Decision(inputs=list(layouts), outputs=list(layouts))
