"""What a step's graph holds in memory, per device: tensors saved for the backward pass, and the peak.

:func:`analyze` reads a step's ``GraphDef`` (a local view's per-replica
graph, a global view's partition: every node placed on its device) and
returns a :class:`MemoryReport`:

* **saved for backward**: every tensor made by a forward op and read by a
  backward op (an op under a ``gradient_tape/`` or ``gradients/`` name scope,
  where ``tf.GradientTape`` and ``tf.gradients`` put the ops of the gradient
  functions; an op that reads a backward op's tensor, such as the tape's sum
  of a tensor's gradients; a collective the rewrite made for backward ops
  alone), other than by its shape alone (``Shape``, ``Size``, ``Rank``) or
  a constant. A read of a variable (``ReadVariableOp``) is listed apart: on
  CPU it is the variable's own buffer, no new bytes.
* **the peak**: a liveness pass in one topological order of the graph: by
  default ops run one at a time as their inputs become ready, the first
  ready first (TensorFlow's executor queues a finished op's ready readers
  first in, first out; with several inter-op threads it runs some at once).
  A tensor is live from the op that makes it to the last op that reads it
  (or a view of it: an ``Identity``, a ``Reshape``); while an op runs, its
  inputs and its outputs are live; an elementwise op whose input dies at it
  writes into that input's buffer, as TensorFlow's kernels do. Each device
  counts the tensors its ops make; the variables' bytes (``base_bytes``) are
  a constant under them.

Not counted: what an op allocates and frees inside itself (a kernel's
scratch, the ops inside a function an op calls: only its outputs are, a
loop's lists for its gradient included, held whole until the gradient's
loop has run, though it frees their elements as it pops them),
constants (made once with their kernels), copies between devices of one
process (logical CPUs share the host's memory), and what Grappler changes
before the step runs (fused ops whose intermediate results never exist, ops
it reorders or removes). This module knows nothing about Keras.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import re
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from rewrite import _apply
from rewrite import _shaped_reads

ORDERS = {
    "ready": ("ops run one at a time as their inputs become ready, the first ready first (as TensorFlow's executor "
              "runs a finished op's ready readers; it runs some at once on several threads)"),
    "created": "ops run one at a time in the order they were made, as far as their inputs allow",
    "dataflow": "ops run one at a time, the last made ready first (a depth-first walk of the data flow)",
}
ORDER = ORDERS["ready"]
BACKWARD_SCOPE = re.compile(r"^(gradient_tape|gradients)(_\d+)?$")
SHAPE_ONLY = frozenset({"Shape", "ShapeN", "Size", "Rank"})  # read their input's shape, not its buffer
# Ops whose output i is a view of their input i (the same buffer): it lives as long as its last view.
VIEWS = frozenset({"Identity", "IdentityN", "Reshape", "StopGradient", "Snapshot", "ExpandDims", "Squeeze",
                   "EnsureShape", "PreventGradient", "CheckNumerics", "DebugIdentity"})
VARIABLE_READS = frozenset({"ReadVariableOp"})  # on CPU a read is the variable's buffer (copied on a later write)
CONSTANTS = frozenset({"Const", "HostConst"})
SLICES = frozenset({"Slice", "StridedSlice", "Split", "SplitV"})  # of the step's input: its pieces
# Elementwise ops whose kernels write into an input's buffer when nothing else reads it (TensorFlow's
# forward_input_or_allocate_output): the common unary and binary ones, and their gradients'; BiasAdd's kernel
# forwards its input 0 too (and Grappler fuses a Conv2D's or MatMul's BiasAdd into it: one buffer either way).
FORWARDING = frozenset({
    "Abs", "Add", "AddN", "AddV2", "BiasAdd", "BiasAddV1", "Ceil", "Cos", "Div", "DivNoNan", "Elu", "EluGrad", "Exp",
    "Floor", "Gelu", "GeluGrad", "Inv", "Log", "Log1p", "LeakyRelu", "LeakyReluGrad", "Maximum", "Minimum", "Mul",
    "MulNoNan", "Neg", "Pow", "RealDiv", "Reciprocal", "Relu", "Relu6", "Relu6Grad", "ReluGrad", "Round", "Rsqrt",
    "RsqrtGrad", "Selu", "SeluGrad", "Sigmoid", "SigmoidGrad", "Sign", "Sin", "Softplus", "SoftplusGrad", "Sqrt",
    "SqrtGrad", "Square", "SquaredDifference", "Sub", "Tanh", "TanhGrad", "TruncateDiv", "Xdivy", "Xlogy"})
_NOT_BUFFERS = (tf.resource, tf.variant)
LOOPS = frozenset({"While", "StatelessWhile"})
LIST_MAKERS = frozenset({"EmptyTensorList", "TensorListReserve"})


def is_backward(node_name: str) -> bool:
  """Whether ``node_name`` is a backward op's: under a ``gradient_tape`` or ``gradients`` name scope."""
  return any(BACKWARD_SCOPE.match(part) for part in node_name.split("/")[:-1])


