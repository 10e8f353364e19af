"""A cost model of the global view's lowering: a partition's step time, estimated from shapes and collectives.

What one device does for a partitioned op is known from the partition alone:
its pieces' shapes. :func:`work` counts it, machine-independent: per op the
flops of a contraction (``2 x output elements x contracted size``, on the
pieces) or else the bytes it reads and writes; per collective its kind, the
number of devices it spans and the bytes each sends. :meth:`Work.estimate`
prices that on a :class:`Machine` (measured by ``replicator.calibrate``):

* compute: each op costs a fixed ``op_seconds`` (the executor's) plus its
  flops at ``flops_per_second`` or its bytes at ``bytes_per_second``; every
  device runs every op, and ``parallel_devices`` of them run at once (logical
  devices share the cores);
* communication: each collective costs ``collective_seconds`` plus the bytes
  a device sends over ``collective_bytes_per_second``: an all-reduce sends
  ``2 (k-1)/k`` of its input, a reduce-scatter and an all-to-all ``(k-1)/k``,
  an all-gather ``k-1`` pieces (the ring algorithms' counts).

Not modelled: overlap of compute and communication (they add up), the cost of
a lowering's own ops beyond the collective, kernels' efficiency by shape (one
rate for every contraction), and a sharded update's owners computing only
their share of an update (every device is counted as running every op). The estimate is
for ranking layouts of one step on one machine; ``benchmarks/cost_model.py``
checks it against measured step times.
"""

from __future__ import annotations

import dataclasses
import math
import re

import tensorflow as tf

from rewrite import _communication
from rewrite import _recompute

_CONTRACTIONS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D",
                 "Conv2DBackpropInput", "Conv2DBackpropFilter", "DepthwiseConv2dNative",
                 "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter")
_ALIASES = ("Identity", "IdentityN", "Reshape", "StopGradient", "Snapshot")  # outputs that are their inputs' buffers
_FREE = ("Const", "Placeholder", "Identity", "NoOp", "ReadVariableOp", "VarHandleOp", "Shape", "Reshape",
         "StopGradient", "IdentityN")


@dataclasses.dataclass(frozen=True)
class Machine:
  """Measured rates of one machine and device count (``replicator.calibrate``).

  Attributes:
    flops_per_second: a contraction's rate on one device.
    bytes_per_second: an elementwise op's rate on one device (bytes read and written).
    op_seconds: the fixed cost of running one op on one device.
    parallel_devices: how many devices' ops run at the same time (at most
      the cores; 4 logical devices on 2 cores: about 2).
    collective_seconds: the fixed cost of one collective (an all-reduce's).
    collective_bytes_per_second: the rate at which a device sends a collective's bytes (an all-reduce's).
    devices: the number of devices it was measured on.
    collectives: kind -> (its fixed cost, its rate) where measured: the
      kinds differ as the lowering makes them (on 4 logical CPUs an
      all-to-all or a reduce-scatter, reshaped and transposed around an
      exchange, sends its bytes at a third of an all-reduce's rate); the
      others cost as an all-reduce.
  """

  flops_per_second: float
  bytes_per_second: float
  op_seconds: float
  parallel_devices: float
  collective_seconds: float
  collective_bytes_per_second: float
  devices: int = 1
  collectives: dict = dataclasses.field(default_factory=dict)

  def collective(self, kind: str) -> tuple[float, float]:
    """(fixed seconds, bytes a second) of a collective of ``kind``."""
    found = self.collectives.get(kind)
    return tuple(found) if found else (self.collective_seconds, self.collective_bytes_per_second)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A step's estimated time on a :class:`Machine`, in seconds, and what it is made of."""

  compute_seconds: float
  overhead_seconds: float
  communication_seconds: float

  @property
  def seconds(self) -> float:
    return self.compute_seconds + self.overhead_seconds + self.communication_seconds


@dataclasses.dataclass(frozen=True)
class CollectiveWork:
  """One collective of a partition: its kind, the devices it spans, the bytes of each device's input."""

  kind: str
  group: int
  bytes: int
  op_name: str

  @property
  def sent(self) -> float:
    """The bytes each device sends (ring algorithms)."""
    k = self.group
    return {"all_reduce": 2 * (k - 1) / k, "reduce_scatter": (k - 1) / k, "all_to_all": (k - 1) / k,
            "all_gather": k - 1}.get(self.kind, 1.0) * self.bytes


