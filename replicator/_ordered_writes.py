"""All-or-nothing without copies: a step's writes wait for every op of the step that can fail.

A call of a step is all or nothing (``Replicator(atomic=True)``): if it fails
at run time, no variable is written on any device. TensorFlow aborts a call
at its first failing op, so a write that runs only after every op that can
fail has run can never be half of a failed call: there is nothing to undo,
and nothing to keep. This module finds, in the traced step, which ops can fail
and which ops write the step's variables, and makes each write wait for all
of those (control edges through one ``NoOp`` per device: a few edges between
devices in all, none per variable). Most training steps read their input,
compute, and write at the end: every write can wait, and the step costs what
it costs without the guarantee.

A write cannot wait for an op that comes after it (an op that reads the new
value and may fail: a check of the updated weights, a collective over another
process that reads them, a ``tf.cond`` or loop around the writes, a scatter
whose indices may be out of range, which writes the rows before a bad one):
the variables of such writes are *kept* instead, their values before the
call held by ``_atomic.Snapshot`` as before (a read and a copy on the first
in-place update). Calls of several steps (an in-graph loop) keep every
variable they write: a later step's failure comes after an earlier step's
writes.

Which ops cannot fail is a list (:data:`_CANNOT_FAIL`): arithmetic, matrix
products, convolutions, reductions, reshapes and the like, and only when
every tensor they take and give has a fully defined static shape (TensorFlow
then checked the shapes when the step was traced); integer division (by
zero), integer powers (negative exponents), slices with computed bounds,
gathers and scatters (indices), labels of a sparse cross-entropy, asserts,
numeric checks, function calls and everything not listed can fail. A
collective can fail when its shapes are not static (replicas may differ at
run time) or when its group spans processes (a peer may be gone).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Iterable

import tensorflow as tf

# Ops that cannot fail when every non-resource tensor they take and give has a fully defined shape.
_CANNOT_FAIL = frozenset({
    # elementwise
    "Abs", "Acos", "Acosh", "Add", "AddN", "AddV2", "ApproximateEqual", "Asin", "Asinh", "Atan", "Atan2", "Atanh",
    "BiasAdd", "BiasAddGrad", "BiasAddV1", "Cast", "Ceil", "ClipByValue", "Complex", "ComplexAbs", "Conj", "Cos",
    "Cosh", "Div", "DivNoNan", "Elu", "EluGrad", "Equal", "Erf", "Erfc", "Exp", "Expm1", "Floor", "FloorDiv",
    "FloorMod", "Gelu", "GeluGrad", "Greater", "GreaterEqual", "Imag", "Inv", "InvGrad", "IsFinite", "IsInf", "IsNan",
    "LeakyRelu", "LeakyReluGrad", "Less", "LessEqual", "Lgamma", "Log", "Log1p", "LogicalAnd", "LogicalNot",
    "LogicalOr", "Maximum", "Minimum", "Mod", "Mul", "MulNoNan", "Neg", "NotEqual", "Pow", "Real", "RealDiv",
    "Reciprocal", "ReciprocalGrad", "Relu", "Relu6", "Relu6Grad", "ReluGrad", "Rint", "Round", "Rsqrt", "RsqrtGrad",
    "Select", "SelectV2", "Selu", "SeluGrad", "Sigmoid", "SigmoidGrad", "Sign", "Sin", "Sinh", "Softplus",
    "SoftplusGrad", "Softsign", "SoftsignGrad", "Sqrt", "SqrtGrad", "Square", "SquaredDifference", "Sub", "Tan",
    "Tanh", "TanhGrad", "TruncateDiv", "TruncateMod", "Xdivy", "Xlog1py", "Xlogy", "ZerosLike", "OnesLike",
    # products, convolutions, pooling, normalization
    "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput",
    "Conv3D", "Conv3DBackpropFilterV2", "Conv3DBackpropInputV2", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropFilter", "DepthwiseConv2dNativeBackpropInput", "Einsum", "MatMul",
    "AvgPool", "AvgPoolGrad", "MaxPool", "MaxPoolGrad", "MaxPoolV2", "MaxPoolGradV2", "FusedBatchNorm",
    "FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3", "FusedBatchNormV2", "FusedBatchNormV3",
    "L2Loss", "LogSoftmax", "Softmax", "SoftmaxCrossEntropyWithLogits",
    # reductions and scans
    "All", "Any", "ArgMax", "ArgMin", "Cumprod", "Cumsum", "EuclideanNorm", "Max", "Mean", "Min", "Prod", "Sum",
    # shapes and layout
    "BroadcastArgs", "BroadcastGradientArgs", "BroadcastTo", "Concat", "ConcatOffset", "ConcatV2", "ExpandDims",
    "Fill", "InvertPermutation", "MirrorPad", "MirrorPadGrad", "Pack", "Pad", "PadV2", "Reshape", "Reverse",
    "ReverseV2", "Split", "SplitV", "Squeeze", "Tile", "TileGrad", "Transpose", "Unpack", "OneHot",
    "Slice", "StridedSlice", "StridedSliceGrad",
    # random numbers from explicit seeds
    "StatelessRandomGetKeyCounter", "StatelessRandomNormalV2", "StatelessRandomUniformFullIntV2",
    "StatelessRandomUniformIntV2", "StatelessRandomUniformV2", "StatelessTruncatedNormalV2",
    "StatelessRandomNormal", "StatelessRandomUniform", "StatelessTruncatedNormal",
    # writes of a whole variable (a value of the variable's static shape)
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
})
# Ops that cannot fail whatever the shapes.
_NEVER_FAIL = frozenset({"Const", "Placeholder", "PlaceholderWithDefault", "Identity", "IdentityN", "NoOp", "ReadVariableOp", "StopGradient", "Snapshot",
                         "Shape", "ShapeN", "Size", "Rank", "VarIsInitializedOp", "VariableShape",
                         "PreventGradient"})
# Listed ops that fail for integer operands (division by zero; negative integer powers).
_FLOATS_ONLY = frozenset({"Div", "FloorDiv", "FloorMod", "Mod", "TruncateDiv", "TruncateMod", "Pow", "Reciprocal",
                          "Inv"})
# Listed ops whose other operands are bounds or sizes: listed only when those are constants.
_CONSTANT_OPERANDS = frozenset({"Slice", "StridedSlice", "StridedSliceGrad", "OneHot"})
# Ops through which a resource handle passes unchanged.
_FORWARDS = frozenset({"Identity", "IdentityN"})
# Ops that only read a variable through its handle.
_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp"})

GATE_SCOPE = "replicator_ordered_writes"


def can_fail(op: tf.Operation) -> bool:
  """Whether ``op`` (of a traced step, not a collective's stand-in) may fail at run time."""
  if op.type in _NEVER_FAIL:
    return False
  if op.type not in _CANNOT_FAIL:
    return True
  tensors = [t for t in op.inputs if t.dtype != tf.resource] + list(op.outputs)
  if not all(t.shape.is_fully_defined() for t in tensors):
    return True
  if op.type in _FLOATS_ONLY and not (op.inputs[0].dtype.is_floating or op.inputs[0].dtype.is_complex):
    return True
  return op.type in _CONSTANT_OPERANDS and any(t.op.type != "Const" for t in op.inputs[1:])


_COLLECTIVE = re.compile(r"^(?:.*/)?replicator_rewrite_*/(\d+)_[a-z_]+/")
_EXTERNAL = re.compile(r"^(?:.*/)?replicator_rewrite_*/external/")


def collective_can_fail(collective) -> bool:
  """Whether a planned collective may fail at run time: shapes known only then, or a group across processes."""
  members = collective.members
  static = all(m.shape.is_fully_defined() and m.input_shape.is_fully_defined() for m in members)
  return not static or len({_task(m.device) for m in members}) > 1


def _task(device: str) -> tuple:
  spec = tf.DeviceSpec.from_string(device or "")
  return spec.job, spec.replica, spec.task


def classifier(plan, traced: Callable[[str], "tf.Operation | None"]) -> Callable:
  """``fails(node)`` for the nodes of a rewritten step GraphDef.

  Args:
    plan: the rewrite's plan (its collectives' nodes are named by their index).
    traced: node name -> the traced op it is (or copies), with its static
      shapes; None for a node made after the trace (treated by its type, as if
      its shapes were unknown).
  """
  fallible = [collective_can_fail(c) for c in plan.collectives]

  def fails(node) -> bool:
    found = _COLLECTIVE.match(node.name)
    if found is not None:
      return fallible[int(found.group(1))]
    if _EXTERNAL.match(node.name) or node.op in _NEVER_FAIL:
      return False
    op = traced(node.name)
    return True if op is None else can_fail(op)

  return fails


@dataclasses.dataclass
class Gates:
  """What :func:`analyse` found.

  Attributes:
    waits: device -> the names of the ops there that can fail.
    gated: device -> the names of the writes there that wait for all of them.
    kept: the written placeholders whose values must still be kept (a write of
      theirs comes before an op that can fail, or can fail itself).
  """

  waits: dict[str, list[str]]
  gated: dict[str, list[str]]
  kept: set[str]


def _ref(name: str) -> str:
  return name[1:] if name.startswith("^") else name.split(":")[0]


def analyse(graph_def, written: Iterable[str], fails: Callable) -> Gates:
  """Which writes of ``graph_def`` can wait for every op that can fail, and which written placeholders to keep.

  Args:
    graph_def: the step after the rewrite (a nested function's call is one node).
    written: the names of the placeholder nodes (handles) whose variables the step writes.
    fails: ``fails(node)``: whether a node may fail at run time (:func:`classifier`).
  """
  nodes = {node.name: node for node in graph_def.node}
  successors: dict[str, list[str]] = {name: [] for name in nodes}
  for node in graph_def.node:
    for ref in node.input:
      source = _ref(ref)
      if source in successors:
        successors[source].append(node.name)
  failing = {name for name, node in nodes.items() if fails(node)}
  # before_failure[n]: an op that can fail depends on n (a depth-first pass, each node once).
  before_failure: dict[str, bool] = {}
  for root in nodes:
    if root in before_failure:
      continue
    before_failure[root] = False
    stack = [(root, iter(successors[root]))]
    while stack:
      name, children = stack[-1]
      child = next((c for c in children if c not in before_failure), None)
      if child is not None:
        before_failure[child] = False
        stack.append((child, iter(successors[child])))
        continue
      stack.pop()
      before_failure[name] = any(c in failing or before_failure[c] for c in successors[name])

  gated: dict[str, list[str]] = {}
  kept: set[str] = set()
  for placeholder in written:
    for writer in _writers(nodes, successors, placeholder):
      if writer in failing or before_failure[writer]:
        kept.add(placeholder)
      else:
        gated.setdefault(nodes[writer].device, []).append(writer)
  waits: dict[str, list[str]] = {}
  for name in sorted(failing):
    waits.setdefault(nodes[name].device, []).append(name)
  return Gates(waits=waits, gated={d: sorted(set(names)) for d, names in gated.items()}, kept=kept)


def _writers(nodes: dict, successors: dict[str, list[str]], placeholder: str) -> list[str]:
  """The nodes that take ``placeholder``'s handle (through identities) and do not only read it."""
  found, frontier, seen = [], [placeholder], {placeholder}
  while frontier:
    for consumer in successors.get(frontier.pop(), ()):
      if consumer in seen:
        continue
      seen.add(consumer)
      if nodes[consumer].op in _FORWARDS:
        frontier.append(consumer)
      elif nodes[consumer].op not in _READS:
        found.append(consumer)
  return found


def apply(graph_def, gates: Gates, inputs: Iterable[tuple[str, str]] = ()):
  """``graph_def`` with every gated write waiting for every op that can fail (a few ``NoOp`` s, control edges).

  ``inputs``: ``(tensor name, device)`` of the step's inputs: values computed
  in the function that imports the step (taken from an iterator, split), where
  the failures of their ops are not the step's; a write waits for them too
  (through a ``Shape`` of each, on its device: an input mapped in at import is
  a tensor, and a control edge to its placeholder would not follow it). Ops no
  longer in ``graph_def`` (pruned after the trace) are left out.
  """
  present = {node.name: node for node in graph_def.node}
  waits = {d: [n for n in names if n in present] for d, names in gates.waits.items()}
  waits = {d: names for d, names in waits.items() if names}
  gated = {d: [n for n in names if n in present] for d, names in gates.gated.items()}
  gated = {d: names for d, names in gated.items() if names}
  inputs = [(tensor, device) for tensor, device in inputs if tensor.split(":")[0] in present]
  if not gated or not (waits or inputs):
    return graph_def
  result = type(graph_def)()
  result.CopyFrom(graph_def)
  for k, (tensor, device) in enumerate(inputs):
    node = result.node.add(name=f"{GATE_SCOPE}/input_{k}", op="Shape", input=[tensor], device=device)
    node.attr["T"].CopyFrom(present[tensor.split(":")[0]].attr["dtype"])
    node.attr["out_type"].type = tf.int32.as_datatype_enum
    waits.setdefault(device, []).append(node.name)

  def no_op(name: str, device: str, after: list[str]) -> str:
    node = result.node.add(name=f"{GATE_SCOPE}/{name}", op="NoOp", device=device)
    node.input.extend(f"^{n}" for n in after)
    return node.name

  # One wait per device for its ops that can fail, one join of those, and one gate per device that writes:
  # the edges between devices are (devices that can fail - 1) + (devices that write), not one per op.
  local = [no_op(f"can_fail_{i}", device, names) for i, (device, names) in enumerate(sorted(waits.items()))]
  join_device = sorted(waits)[0]
  join = local[0] if len(local) == 1 else no_op("all_can_fail", join_device, local)
  nodes = {node.name: node for node in result.node}
  for i, (device, names) in enumerate(sorted(gated.items())):
    gate = join if device == join_device else no_op(f"writes_{i}", device, [join])
    for name in names:
      nodes[name].input.append(f"^{gate}")
  return result


def in_program_order(graph_def, written: Iterable[str]):
  """``graph_def`` with the uses of each written variable ordered by control edges, as they come in the GraphDef.

  The function that imports the step orders the uses of each resource in the
  order it makes the ops (automatic control dependencies), and the importer
  makes a node only after its inputs: a write that waits for a gate (made at
  the end) is made later, and a read that came after it in the step, without
  an edge from it, would be ordered before it. So each read waits for the
  write before it, and each write for the reads and the write before it (as
  automatic control dependencies do), in the GraphDef's order (the step's).
  """
  written = set(written)
  if not written:
    return graph_def
  result = type(graph_def)()
  result.CopyFrom(graph_def)
  nodes = {node.name: node for node in result.node}
  successors: dict[str, list[str]] = {}
  for node in result.node:
    for ref in node.input:
      successors.setdefault(_ref(ref), []).append(node.name)
  position = {node.name: i for i, node in enumerate(result.node)}
  for placeholder in written:
    uses, frontier, seen = [], [placeholder], {placeholder}
    while frontier:
      for consumer in successors.get(frontier.pop(), ()):
        if consumer not in seen:
          seen.add(consumer)
          (frontier if nodes[consumer].op in _FORWARDS else uses).append(consumer)
    last_write, reads = None, []
    for name in sorted(uses, key=position.__getitem__):
      node = nodes[name]
      after = ([last_write] if last_write else []) + (reads if node.op not in _READS else [])
      have = {_ref(ref) for ref in node.input}
      node.input.extend(f"^{a}" for a in after if a not in have and a != name)
      if node.op in _READS:
        reads.append(name)
      else:
        last_write, reads = name, []
  return result


def order(graph_def, written: Iterable[str], fails: Callable, inputs: Iterable[tuple[str, str]]):
  """``graph_def`` with its writes ordered after every op that can fail; and the placeholders still to keep.

  Args:
    graph_def: the step's GraphDef after the rewrite (``rewrite.apply``).
    written: the placeholders (node names) of the handles the step writes.
    fails: ``fails(node)`` (:func:`classifier`).
    inputs: ``(tensor name, device)`` of the step's inputs (see :func:`apply`).
  """
  written = set(written)
  graph_def = in_program_order(graph_def, written)
  gates = analyse(graph_def, written, fails)
  return apply(graph_def, gates, inputs), gates.kept