@dataclasses.dataclass(frozen=True)
class SavedTensor:
  """A tensor of the forward pass that the backward pass reads.

  Attributes:
    tensor: its name in the step's graph.
    op_type: the type of the op that makes it.
    kind: ``"activation"`` (a forward op's result), ``"input"`` (the step's
      input), ``"communicated"`` (a collective's result: in the global view a
      kernel gathered for its product, with FSDP), ``"loop"`` (a loop's list
      of a value of every iteration, for its gradient: ``shape`` is
      ``[iterations, *element]``) or ``"variable read"`` (a variable's value:
      its buffer, no new bytes).
    device: the device that holds it.
    shape: its shape on that device (None where unknown).
    dtype: its dtype's name.
    bytes: its bytes on that device (None if its shape is not static).
    readers: how many backward ops read it.
    layout: in the global view, how its global tensor is split (``[batch, -]``); else "".
    location: the user's source line of the op that makes it.
  """

  tensor: str
  op_type: str
  kind: str
  device: str
  shape: tuple[int | None, ...] | None
  dtype: str
  bytes: int | None
  readers: int
  layout: str = ""
  location: str = ""


@dataclasses.dataclass(frozen=True)
class LiveTensor:
  """A tensor live at a device's peak: its name, bytes and where it is made."""

  tensor: str
  op_type: str
  bytes: int
  location: str = ""


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """What one device holds in a step.

  Attributes:
    device: the device.
    variable_bytes: the variables' and optimizer slots' bytes on it (the base under the step's tensors).
    saved_bytes: the bytes of the tensors saved for backward that it holds (each buffer once; variable reads
      not counted: they are the variables').
    peak_bytes: the most bytes it holds at once: ``variable_bytes`` plus the step's live tensors at the peak.
    peak_op: the op running at the peak (its name in the step's graph).
    peak_location: that op's source line.
    live_at_peak: the tensors live at the peak, largest first (at most ``top`` of them).
    ops: how many of the step's ops it runs.
    unknown: how many tensors it makes whose size is not static (counted as 0).
    saved_peak_bytes: the most bytes of tensors saved for backward it holds at once in the order assumed, the
      step's inputs and their pieces aside (held to the step's end whatever the order): a pipeline's schedule
      shows here, 1F1B holding fewer microbatches' activations than GPipe.
  """

  device: str
  variable_bytes: int
  saved_bytes: int
  peak_bytes: int
  peak_op: str
  peak_location: str
  live_at_peak: tuple[LiveTensor, ...]
  ops: int = 0
  unknown: int = 0
  saved_peak_bytes: int = 0

  @property
  def step_peak_bytes(self) -> int:
    """The step's own tensors at the peak (``peak_bytes`` without the variables)."""
    return self.peak_bytes - self.variable_bytes