@dataclasses.dataclass(frozen=True)
class Work:
  """What one device does in a step of a partition (machine-independent; see :func:`work`).

  Attributes:
    devices: the number of devices.
    ops: the ops each device runs (not counting free ones: constants, reads, reshapes).
    flops: each device's contractions' flops.
    bytes: each device's other ops' bytes read and written.
    collectives: one entry per collective.
    peak_bytes: the most bytes of the step's tensors a device holds at once,
      each kept from the op that makes it to the last op that reads it, in
      the graph's order (activations kept for the backward pass, gradients,
      temporaries; variables, their reads and aliases not counted; the
      executor may order ops otherwise and free sooner).
  """

  devices: int
  ops: int
  flops: float
  bytes: float
  collectives: tuple
  peak_bytes: float = 0.0

  @property
  def bytes_communicated(self) -> float:
    """The bytes each device sends a step."""
    return sum(c.sent for c in self.collectives)

  def estimate(self, machine: Machine) -> Estimate:
    share = self.devices / max(1.0, min(machine.parallel_devices, self.devices))  # devices' ops in turn
    compute = (self.flops / machine.flops_per_second + self.bytes / machine.bytes_per_second) * share
    overhead = self.ops * machine.op_seconds * share
    communication = 0.0
    for c in self.collectives:
      fixed, rate = machine.collective(c.kind)
      communication += fixed + c.sent / rate
    return Estimate(compute, overhead, communication)


