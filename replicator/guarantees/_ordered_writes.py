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

from replicator.state import _access

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
_READS = _access.READS  # ops that only read a variable through its handle

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
  if op.type in ("ArgMax", "ArgMin") and op.inputs[0].shape.num_elements() == 0:
    return True  # "Reduction axis is empty"
  return op.type in _CONSTANT_OPERANDS and any(t.op.type != "Const" for t in op.inputs[1:])


_COLLECTIVE = re.compile(r"^(?:.*/)?replicator_rewrite_*/(\d+)_[a-z_]+/")
_EXTERNAL = re.compile(r"^(?:.*/)?replicator_rewrite_*/external/")


def collective_can_fail(collective) -> bool:
  """Whether a planned collective may fail at run time: shapes known only then, or a group across processes."""
  members = collective.present
  static = all(m.shape.is_fully_defined() and m.input_shape.is_fully_defined() for m in members)
  return (not static or len(members) < len(collective.members)
          or len({_task(d) for d in collective.all_devices}) > 1)


def _task(device: str) -> tuple:
  spec = tf.DeviceSpec.from_string(device or "")
  return spec.job, spec.replica, spec.task


def classifier(plan, traced: Callable[[str], "tf.Operation | None"]) -> Callable:
  """``fails(name, op_type)`` for the nodes of a rewritten step GraphDef.

  Args:
    plan: the rewrite's plan (its collectives' nodes are named by their index).
    traced: node name -> the traced op it is (or copies), with its static
      shapes; None for a node made after the trace (treated by its type, as if
      its shapes were unknown).
  """
  fallible = [collective_can_fail(c) for c in plan.collectives]

  def fails(name: str, op_type: str) -> bool:
    if op_type in _NEVER_FAIL:
      return False
    if "replicator_rewrite" in name:
      found = _COLLECTIVE.match(name)
      if found is not None:
        return fallible[int(found.group(1))]
      if _EXTERNAL.match(name):
        return False
    if op_type not in _CANNOT_FAIL:
      return True
    op = traced(name)
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
  return name[1:] if name[0] == "^" else name.partition(":")[0]


class _Parsed:
  """A GraphDef's nodes by position: names, types, and who takes each node's outputs (data or control)."""

  def __init__(self, graph_def):
    self.nodes = list(graph_def.node)
    self.names = [node.name for node in self.nodes]
    self.types = [node.op for node in self.nodes]
    self.index = {name: i for i, name in enumerate(self.names)}
    self.successors: list[list[int]] = [[] for _ in self.nodes]
    index = self.index
    for i, node in enumerate(self.nodes):
      for ref in node.input:
        j = index.get(_ref(ref))
        if j is not None:
          self.successors[j].append(i)

  def uses(self, placeholder: str) -> list[int]:
    """The nodes that take ``placeholder``'s handle, through identities (by position)."""
    start = self.index.get(placeholder)
    if start is None:
      return []
    found, frontier, seen = [], [start], {start}
    while frontier:
      for consumer in self.successors[frontier.pop()]:
        if consumer not in seen:
          seen.add(consumer)
          (frontier if self.types[consumer] in _FORWARDS else found).append(consumer)
    return found


def in_program_order(parsed: _Parsed, uses: dict[str, list[int]]) -> None:
  """Orders the uses of each written variable by control edges, as they come in the GraphDef (in place).

  The function that imports the step orders the uses of each resource in the
  order it makes the ops (automatic control dependencies), and the importer
  makes a node only after its inputs: a write that waits for a gate (made at
  the end) is made later, and a read that came after it in the step, without
  an edge from it, would be ordered before it. So each read waits for the
  write before it, and each write for the reads and the write before it (as
  automatic control dependencies do), in the GraphDef's order (the step's).
  ``uses``: each written placeholder's :meth:`_Parsed.uses`.
  """
  for users in uses.values():
    last_write, reads = None, []
    for i in sorted(users):
      read = parsed.types[i] in _READS
      after = ([last_write] if last_write is not None else []) + ([] if read else reads)
      if after:
        node = parsed.nodes[i]
        have = {_ref(ref) for ref in node.input}
        for a in after:
          if parsed.names[a] not in have:
            node.input.append("^" + parsed.names[a])
            parsed.successors[a].append(i)
      if read:
        reads.append(i)
      else:
        last_write, reads = i, []