@dataclasses.dataclass
class MemoryReport:
  """What each device holds in a step: variables, tensors saved for backward, and the peak of live bytes.

  ``print`` it for tables; :meth:`summary` gives JSON-able dicts. Figures are
  bytes on one device. See :func:`rewrite.analyze_memory` for what is and is not counted.

  Attributes:
    devices: one :class:`DeviceMemory` per device, in the order given.
    saved: every tensor saved for backward, by device then graph order.
    order: the order the liveness pass assumes.
    view: the view that built the step ("local", "global"), for the title; "" if none.
    notes: what the caller adds (how variables were counted, a gap it knows of).
  """

  devices: list[DeviceMemory]
  saved: list[SavedTensor]
  order: str = ORDER
  view: str = ""
  notes: tuple[str, ...] = ()

  def device(self, name: str | None = None) -> DeviceMemory:
    """The :class:`DeviceMemory` of ``name`` (a device string, or its suffix such as ``CPU:1``); the first if None."""
    if name is None:
      return self.devices[0]
    for d in self.devices:
      if d.device == name or d.device.endswith(name):
        return d
    raise KeyError(f"no device {name!r} in the memory report; it has {[d.device for d in self.devices]}")

  def saved_on(self, device: str | None = None) -> list[SavedTensor]:
    """The tensors saved for backward on ``device`` (the first device if None)."""
    name = self.device(device).device
    return [s for s in self.saved if s.device == name]

  @property
  def peak_bytes(self) -> int:
    """The largest device's peak."""
    return max((d.peak_bytes for d in self.devices), default=0)

  @property
  def total_peak_bytes(self) -> int:
    """The devices' peaks summed (what a process whose devices share one allocator holds at most, if they
    peak together)."""
    return sum(d.peak_bytes for d in self.devices)

  def summary(self) -> dict[str, Any]:
    """The report as JSON-able dicts."""
    return {"order": self.order, "notes": list(self.notes),
            "devices": [dict(dataclasses.asdict(d), step_peak_bytes=d.step_peak_bytes) for d in self.devices],
            "saved": [dataclasses.asdict(s) for s in self.saved]}

  def __str__(self) -> str:
    where = f" ({self.view} view)" if self.view else ""
    lines = [f"Memory per device{where}: {len(self.devices)} device(s), peak {self.peak_bytes:,} bytes"]
    lines += _table(("device", "variables+slots", "saved for backward", "at once", "peak", "peak at"),
                    [(d.device, f"{d.variable_bytes:,}", f"{d.saved_bytes:,}", f"{d.saved_peak_bytes:,}",
                      f"{d.peak_bytes:,}", f"{d.peak_op} ({d.peak_location})" if d.peak_location else d.peak_op)
                     for d in self.devices])
    if self.devices:
      first = self.devices[0]
      rows = self.saved_on(first.device)
      layouts = any(s.layout for s in rows)
      lines.append(f"\nSaved for backward on {first.device} ({len(rows)} tensor(s), {first.saved_bytes:,} bytes; "
                   "variable reads are the variables' own buffers):")
      lines += _table(("tensor", "kind", "shape", "dtype") + (("layout",) if layouts else ()) + ("bytes", "at"),
                      [(s.tensor, s.kind, _shape(s.shape), s.dtype) + ((s.layout,) if layouts else ())
                       + (_bytes(s.bytes), s.location) for s in rows])
      lines.append(f"\nLive at the peak on {first.device} ({first.step_peak_bytes:,} bytes of the step's tensors, "
                   f"while {first.peak_op} runs; largest first):")
      lines += _table(("tensor", "op", "bytes", "at"),
                      [(t.tensor, t.op_type, f"{t.bytes:,}", t.location) for t in first.live_at_peak])
    lines.append(f"\nOrder assumed: {self.order}.")
    lines += [f"Note: {n}" for n in self.notes]
    return "\n".join(lines)


def _shape(shape) -> str:
  return "?" if shape is None else "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def _bytes(n) -> str:
  return "?" if n is None else f"{n:,}"


def _table(header, rows) -> list[str]:
  if not rows:
    return ["  (none)"]
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
  lines = ["  " + "  ".join(v.ljust(w) for v, w in zip(header, widths)).rstrip(),
           "  " + "  ".join("-" * w for w in widths)]
  return lines + ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def _source(ref: str) -> tuple[str, int]:
  """(node, output index) of an input reference ``name`` or ``name:k`` (not a control input)."""
  name, _, index = ref.partition(":")
  return name, int(index) if index else 0