def _local(shape, layout, mesh_shape) -> list[int] | None:
  """A piece's shape (unknown dimensions as 1), or None if the rank is unknown."""
  if shape.rank is None:
    return None
  dims = [1 if n is None else n for n in shape.as_list()]
  if layout is None or len(layout) != len(dims):
    return dims
  return [n // math.prod(mesh_shape[a] for a in axes) for n, axes in zip(dims, layout)]


def _nbytes(t, layout, mesh_shape) -> int:
  local = _local(t.shape, layout, mesh_shape)
  if local is None or t.dtype in (tf.resource, tf.variant, tf.string):
    return 0
  return math.prod(local) * t.dtype.size


def _contracted(op, inputs) -> int:
  """The contracted size of a contraction, from its inputs' local shapes."""
  a, b = inputs[0], inputs[1] if len(inputs) > 1 else None
  t = op.type
  if t == "MatMul":
    return a[0] if op.get_attr("transpose_a") else a[1]
  if t.startswith("BatchMatMul"):
    return a[-2] if op.get_attr("adj_x") else a[-1]
  if t == "Einsum":
    spec = op.get_attr("equation").decode().replace(" ", "")
    ins, out = spec.split("->")
    first = ins.split(",")[0].replace("...", "")
    labels = [c for c in first if c.isalpha()]
    start = len(a) - len(labels) if "..." in ins.split(",")[0] else 0
    return math.prod(a[start + i] for i, c in enumerate(labels) if c not in out) or 1
  if t in ("Conv2D", "DepthwiseConv2dNative"):
    return b[0] * b[1] * (b[2] if t == "Conv2D" else 1)
  return 1


def _flops(op, decision, mesh_shape) -> float:
  ins = [_local(t.shape, layout, mesh_shape) or [1] for t, layout in zip(op.inputs, decision.inputs + [None] * 8)]
  out = _local(op.outputs[0].shape, decision.outputs[0] if decision.outputs else None, mesh_shape) or [1]
  t = op.type
  if re.fullmatch(r"(Conv2D|DepthwiseConv2dNative)Backprop(Input|Filter)", t):
    # the forward's products: out_backprop's elements times the filter's window (and its input channels)
    kernel = out if t.endswith("Filter") else ins[1]  # [height, width, in channels, ...]
    channels = 1 if t.startswith("Depthwise") else kernel[2]
    return 2.0 * math.prod(ins[2]) * kernel[0] * kernel[1] * channels
  return 2.0 * math.prod(out) * _contracted(op, ins)


class _Op:
  """What :func:`work` asks of an op, asked of TensorFlow once."""

  __slots__ = ("op", "name", "type", "free", "contraction", "inputs", "outputs")

  def __init__(self, op):
    self.op, self.name, self.type = op, op.name, op.type
    self.free, self.contraction = op.type in _FREE, op.type in _CONTRACTIONS
    self.inputs = tuple((t, t.name, t.dtype == tf.resource) for t in op.inputs)
    self.outputs = tuple((t, t.name) for t in op.outputs)


def work(graph: tf.Graph, partition, mesh_shape, outputs=(), ownership=None, memo: dict | None = None,
         recomputed=()) -> Work:
  """What each device does for ``partition`` of ``graph``: ops, flops, bytes and collectives.

  Args:
    graph: the traced global graph.
    partition: its ``_propagation.Partition``.
    mesh_shape: axis name -> size.
    outputs: the step's outputs (returned whole: split ones are gathered).
    ownership: the sharded update's owners (``_partition_owners.Ownership``): their broadcasts, if any.
    memo: a dict kept between calls on one graph and mesh (a layout search's): each tensor's bytes in each
      layout, and each contraction's flops in each decision, are computed once.
    recomputed: blocks rematerialized (``rewrite._recompute.Block``): their internal saved tensors live
      until their last forward reader and again from their block's first backward reader to their last
      reader; their recomputed ops run twice, with the collectives they read.
  """
  memo = {} if memo is None else memo
  mesh_shape = dict(mesh_shape)

  def size_of(t, name, layout) -> int:  # a piece's bytes, remembered
    key = (name, layout)
    found = memo.get(key)
    if found is None:
      found = memo[key] = _nbytes(t, layout, mesh_shape)
    return found

  def cost(op, decision) -> tuple[float, float]:  # (flops, bytes) of one op
    if op.contraction:
      key = (op.name, id(decision))
      if key not in memo:
        memo[key] = (_flops(op.op, decision, mesh_shape), decision)  # (the decision kept: its id stays its own)
      return memo[key][0], 0.0
    return 0.0, (sum(size_of(t, name, layouts.get(name)) for t, name, _ in op.inputs)
                 + sum(size_of(t, name, layouts.get(name)) for t, name in op.outputs))

  devices = math.prod(mesh_shape.values()) if mesh_shape else 1
  layouts = partition.layouts
  group = lambda axes: math.prod(mesh_shape[a] for a in axes)  # noqa: E731
  ops, flops, nbytes, collectives = 0, 0.0, 0.0, []

  every = memo.get("ops")
  if every is None:  # (TensorFlow's properties asked once: a layout search prices hundreds of partitions)
    every = memo["ops"] = [_Op(op) for op in graph.get_operations()]
    memo["walked"] = [(op.op, op.name, op.inputs, op.outputs) for op in every]
    last = memo["last use"] = {name: i for i, op in enumerate(every) for _, name, _ in op.inputs}
    for op in reversed(every):  # tensor name -> the index of the last op that reads it, or an alias of it
      if op.type in _ALIASES and op.inputs:
        ends = [last.get(name, -1) for _, name in op.outputs]
        for _, name, _ in op.inputs[:len(op.outputs)]:
          last[name] = max([last.get(name, -1)] + ends)
  last = memo["last use"]
  remade: dict[int, list] = {}  # index -> (bytes, its last reader) of the recomputed tensors made there
  ends = {}  # a recomputed block's internal saved tensor -> its last forward reader
  twice = []  # the recomputed ops, again
  if recomputed:
    if "backward" not in memo:
      backward = _recompute.backward_ops(graph)
      memo["backward"] = [op.name in backward for op in every]
      memo["index"] = {op.name: i for i, op in enumerate(every)}
      forward_last, backward_first = {}, {}
      for i, op in enumerate(every):
        for _, name, _ in op.inputs:
          if memo["backward"][i]:
            backward_first.setdefault(name, i)
          else:
            forward_last[name] = i
      memo["forward last"], memo["backward first"] = forward_last, backward_first
    if "tensors" not in memo:
      memo["tensors"] = {name: t for op in every for t, name in op.outputs}
    index, tensors = memo["index"], memo["tensors"]
    for block in recomputed:
      starts = [memo["backward first"][t] for t in block.saved if t in memo["backward first"]]
      if not starts:
        continue
      start = min(starts)
      for t in block.saved:
        ends[t] = memo["forward last"].get(t, index.get(t.rpartition(":")[0], 0))
        remade.setdefault(start, []).append((size_of(tensors[t], t, layouts.get(t)) if t in tensors else 0,
                                             last.get(t, start)))
      twice += [every[index[name]] for name in block.recomputed if name in index]
  live, peak, freed = 0, 0, {}
  broadcasts = ownership.broadcasts if ownership is not None else {}
  for index, op in enumerate(every):
    for size, end in remade.get(index, ()):  # a recomputed block's saved tensors, made again before this op
      live += size
      peak = max(peak, live)
      freed[max(end, index)] = freed.get(max(end, index), 0) + size
    decision = partition.decisions.get(op.name)
    if decision is None:
      live -= freed.pop(index, 0)
      continue
    if not op.free:
      made = kept = 0
      for t, name in op.outputs:
        size = size_of(t, name, layouts.get(name))
        made += size
        end = ends.get(name, last.get(name, -1)) if ends else last.get(name, -1)
        if end > index:
          kept += size
          freed[end] = freed.get(end, 0) + size
      peak = max(peak, live + made)
      live += kept
    live -= freed.pop(index, 0)
    for i, (t, name, _) in enumerate(op.inputs if broadcasts else ()):
      if (op.name, i) in broadcasts:  # computed by one device of each group, sent to the others
        collectives.append(CollectiveWork("broadcast", group(broadcasts[op.name, i].axes),
                                          size_of(t, name, layouts.get(name)), op.name))
    if not op.free:
      ops += 1
      f, b = cost(op, decision)
      flops += f
      nbytes += b
  for op in twice:
    decision = partition.decisions.get(op.name)
    if decision is not None and not op.free:
      ops += 1
      f, b = cost(op, decision)
      flops += f
      nbytes += b
  again = {op.name for op in twice}  # a recomputed op's collectives run again with it
  for event in _communication.walk(graph, partition, outputs, mesh_shape, memo["walked"]):
    if isinstance(event, _communication.Needed):
      if event.nbytes is not None:  # a rule's own count (a halo's rows)
        size = event.nbytes
      else:
        size = size_of(event.tensor, event.tensor.name, event.layout) if event.tensor is not None else 0
      collectives.append(CollectiveWork(event.kind, group(event.axes), size, event.op_name))
      if event.op_name in again:
        collectives.append(CollectiveWork(event.kind, group(event.axes), size, event.op_name))
  return Work(devices, ops, flops, nbytes, tuple(collectives), peak)