def analyse(parsed: _Parsed, uses: dict[str, list[int]], fails: Callable) -> Gates:
  """Which writes can wait for every op that can fail, and which written placeholders to keep.

  Args:
    parsed: the step after the rewrite (a nested function's call is one node).
    uses: the placeholder nodes (handles) whose variables the step writes -> their :meth:`_Parsed.uses`.
    fails: ``fails(name, op_type)``: whether a node may fail at run time (:func:`classifier`).
  """
  n = len(parsed.nodes)
  failing = [fails(name, op) for name, op in zip(parsed.names, parsed.types)]
  successors = parsed.successors
  # before[i]: an op that can fail depends on node i. Each node once, children first (iterative).
  before = [False] * n
  done = [False] * n
  for root in range(n):
    if done[root]:
      continue
    stack = [(root, 0)]
    while stack:
      i, k = stack[-1]
      children = successors[i]
      while k < len(children) and done[children[k]]:
        k += 1
      if k < len(children):
        stack[-1] = (i, k + 1)
        child = children[k]
        done[child] = True  # entered (a DAG: no cycle brings it back before it is finished)
        stack.append((child, 0))
        continue
      stack.pop()
      done[i] = True
      before[i] = any(failing[c] or before[c] for c in children)

  gated: dict[str, list[str]] = {}
  kept: set[str] = set()
  for placeholder, users in uses.items():
    for i in users:
      if parsed.types[i] in _READS:
        continue
      if failing[i] or before[i]:
        kept.add(placeholder)
      else:
        gated.setdefault(parsed.nodes[i].device, []).append(parsed.names[i])
  waits: dict[str, list[str]] = {}
  for i in range(n):
    if failing[i]:
      waits.setdefault(parsed.nodes[i].device, []).append(parsed.names[i])
  return Gates(waits=waits, gated={d: sorted(set(names)) for d, names in gated.items()}, kept=kept)


def apply(graph_def, parsed: _Parsed, gates: Gates, inputs: Iterable[tuple[str, str]] = ()) -> None:
  """Makes every gated write of ``graph_def`` (``parsed``) wait for every op that can fail (in place: ``NoOp`` s).

  ``inputs``: ``(tensor name, device)`` of the step's inputs: values computed
  in the function that imports the step (taken from an iterator, split), where
  the failures of their ops are not the step's; a write waits for them too
  (through a ``Shape`` of each, on its device: an input mapped in at import is
  a tensor, and a control edge to its placeholder would not follow it).
  """
  inputs = [(tensor, device) for tensor, device in inputs if tensor.split(":")[0] in parsed.index]
  if not gates.gated or not (gates.waits or inputs):
    return
  waits = {d: list(names) for d, names in gates.waits.items()}
  for k, (tensor, device) in enumerate(inputs):
    node = graph_def.node.add(name=f"{GATE_SCOPE}/input_{k}", op="Shape", input=[tensor], device=device)
    node.attr["T"].CopyFrom(parsed.nodes[parsed.index[tensor.split(":")[0]]].attr["dtype"])
    node.attr["out_type"].type = tf.int32.as_datatype_enum
    waits.setdefault(device, []).append(node.name)

  def no_op(name: str, device: str, after: list[str]) -> str:
    node = graph_def.node.add(name=f"{GATE_SCOPE}/{name}", op="NoOp", device=device)
    node.input.extend(f"^{n}" for n in after)
    return node.name

  # One wait per device for its ops that can fail, one join of those, and one gate per device that writes:
  # the edges between devices are (devices that can fail - 1) + (devices that write), not one per op.
  local = [no_op(f"can_fail_{i}", device, names) for i, (device, names) in enumerate(sorted(waits.items()))]
  join_device = sorted(waits)[0]
  join = local[0] if len(local) == 1 else no_op("all_can_fail", join_device, local)
  for i, (device, names) in enumerate(sorted(gates.gated.items())):
    gate = join if device == join_device else no_op(f"writes_{i}", device, [join])
    for name in names:
      parsed.nodes[parsed.index[name]].input.append(f"^{gate}")


def order(graph_def, written: Iterable[str], fails: Callable, inputs: Iterable[tuple[str, str]]) -> set[str]:
  """Orders ``graph_def``'s writes after every op that can fail (in place); returns the placeholders to keep.

  Args:
    graph_def: the step's GraphDef after the rewrite (``rewrite.apply``), changed in place.
    written: the placeholders (node names) of the handles the step writes.
    fails: ``fails(name, op_type)`` (:func:`classifier`).
    inputs: ``(tensor name, device)`` of the step's inputs (see :func:`apply`).
  """
  parsed = _Parsed(graph_def)
  uses = {placeholder: parsed.uses(placeholder) for placeholder in sorted(set(written))}
  in_program_order(parsed, uses)  # its edges run from use to use: the uses stay the same
  gates = analyse(parsed, uses, fails)
  apply(graph_def, parsed, gates, inputs)
  return gates.kept


def placed(inputs: Iterable[tf.Tensor]) -> list[tuple[str, str]]:
  """``(name, device)`` of the step's input placeholders, each on the device of its first placed user."""
  return [(t.name, next((c.device for c in t.consumers() if c.device), "")) for t in inputs]