def topological_order(graph_def, kind: str = "ready") -> list[int]:
  """Indices of ``graph_def``'s nodes in a topological order (:data:`ORDERS`).

  Of the nodes whose inputs are ready, ``kind`` ``"ready"`` takes the one
  made ready first, ``"dataflow"`` the one made ready last, ``"created"`` the
  first in the graph; ties go to the first in the graph.
  """
  if kind not in ORDERS:
    raise ValueError(f"order {kind!r}: expected one of {sorted(ORDERS)}")
  nodes = graph_def.node
  index = {node.name: i for i, node in enumerate(nodes)}
  waiting = [0] * len(nodes)
  readers: list[list[int]] = [[] for _ in nodes]
  for i, node in enumerate(nodes):
    sources = {index[s] for s in (ref.lstrip("^").partition(":")[0] for ref in node.input) if s in index}
    waiting[i] = len(sources)
    for s in sources:
      readers[s].append(i)
  lifo, fifo = kind == "dataflow", kind == "ready"
  ready = [(0, i) for i, n in enumerate(waiting) if n == 0]
  heapq.heapify(ready)
  order = []
  while ready:
    _, i = heapq.heappop(ready)
    order.append(i)
    for r in readers[i]:
      waiting[r] -= 1
      if waiting[r] == 0:
        heapq.heappush(ready, (-len(order) if lifo else len(order) if fifo else 0, r))
  if len(order) != len(nodes):  # a cycle (a graph made by hand): the rest in node order
    seen = set(order)
    order += [i for i in range(len(nodes)) if i not in seen]
  return order


def output_specs(graph_def, variable_shapes: Mapping[str, Any] | None = None
                 ) -> dict[str, list[tuple[tf.TensorShape, tf.DType]]]:
  """Node name -> (static shape, dtype) of each output, as TensorFlow's shape inference finds them.

  The graph is imported into a new ``tf.Graph`` (nothing runs). A variable's
  handle fed to the step (a ``Placeholder`` of dtype resource) carries no
  shape there: ``variable_shapes`` (the handle's node name -> its variable's
  shape) gives its reads theirs (each read followed by an ``EnsureShape`` of
  that shape under the read's name, in the imported copy only).
  """
  graph_def = _shaped_reads.shape_reads(graph_def, {_source(name)[0]: shape
                                                    for name, shape in (variable_shapes or {}).items()})
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(graph_def, name="")
  return {op.name: [(t.shape, t.dtype) for t in op.outputs] for op in graph.get_operations()}


def _nbytes(shape: tf.TensorShape, dtype: tf.DType) -> int | None:
  if dtype in _NOT_BUFFERS:
    return 0
  if not shape.is_fully_defined():
    return None
  if dtype == tf.string:
    return 0  # (their contents' size is not in the shape)
  return math.prod(shape.as_list()) * dtype.size


_FOLDABLE = 64  # the most ops a value of constants is computed by, for _const to compute it


def _const(nodes, index, ref):
  """The value of ``ref`` where constants alone make it (a loop's ``maximum_iterations`` computed from its input's
  static length, as Keras's recurrent layers do), else None."""
  name = _source(ref)[0]
  needed, stack = {}, [name]
  while stack:
    current = stack.pop()
    if current in needed:
      continue
    if current not in index or len(needed) >= _FOLDABLE:
      return None
    node = nodes[index[current]]
    if node.op == "Placeholder" or node.op.startswith(("Var", "ReadVariable", "Resource")) or "Call" in node.op:
      return None
    needed[current] = node
    stack += [_source(r)[0] for r in node.input if not r.startswith("^")]
  if nodes[index[name]].op in CONSTANTS:
    return tf.make_ndarray(nodes[index[name]].attr["value"].tensor)
  graph_def = tf.compat.v1.GraphDef()
  for node in needed.values():
    copy = graph_def.node.add()
    copy.CopyFrom(node)
    copy.ClearField("device")
    del copy.input[:]
    copy.input.extend(r for r in node.input if not r.startswith("^"))
  graph = tf.Graph()
  try:
    with graph.as_default():
      tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
      return session.run(ref if ":" in ref else ref + ":0")
  except (ValueError, TypeError, tf.errors.OpError):
    return None


@dataclasses.dataclass(frozen=True)
class LoopList:
  """A forward loop's list of a value of every iteration, for its gradient (:func:`loop_lists`).

  Attributes:
    shape: ``[iterations, *element]``, None where the loop's ``maximum_iterations`` or the element's shape is not a
      constant.
    dtype: the elements' dtype.
    bytes: the bytes it holds of its own: none for a variable's reads (its buffer); one element for a loop
      variable's values where the value it takes next is on another list (the same buffers, but the first);
      None if its shape is not known.
  """

  shape: tuple[int, ...] | None
  dtype: tf.DType
  bytes: int | None


def loop_lists(graph_def) -> dict[tuple[str, int], LoopList]:
  """A forward loop's lists its gradient pops, by ``(loop node, output)``.

  The lists are a ``While``'s loop variables made by an ``EmptyTensorList`` (or a ``TensorListReserve``) outside
  it, pushed in its body; TensorFlow 2's loops carry their counter and ``maximum_iterations`` first.
  """
  nodes = list(graph_def.node)
  index = {node.name: i for i, node in enumerate(nodes)}
  functions = {f.signature.name: f for f in graph_def.library.function}
  found = {}
  for node in nodes:
    body = functions.get(node.attr["body"].func.name) if node.op in LOOPS else None
    data = [ref for ref in node.input if not ref.startswith("^")]
    if body is None or is_backward(node.name) or len(body.signature.input_arg) != len(data) or len(data) < 2:
      continue
    iterations = _const(nodes, index, data[1])
    if iterations is None or np.ndim(iterations) or int(iterations) < 0:
      iterations = None  # (no bound given)
    args = [arg.name for arg in body.signature.input_arg]
    ops = {n.name: n.op for n in body.node_def}
    views = {n.name: n.input[0] for n in body.node_def if n.op in ("Identity", "Snapshot") and n.input}
    pushes = {n.input[0]: n.input[1] for n in body.node_def if n.op in ("TensorListPushBack", "TensorListSetItem")
              and n.input[0] in args}  # list argument -> the value pushed (SetItem: its item)
    for n in body.node_def:
      if n.op == "TensorListSetItem" and n.input[0] in args:
        pushes[n.input[0]] = n.input[2]
    pushed = set(pushes.values())
    for k, ref in enumerate(data):
      name = _source(ref)[0]
      while name in index and nodes[index[name]].op in VIEWS:
        name = _source(nodes[index[name]].input[0])[0]
      if name not in index or nodes[index[name]].op not in LIST_MAKERS:
        continue
      maker = nodes[index[name]]
      dtype = tf.dtypes.as_dtype(maker.attr["element_dtype"].type)
      if dtype in _NOT_BUFFERS:
        continue  # (lists of lists: a loop's loop)
      element = _const(nodes, index, maker.input[0])
      count = iterations if maker.op == "EmptyTensorList" else _const(nodes, index, maker.input[1])
      shape = n_bytes = None
      if element is not None and count is not None and element.ndim == 1 and (element >= 0).all():
        shape = (int(count), *(int(n) for n in element))
        n_bytes = math.prod(shape) * dtype.size
      value = pushes.get(args[k])
      if value is not None and ops.get(value.split(":")[0]) in VARIABLE_READS | {"TensorListGetItem"}:
        n_bytes = 0  # (a variable's buffer; an element of another list, read from it: that list's)
      elif value in args and n_bytes is not None:  # a loop variable's values: those after the first are pushed
        j = args.index(value)
        following = body.ret.get(body.signature.output_arg[j].name) if j < len(body.signature.output_arg) else None
        while following is not None and following.split(":")[0] in views:  # (the body's Identity of it)
          following = views[following.split(":")[0]]
        if following in pushed:
          n_bytes = n_bytes // shape[0] if shape[0] else 0
      found[(node.name, k)] = LoopList(shape, dtype, n_bytes)
  return found


def analyze(graph_def, *, base_bytes: Mapping[str, int] | None = None,
            device_of: Callable[[str], str] | None = None,
            describe: Callable[[str], str] | None = None, layout_of: Callable[[str], str] | None = None,
            outputs: Iterable[str] = (), devices: Iterable[str] = (), top: int = 8,
            specs: Mapping[str, list] | None = None, variable_shapes: Mapping[str, Any] | None = None,
            view: str = "", notes: tuple[str, ...] = (), order: str = "ready",
            forwarding: bool = True) -> MemoryReport:
  """The memory report of the step ``graph_def``: per device, saved tensors and the peak of live bytes.

  Args:
    graph_def: the step's ``GraphDef``, its nodes placed (``node.device``); a node without a device goes to
      its first reader's (else its first input's) device.
    base_bytes: device -> bytes held before the step and throughout (its variables and optimizer slots).
    device_of: a node's device string -> the name the report uses (default: as written).
    describe: a node name -> the user's source line of the op (default: "").
    layout_of: a tensor name -> how it is split over the mesh, as the report prints it (default: "").
    outputs: tensor names the step returns: live to the end.
    devices: the devices to report, in order (default: those found, in order of their first node, with
      ``base_bytes``'s).
    top: how many live tensors to list at each device's peak.
    specs: node name -> ``[(shape, dtype)]`` of its outputs (default: :func:`output_specs`).
    variable_shapes: a fed variable handle's tensor name -> its variable's shape (for :func:`output_specs`).
    view: the view that built the step, for the title.
    notes: lines the report ends with.
    order: the order the liveness pass assumes, a key of :data:`ORDERS`.
    forwarding: whether an elementwise op's output may take a dying input's buffer (as TensorFlow's kernels do).

  Returns:
    The :class:`MemoryReport`.
  """
  base_bytes = dict(base_bytes or {})
  device_of = device_of or (lambda d: d)
  describe = describe or (lambda name: "")
  layout_of = layout_of or (lambda name: "")
  specs = output_specs(graph_def, variable_shapes) if specs is None else specs
  nodes = list(graph_def.node)
  index = {node.name: i for i, node in enumerate(nodes)}
  lists = {(index[name], k): value for (name, k), value in loop_lists(graph_def).items()}
  order_kind, order = order, topological_order(graph_def, order)
  position = {i: k for k, i in enumerate(order)}

  # Each node's data inputs (node index, output) and its readers.
  inputs: list[list[tuple[int, int]]] = []
  readers: list[list[int]] = [[] for _ in nodes]
  for i, node in enumerate(nodes):
    found = []
    for ref in node.input:
      if ref.startswith("^"):
        continue
      name, k = _source(ref)
      if name in index:
        found.append((index[name], k))
        readers[index[name]].append(i)
    inputs.append(found)

  # Devices: as placed; an unplaced node with its first reader's, else its first input's.
  placed = [device_of(node.device) if node.device else None for node in nodes]
  for i in order[::-1]:  # readers first
    if placed[i] is None:
      placed[i] = next((placed[r] for r in readers[i] if placed[r] is not None), None)
  for i in order:
    if placed[i] is None:
      placed[i] = next((placed[s] for s, _ in inputs[i] if placed[s] is not None), None)
  devices = list(devices)
  placed = [p if p is not None else (devices[0] if devices else "") for p in placed]

  # Buffers: each output's, a view's output its input's; a variable read's and a constant's none (None). An
  # elementwise op's output takes the buffer of an input of its size that dies at it (TensorFlow's kernels
  # forward such a buffer instead of allocating one), unless that buffer is the step's input.
  # A loop's list it fills (an output per iteration; in a gradient's loop, a sequence's gradient per element),
  # stacked into a tensor after it: it holds what the stack copies.
  stacked = {}
  for i, node in enumerate(nodes):
    if node.op == "TensorListStack" and inputs[i]:
      source = inputs[i][0]
      while nodes[source[0]].op in VIEWS and inputs[source[0]]:
        source = inputs[source[0]][0]
      n = _nbytes(*specs[node.name][0]) if specs.get(node.name) else None
      if nodes[source[0]].op in LOOPS and source not in lists and n:
        stacked[source] = n
  reads_last = {}  # tensor -> the position of its last reader
  for i in order:
    for source in inputs[i]:
      reads_last[source] = max(reads_last.get(source, -1), position[i])
  for name in outputs:
    node, k = _source(name)
    if node in index:
      reads_last[(index[node], k)] = len(order)
  buffer: dict[tuple[int, int], tuple[int, int] | None] = {}
  size: dict[tuple[int, int], int] = {}
  last: dict[tuple[int, int], int] = {}  # a buffer's last use: the last reader of it or of a view of it
  unknown: collections.Counter = collections.Counter()
  for p, i in enumerate(order):
    node = nodes[i]
    taken = set()
    for k, (shape, dtype) in enumerate(specs.get(node.name, ())):
      key = (i, k)
      n = _nbytes(shape, dtype)
      if key in lists and lists[key].bytes != 0:  # a loop's list of a value of each iteration: the values' bytes
        n = lists[key].bytes
        b = key
        if n is None:
          unknown[placed[i]] += 1
        size[key] = n or 0
      elif key in stacked:  # a loop's list of outputs (or of a sequence's gradients), stacked after it: the stack's
        n = stacked[key]
        b = key
        size[key] = n
      elif node.op == "TensorListFromTensor" and k == 0 and inputs[i]:  # a list of copies of the tensor's slices
        source = inputs[i][0]
        n = _nbytes(*specs[nodes[source[0]].name][source[1]])
        b = key
        if n is None:
          unknown[placed[i]] += 1
        size[key] = n or 0
      elif node.op in VARIABLE_READS or node.op in CONSTANTS or dtype in _NOT_BUFFERS:
        b = None
      elif node.op in VIEWS and k < len(inputs[i]):
        b = buffer.get(inputs[i][k] if node.op == "IdentityN" else inputs[i][0])
      else:
        b = key
        if forwarding and node.op in FORWARDING and n:
          for source in inputs[i]:
            other = buffer.get(source)
            if (other is not None and other not in taken and last.get(other) == p and size[other] == n
                and placed[other[0]] == placed[i]
                and specs[nodes[source[0]].name][source[1]][1] == dtype and nodes[other[0]].op != "Placeholder"):
              b = other
              break
        if b == key:
          if n is None:
            unknown[placed[i]] += 1
          size[key] = n or 0
      buffer[key] = b
      if b is not None:
        taken.add(b)
        last[b] = max(last.get(b, p), reads_last.get(key, p))

  def walk(stop_at: dict[str, int] | None = None):
    """The peak position per device; with ``stop_at`` (device -> position), the buffers live there."""
    live: collections.Counter = collections.Counter()
    alive: dict[str, set] = collections.defaultdict(set)
    freed: dict[int, list] = collections.defaultdict(list)
    peaks: dict[str, tuple[int, int]] = {}
    snapshots = {}
    for p, i in enumerate(order):
      d = placed[i]
      made = [(i, k) for k in range(len(specs.get(nodes[i].name, ()))) if buffer.get((i, k)) == (i, k)]
      for key in made:
        live[d] += size[key]
        alive[d].add(key)
        freed[max(last.get(key, p), p)].append(key)
      if d not in peaks or live[d] > peaks[d][0]:
        peaks[d] = (live[d], p)
      if stop_at is not None:
        for device, at in stop_at.items():
          if at == p:
            snapshots[device] = (i, set(alive[device]))
      for key in freed.pop(p, ()):
        owner = placed[key[0]]
        live[owner] -= size[key]
        alive[owner].discard(key)
    return peaks, snapshots

  peaks, _ = walk()
  _, snapshots = walk({d: p for d, (_, p) in peaks.items()})

  # The step's inputs and their pieces (a device's slice of a global batch).
  pieces = set()
  for i in order:
    if nodes[i].op == "Placeholder" or (nodes[i].op in SLICES and inputs[i] and buffer.get(inputs[i][0]) in pieces):
      pieces.update(buffer[(i, k)] for k in range(len(specs.get(nodes[i].name, ()))) if buffer.get((i, k)))

  # Saved for backward: made by a forward op (not a constant), read by a backward op other than for its shape.
  saved_rows: list[SavedTensor] = []
  saved_buffers: dict[str, set] = collections.defaultdict(set)
  backward = [is_backward(node.name) for node in nodes]
  # An op reading a backward op's tensor is of the backward pass too (the tape's sums of gradients); not by reading
  # a constant or an empty list made under the tape's scope (a forward loop's lists for its gradient).
  made_empty = {i for i, node in enumerate(nodes) if node.op in LIST_MAKERS or node.op in CONSTANTS}
  for i in order:
    if not backward[i] and any(backward[source] and source not in made_empty for source, _ in inputs[i]):
      backward[i] = True
  for i in order[::-1]:  # (readers first) a collective the rewrite made for backward ops alone is theirs
    if nodes[i].name.startswith(_apply.PREFIX + "/") and readers[i] and all(backward[r] for r in readers[i]):
      backward[i] = True
  for i in order:
    node = nodes[i]
    if backward[i] or node.op in CONSTANTS:
      continue
    for k, (shape, dtype) in enumerate(specs.get(node.name, ())):
      if dtype in _NOT_BUFFERS and (i, k) not in lists:
        continue
      count = sum(1 for r in readers[i] if backward[r] and nodes[r].op not in SHAPE_ONLY
                  and (i, k) in inputs[r])
      if not count:
        continue
      b = buffer.get((i, k))
      n = _nbytes(shape, dtype)
      shape = tuple(shape.as_list()) if shape.rank is not None else None
      if (i, k) in lists:
        shape, dtype, n = lists[(i, k)].shape, lists[(i, k)].dtype, lists[(i, k)].bytes
      if b is None:
        kind = "variable read"
      elif (i, k) in lists:
        kind = "loop"
      elif b in pieces:
        kind = "input"
      elif node.name.startswith(_apply.PREFIX + "/"):
        kind = "communicated"  # a collective's result: a gathered kernel (FSDP), an all-to-all's (an activation
        # written into a collective's result, as a ReLU after a reduce-scatter, is an activation)
      else:
        kind = "activation"
      saved_rows.append(SavedTensor(f"{node.name}:{k}", node.op, kind, placed[i], shape, dtype.name,
                                    0 if b is None and n is not None else n, count,
                                    layout_of(f"{node.name}:{k}") or "", describe(node.name) or ""))
      if b is not None:
        saved_buffers[placed[i]].add(b)

  saved_peaks = _saved_peaks(order, nodes, specs, buffer, size, last, placed,
                             {b for buffers in saved_buffers.values() for b in buffers} - pieces)
  found = list(dict.fromkeys([*devices, *base_bytes, *(placed[i] for i in order)]))
  found = [d for d in found if d or any(p == "" for p in placed)]
  ops = collections.Counter(placed)
  reports = []
  for d in found:
    base = base_bytes.get(d, 0)
    peak, _ = peaks.get(d, (0, -1))
    at, alive = snapshots.get(d, (None, set()))
    live = sorted(alive, key=lambda key: (-size[key], position[key[0]]))[:top]
    tensors = tuple(LiveTensor(f"{nodes[key[0]].name}:{key[1]}", nodes[key[0]].op, size[key],
                               describe(nodes[key[0]].name)) for key in live)
    saved = sum(size[b] for b in saved_buffers.get(d, ()))
    peak_op = nodes[at].name if at is not None else ""
    reports.append(DeviceMemory(d, base, saved, base + peak, peak_op, describe(peak_op) if peak_op else "",
                                tensors, ops.get(d, 0), unknown.get(d, 0), saved_peaks.get(d, 0)))
  saved_rows.sort(key=lambda s: found.index(s.device) if s.device in found else len(found))
  return MemoryReport(reports, saved_rows, order=ORDERS[order_kind], view=view, notes=tuple(notes))


def _saved_peaks(order, nodes, specs, buffer, size, last, placed, saved) -> dict:
  """Device -> the most bytes of the ``saved`` buffers live at once, in ``order`` (as the peak's walk counts)."""
  live: collections.Counter = collections.Counter()
  peaks: dict = {}
  freed: dict = collections.defaultdict(list)
  for p, i in enumerate(order):
    for k in range(len(specs.get(nodes[i].name, ()))):
      key = (i, k)
      if key in saved and buffer.get(key) == key:
        live[placed[i]] += size[key]
        peaks[placed[i]] = max(peaks.get(placed[i], 0), live[placed[i]])
        freed[max(last.get(key, p), p)].append(key)
    for key in freed.pop(p, ()):
      live[placed[key[0]]] -= size[key]
  return peaks
