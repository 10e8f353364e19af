"""The global view's expansion: every device's copy of a partitioned global graph, as one ``GraphDef``.

:func:`expand` makes one copy of every op per device at local shapes (of the
ops whose results are used), as one ``GraphDef``: inputs relayouted as the
rule requires (a local slice, or an ``all_gather`` placeholder), constant
shape operands replaced by local values, and an ``all_reduce`` placeholder
after every op whose output holds partial sums; with a sharded update
(``_partition_owners``), an optimizer update runs on one device per batch
group and a ``broadcast`` placeholder hands its result to the group. The
placeholders are the ones :func:`rewrite.emit` leaves for the local view, so
:func:`rewrite.plan` and :func:`rewrite.apply` lower them unchanged.

Ops are copied as their own ``NodeDef`` (any op type, its attributes as
traced), renamed, placed and rewired.
"""

from __future__ import annotations

import contextvars
import dataclasses
import re
from typing import Callable

import numpy as np
import tensorflow as tf

from rewrite import _errors
from rewrite import _partition_owners
from rewrite import _placeholders
from rewrite import _propagation
from rewrite import _relayout
from rewrite.rules import _base

# Ops that pass their inputs through unchanged at run time: not copied, their outputs are their inputs
# (MobileNetV2's step has 1,500 per device; the runtime would remove them, at a cost in the first call).
_ALIASES = ("Identity", "IdentityN", "StopGradient", "Snapshot")

_ABSENT = object()  # a local value a device does not compute (another device of its group owns the op)

# The lowerings of the step being expanded (``expand``'s), for the collectives of the bodies expanded per device
# meanwhile (``expand_on_device``, called by the rules of the ops that call them).
_LOWERINGS: contextvars.ContextVar = contextvars.ContextVar("expansion_lowerings", default=None)


@dataclasses.dataclass(frozen=True)
class _Pending:
  """An output of a node in the expander's batch, not imported yet: the node, output index, dtype, local shape."""

  node: str
  index: int
  dtype: tf.DType
  shape: tf.TensorShape

  @property
  def name(self) -> str:
    return f"{self.node}:{self.index}"


class _Expander:
  r"""Builds the per-device copies of a global graph's ops, as one ``GraphDef``.

  The copies (and the slices of relayouts) are ``NodeDef``\ s of the global
  graph's ops, renamed, re-placed and rewired: nothing is imported while
  expanding (an import costs time in the size of the whole graph; a graph
  built op by op costs more). Real ops are made in the current graph (a plain
  ``tf.Graph`` the caller made, holding the step's inputs and handles) only
  where Python must build them: collective placeholders (they need only their
  input's name, dtype and shape) and rules that lower themselves (their
  inputs are stand-in placeholders for the copies they read). :meth:`finish`
  merges the two in the order they were made, so the ``GraphDef`` lists every
  op after its inputs and the ops of each device in the step's order (its
  caller orders reads and writes of a variable by it).
  """

  def __init__(self, graph, mesh, partition, locate, ownership=None, only=None):
    self.graph = graph
    # Expand for these devices alone (None: all): one device (a branch of an If, made per device), or this
    # process's devices (one process of a multi-client job; the others expand theirs).
    self.only = None if only is None else frozenset(only)
    self.mesh = mesh
    self.partition = partition
    self.locate = locate
    self.ownership = ownership if ownership is not None else _partition_owners.Ownership()
    self._broadcasts: dict = {}  # (tensor name, device) -> the owner's value, received
    self.devices = mesh.devices
    self.records = [[] for _ in self.devices]
    self.local = {}  # global tensor name -> per-device local tensors (or _Pending)
    self.target = tf.compat.v1.get_default_graph()  # where real ops are made
    self._nodes: list = []  # the copies' NodeDefs, in order
    self._marks: list = []  # (target graph version, number of copies made before those ops)
    self._standins: dict = {}  # stand-in placeholder op name in the target graph -> the copy's tensor name
    self._consts: dict = {}  # name of a constant's copy -> its NodeDef
    self._const_by_value: dict = {}  # (device, dtype, shape, bytes) -> the constant's copy
    self._count = 0
    self._relayouts: dict = {}  # (tensor name, device, layout) -> the relayouted piece
    self._feeds: dict = {}  # name -> the placeholder of a Feed
    self._placeholders: set = set()  # output names of the collective placeholders made
    self._tensor_owners: dict = {}  # a pipelined step's pass-through outputs -> their inputs' owners
    self._idle: set = set()  # the zeros of idle collective calls (a pipelined step's)
    self._mark()

  # -- the copies ------------------------------------------------------------------

  def _mark(self) -> None:
    """Records that the target graph's ops made so far come before the copies made after now."""
    self._marks.append((self.target.version, len(self._nodes)))

  def _node(self, r: int, name: str, op: str) -> tf.compat.v1.NodeDef:
    node = tf.compat.v1.NodeDef(name=f"{_PREFIX}/replica_{r}/{name}", op=op, device=self.devices[r])
    self._nodes.append(node)
    return node

  def _real(self, x):
    """``x`` as a tensor of the target graph (a stand-in placeholder for a copy; a constant, remade)."""
    if not isinstance(x, _Pending):
      return x
    if x.node in self._consts:  # a rule may need its value (an axis, say)
      node = self._consts[x.node]
      with tf.device(node.device):
        return tf.constant(tf.make_ndarray(node.attr["value"].tensor), dtype=x.dtype)
    standin = tf.raw_ops.Placeholder(dtype=x.dtype, shape=x.shape, name="standin")
    self._standins[standin.op.name] = x.name
    return standin

  @staticmethod
  def _ref(x) -> str:
    """How a copy names ``x`` (a copy's output, or a tensor of the target graph) as an input."""
    return x.name

  def _const(self, r, value, dtype) -> _Pending:
    """A constant on device ``r``: one node per device and value (MobileNetV2's step: 529 for 7,344 uses)."""
    dtype = tf.as_dtype(dtype)
    if dtype == tf.string:
      key = (r, tf.make_tensor_proto(value, dtype=dtype).SerializeToString())
    else:  # keyed by its bytes: a tensor proto costs more than the lookup (7,224 uses in MobileNetV2's step)
      array = np.asarray(value, dtype=dtype.as_numpy_dtype)
      key = (r, dtype, array.shape, array.tobytes())
    if key not in self._const_by_value:
      proto = tf.make_tensor_proto(value, dtype=dtype)
      self._count += 1
      node = self._node(r, f"const_{self._count}", "Const")
      node.attr["dtype"].type = dtype.as_datatype_enum
      node.attr["value"].tensor.CopyFrom(proto)
      self._consts[node.name] = node
      self._const_by_value[key] = _Pending(node.name, 0, dtype, tf.TensorShape(np.shape(value)))
    return self._const_by_value[key]

  def _fed(self, feed: "Feed") -> _Pending:
    """The placeholder node of a value fed from outside (made once, under its own name)."""
    if feed.name not in self._feeds:
      node = tf.compat.v1.NodeDef(name=feed.name, op="Placeholder")
      node.attr["dtype"].type = feed.dtype.as_datatype_enum
      node.attr["shape"].shape.CopyFrom(tf.TensorShape(feed.shape).as_proto())
      self._nodes.append(node)
      self._feeds[feed.name] = _Pending(feed.name, 0, feed.dtype, tf.TensorShape(feed.shape))
    return self._feeds[feed.name]

  def _zeros(self, r, shape, dtype) -> _Pending:
    zero = np.zeros((), tf.as_dtype(dtype).as_numpy_dtype) if tf.as_dtype(dtype) != tf.string else b""
    dims, zero = self._ref(self._const(r, shape.as_list(), tf.int32)), self._ref(self._const(r, zero, dtype))
    self._count += 1
    node = self._node(r, f"zeros_{self._count}", "Fill")
    node.input.extend([dims, zero])
    node.attr["T"].type = tf.as_dtype(dtype).as_datatype_enum
    node.attr["index_type"].type = tf.int32.as_datatype_enum
    return _Pending(node.name, 0, tf.as_dtype(dtype), shape)

  def _idle_zeros(self, r, shape, dtype) -> _Pending:
    """Zeros for an idle collective call on device ``r`` (recorded: what is made from them alone is unused)."""
    zeros = self._zeros(r, shape, dtype)
    self._idle.add(zeros.node)
    return zeros

  def _cast(self, r, x, dtype) -> _Pending:
    self._count += 1
    node = self._node(r, f"cast_{self._count}", "Cast")
    node.input.append(self._ref(x))
    node.attr["SrcT"].type = x.dtype.as_datatype_enum
    node.attr["DstT"].type = tf.as_dtype(dtype).as_datatype_enum
    return _Pending(node.name, 0, tf.as_dtype(dtype), x.shape)

  def _slice(self, r, x, begin, size, shape) -> _Pending:
    begin_ref, size_ref = self._ref(self._const(r, begin, tf.int32)), self._ref(self._const(r, size, tf.int32))
    self._count += 1
    node = self._node(r, f"slice_{self._count}", "Slice")
    node.input.extend([self._ref(x), begin_ref, size_ref])
    node.attr["T"].type = x.dtype.as_datatype_enum
    node.attr["Index"].type = tf.int32.as_datatype_enum
    return _Pending(node.name, 0, x.dtype, tf.TensorShape(shape))

  # -- communication -----------------------------------------------------------

  def _stood_for(self, x):
    """What ``x`` stands for if it is a stand-in (a rule's input or a collective's result, returned as is)."""
    if isinstance(x, tf.Tensor) and x.op.name in self._standins:
      node, _, index = self._standins[x.op.name].rpartition(":")
      return _Pending(node, int(index), x.dtype, x.shape)
    return x

  def _emit(self, r, x, kind, params, axes, shape, op):
    """A collective placeholder on device ``r``'s ``x`` (a node of the batch): its output, not made yet."""
    x = self._stood_for(x)
    self._mark()  # the target graph's ops made so far (a rule's, computing x) come first
    if x.name in self._placeholders:  # a placeholder is removed by the rewrite; its consumers are rewired
      self._count += 1
      node = self._node(r, f"identity_{self._count}", "Identity")
      node.input.append(x.name)
      node.attr["T"].type = x.dtype.as_datatype_enum
      x = _Pending(node.name, 0, x.dtype, x.shape)
    self._count += 1
    name = f"{_PREFIX}/replica_{r}/{_placeholders.PLACEHOLDER_SCOPE}/{kind}_{self._count}"
    node, record = _placeholders.emit_node(
        x, name, replica=r, index=len(self.records[r]), kind=kind, params=params, axes=tuple(axes), result_shape=shape,
        device=self.devices[r], location=self.locate(op), call=f"{op.type} {op.name}")
    self._nodes.append(node)
    self.records[r].append(record)
    y = _Pending(name, 0, x.dtype, tf.TensorShape(shape))
    self._placeholders.add(y.name)
    return y

  def _received(self, r, t, owner, op):
    """Device ``r``'s copy of ``t``, which only the owner of each group computed: broadcast from it."""
    key = (t.name, r)
    if key not in self._broadcasts:
      shape = self._local_shape(t, self.partition.layouts[t.name])
      if self.mesh.axis_index(r, owner.axes) == owner.position:
        x = self.local[t.name][r]
      else:
        x = self._zeros(r, shape, t.dtype)  # what the owner sends replaces it
      self._broadcasts[key] = self._emit(r, x, "broadcast", {"source": owner.position}, owner.axes, shape, op)
    return self._broadcasts[key]

  def relayout(self, r, x, have, want, global_shape, op):
    """Device ``r``'s piece ``x`` (layout ``have``) as its piece in layout ``want``."""
    if have == want:
      return x
    merged = [d for d, (h, w) in enumerate(zip(have, want)) if isinstance(h, _base.Merged) and h != w]
    if merged:  # gathered whole first, in order
      for d in merged:
        x = self._gather_merged(r, x, d, have[d], op)
      have = tuple(() if d in merged else h for d, h in enumerate(have))
      return self.relayout(r, x, have, want, global_shape, op)
    merged = [d for d, (h, w) in enumerate(zip(have, want)) if isinstance(w, _base.Merged) and h != w]
    if merged:  # whole first, then the device's blocks of each part
      x = self.relayout(r, x, have, tuple(() if d in merged else w for d, w in enumerate(want)), global_shape, op)
      for d in merged:
        x = self._slice_merged(r, x, d, want[d])
      return x
    # Move axes between dimensions (all_to_all), gather every dimension whose split still changes, then slice to
    # the wanted split.
    plan = _relayout.steps(have, want, global_shape, self.mesh.axis_size)
    have = list(have)
    for d1, d2, axes in plan.moved:
      shape = x.shape.as_list()
      k = self.mesh.axis_size(axes)
      shape[d1], shape[d2] = shape[d1] * k, shape[d2] // k
      x = self._emit(r, x, "all_to_all", {"split_dimension": d2, "concat_dimension": d1}, axes,
                     tf.TensorShape(shape), op)
      have[d1], have[d2] = (), axes
    for d, h in plan.gathered:
      shape = x.shape.as_list()
      shape[d] *= self.mesh.axis_size(h)
      x = self._emit(r, x, "all_gather", {"concat_dimension": d}, h, tf.TensorShape(shape), op)
      have[d] = tuple(have[d][:len(have[d]) - len(h)]) if tuple(have[d][len(have[d]) - len(h):]) == tuple(h) else ()
    begin, size, shape = [], [], x.shape.as_list()
    sliced = False
    for d, (h, w) in enumerate(zip(have, want)):
      if w and h != w:
        n = self.mesh.axis_size(w)
        chunk = global_shape[d] // n
        if h:  # (a finer split of the block held: _relayout.refined) the part of it along the further axes
          begin.append(self.mesh.axis_index(r, tuple(w[len(h):])) * chunk)
        else:
          begin.append(self.mesh.axis_index(r, w) * chunk)
        size.append(chunk)
        shape[d] = chunk
        sliced = True
      else:
        begin.append(0)
        size.append(-1)
    if sliced:
      x = self._slice(r, x, begin, size, shape)
    return x

  def _gather_merged(self, r, x, d, merged, op):
    """Device ``r``'s piece ``x`` with its merged dimension ``d`` gathered whole, the rows in the global order.

    The all-gather concatenates the devices' pieces in their order along the
    merged dimension's axes: blocks ``[s_1, ..., s_k, n_1/s_1, ..., n_k/s_k]``
    of the parts (``s_q`` devices along part ``q``'s axes), which are put in
    the order ``[s_1, n_1/s_1, ..., s_k, n_k/s_k]``.
    """
    shape = x.shape.as_list()
    shape[d] *= self.mesh.axis_size(tuple(merged))
    x = self._emit(r, x, "all_gather", {"concat_dimension": d}, tuple(merged), tf.TensorShape(shape), op)
    counts = [self.mesh.axis_size(axes) if axes else 1 for _, axes in merged.parts]
    blocks = [n // c for (n, _), c in zip(merged.parts, counts)]
    k = len(counts)
    x = self._reshape(r, x, shape[:d] + counts + blocks + shape[d + 1:])
    order = [q for pair in zip(range(d, d + k), range(d + k, d + 2 * k)) for q in pair]
    perm = list(range(d)) + order + list(range(d + 2 * k, len(shape) + 2 * k - 1))
    x = self._transpose(r, x, perm)
    return self._reshape(r, x, shape)

  def _slice_merged(self, r, x, d, merged):
    """Device ``r``'s piece of the merged dimension ``d`` of ``x`` (whole there): its block of each part."""
    shape = x.shape.as_list()
    sizes = [n for n, _ in merged.parts]
    x = self._reshape(r, x, shape[:d] + sizes + shape[d + 1:])
    begin, size = [0] * (len(shape) + len(sizes) - 1), [-1] * (len(shape) + len(sizes) - 1)
    local = list(shape[:d]) + [0] * len(sizes) + list(shape[d + 1:])
    for q, (n, axes) in enumerate(merged.parts):
      count = self.mesh.axis_size(axes) if axes else 1
      begin[d + q] = self.mesh.axis_index(r, axes) * (n // count) if axes else 0
      size[d + q] = local[d + q] = n // count
    x = self._slice(r, x, begin, size, local)
    shape[d] //= self.mesh.axis_size(tuple(merged))
    return self._reshape(r, x, shape)

  def _reshape(self, r, x, shape) -> _Pending:
    return self._shaped(r, x, "Reshape", "Tshape", shape, shape)

  def _transpose(self, r, x, perm) -> _Pending:
    shape = x.shape.as_list()
    return self._shaped(r, x, "Transpose", "Tperm", perm, [shape[p] for p in perm])

  def _shaped(self, r, x, op_type: str, attr: str, operand, shape) -> _Pending:
    """A ``Reshape`` (``Transpose``) of ``x`` on device ``r`` by the constant ``operand``: its output of ``shape``."""
    operand_ref = self._ref(self._const(r, list(operand), tf.int32))
    self._count += 1
    node = self._node(r, f"{op_type.lower()}_{self._count}", op_type)
    node.input.extend([self._ref(x), operand_ref])
    node.attr["T"].type = x.dtype.as_datatype_enum
    node.attr[attr].type = tf.int32.as_datatype_enum
    return _Pending(node.name, 0, x.dtype, tf.TensorShape(shape))

  # -- ops -----------------------------------------------------------------------

  def _copies(self, op, decision, inputs_per_device) -> list:
    """Every device's copy of ``op`` (NodeDefs of the batch): per device, its outputs (_Pending)."""
    outputs = []
    template = tf.compat.v1.NodeDef()
    template.CopyFrom(op.node_def)  # read once (TensorFlow serializes it on each read)
    del template.input[:]
    if "_class" in template.attr:  # colocation with ops of the global graph, which is not imported
      del template.attr["_class"]
    for name, value in decision.attrs.items():
      template.attr[name].i = value
    kinds = [(k, t.dtype, self._local_shape(t, decision.computed(k))) for k, t in enumerate(op.outputs)]
    for r, inputs in enumerate(inputs_per_device):
      if inputs is None:  # not run on this device
        outputs.append(None)
        continue
      node = self._node(r, op.name, op.type)
      node.CopyFrom(template)
      node.name = f"{_PREFIX}/replica_{r}/{op.name}"
      node.device = self.devices[r]
      node.input.extend(self._ref(x) for x in inputs)
      outputs.append([_Pending(node.name, k, dtype, shape) for k, dtype, shape in kinds])
    return outputs

  def _local_shape(self, t, layout) -> tf.TensorShape:
    if layout is None or t.shape.rank is None:
      return t.shape
    return tf.TensorShape([n if n is None or not axes else n // self.mesh.axis_size(axes)
                           for n, axes in zip(t.shape.as_list(), layout)])

  def run(self, local_inputs: dict) -> None:
    layouts = self.partition.layouts
    for op in _propagation.ordered(self.graph):
      if op.type == "Placeholder":
        name = op.outputs[0].name
        if name not in local_inputs and not op.outputs[0].consumers():
          continue  # a function body's own argument, replaced on import (_functions.body)
        if name not in local_inputs:
          raise _errors.RewriteError(f"The global graph's input {name} has no value to expand with.")
        self.local[name] = [self._fed(x) if isinstance(x, Feed) else _ABSENT if x is None and self._here(r) else x
                            for r, x in enumerate(local_inputs[name])]  # (None here: not held, a placed variable)
        continue
      if op.type in ("Const", "NoOp") or op.name not in self.partition.decisions:
        continue  # constants are made per device on first use; dead ops are left out
      decision = self.partition.decisions[op.name]
      if decision.values:  # the same constant on every device (a shape query's global answer)
        for k, t in enumerate(op.outputs):
          self.local[t.name] = [self._const(r, decision.values[k], t.dtype) if self._here(r) else None
                                for r in range(len(self.devices))]
        continue
      owner = self.ownership.ops.get(op.name)
      pipelined = self.ownership.pipelined
      if pipelined and op.type in _ALIASES and not any(r is not None for r in decision.reduce):
        self._pass_through(op)  # (each output its input: on its input's stage, absent elsewhere)
        continue
      inputs_per_device, idle = [], []  # idle: devices of another stage, making this op's collective calls
      for r in range(len(self.devices)):
        if not self._here(r) or not self.ownership.runs_on(op.name, self.mesh, r):
          inputs_per_device.append(None)  # another device of the group runs it
          if pipelined and self._here(r):
            idle.append(r)
          continue
        inputs = []
        for i, t in enumerate(op.inputs):
          if i in decision.consts:
            inputs.append(self._const(r, decision.consts[i], t.dtype))
            continue
          source = self._source(t)
          if source is not None and source != owner:
            x = self._from_stage(r, t, source) if pipelined else self._received(r, t, source, op)
          else:
            x = self._local(r, t)
          inputs.append(self._input(r, op, decision, i, t, x))
        inputs_per_device.append(inputs)
      for r in idle:  # the relayouts' collective calls, on zeros (left unused: not run)
        for i, t in enumerate(op.inputs):
          want = decision.inputs[i] if i < len(decision.inputs) else None
          have = layouts[t.name]
          have = tuple(have) if isinstance(have, _base.Pending) else have
          if i not in decision.consts and t.dtype != tf.resource and want is not None and want != have:
            shape = self._local_shape(t, have)
            shape = tf.TensorShape([0 if n is None else n for n in shape.as_list()] if shape.rank is not None
                                   else [0])  # (unknown sizes: a group of idle devices, on empty values)
            self._input(r, op, decision, i, t, self._idle_zeros(r, shape, t.dtype), idle=True)
      if decision.once:  # its inputs were relayouted everywhere (collectives need the group); it runs on one:
        # device 0 (in a multi-client job, in its process alone), or a pipelined step's first device that runs it
        first = next((r for r, inputs in enumerate(inputs_per_device) if inputs is not None), None) if pipelined else 0
        inputs_per_device = [inputs if r == first else None for r, inputs in enumerate(inputs_per_device)]
      if op.type in _ALIASES and not any(r is not None for r in decision.reduce):
        outputs_per_device = inputs_per_device  # no copy: its consumers read its (relayouted) input
      elif decision.lower is not None:  # the rule computes each device's outputs itself, in Python
        outputs_per_device = []
        for r, device in enumerate(self.devices):
          if inputs_per_device[r] is None:
            outputs_per_device.append(None)
            continue
          with tf.device(device), tf.name_scope(f"replica_{r}/{op.name}"):
            real = [self._real(x) for x in inputs_per_device[r]]
            if decision.communicates:
              outputs = list(decision.lower(r, real, _Comm(self, r, op)))
            else:
              outputs = list(decision.lower(r, real))
            outputs = [self._stood_for(y) for y in outputs]  # the copies name what a stand-in stands for
          for k, (y, t) in enumerate(zip(outputs, op.outputs)):
            if isinstance(y, tf.Tensor):  # (the rule's ops may not infer it from stand-ins; before any scatter)
              y.set_shape(self._local_shape(t, decision.computed(k)))
          outputs_per_device.append(outputs)
          self._mark()
      else:
        outputs_per_device = self._copies(op, decision, inputs_per_device)
      for r, outputs in enumerate(outputs_per_device):
        if outputs is None:
          for k, t in enumerate(op.outputs):
            if r in idle and decision.reduce[k] is not None:  # the reduction's calls, on zeros
              shape = [0 if n is None else n for n in self._local_shape(t, decision.computed(k)).as_list()]
              self._reduced(r, op, decision, k, self._idle_zeros(r, tf.TensorShape(shape), t.dtype))
            self.local.setdefault(t.name, [None] * len(self.devices))[r] = _ABSENT
          continue
        for k, t in enumerate(op.outputs):
          y = outputs[k]
          if decision.reduce[k] is not None:
            y = self._reduced(r, op, decision, k, y)
          self.local.setdefault(t.name, [None] * len(self.devices))[r] = y

  def _input(self, r, op, decision, i, t, x, idle=False):
    """Device ``r``'s input ``i`` of ``op`` (``x``: its piece of ``t``), relayouted as the op's rule wants it.

    ``idle``: ``x`` stands for the piece on a device that does not run ``op`` (a pipeline's other stage), which
    makes the relayout's collective calls alone (its relayouts kept apart from the ones it uses)."""
    want = decision.inputs[i] if i < len(decision.inputs) else None
    have = self.partition.layouts[t.name]
    if isinstance(have, _base.Pending):  # partial sums the Sum reading them sums (its own reduce)
      have = tuple(have)
    if want is not None and t.dtype != tf.resource and want != have:
      key = (r, idle, _relayout.reuse_key(t, want, op.name, have))  # one per tensor, device and layout, mostly
      if key not in self._relayouts:
        self._relayouts[key] = self.relayout(r, x, have, want, t.shape.as_list(), op)
      x = self._relayouts[key]
    return x

  def _reduced(self, r, op, decision, k, y):
    """Device ``r``'s output ``k`` of ``op`` (``y``, partial) after the reduction its rule asks for."""
    t = op.outputs[k]
    combine, axes = decision.reduce[k]
    for d, over in decision.scatter.get(k, ()):  # summed into each device's piece of dimension d
      shape = y.shape.as_list()
      shape[d] //= self.mesh.axis_size(over)
      y = self._emit(r, y, "reduce_scatter", {"op": combine, "scatter_dimension": d}, over,
                     tf.TensorShape(shape), op)
      axes = tuple(a for a in axes if a not in over)
    if decision.scatter.get(k) and decision.scattered(k) != decision.outputs[k]:  # split further: sliced
      y = self.relayout(r, y, decision.scattered(k), decision.outputs[k], t.shape.as_list(), op)
    if axes and y.dtype == tf.bool:  # All, Any: the min or max of 0/1 (collectives take numbers)
      y = self._emit(r, self._cast(r, y, tf.int32), "all_reduce", {"op": combine}, axes, y.shape, op)
      y = self._cast(r, y, tf.bool)
    elif axes:
      y = self._emit(r, y, "all_reduce", {"op": combine}, axes, y.shape, op)
    return y

  # -- a pipeline's stages -----------------------------------------------------------

  def _source(self, t):
    """The owner whose devices alone compute ``t`` (a pass-through's output: its input's), or None."""
    return self._tensor_owners.get(t.name, self.ownership.ops.get(t.op.name))

  def _pass_through(self, op) -> None:
    """An ``Identity``-like op of a pipelined step: each output is its input, on its input's stage."""
    for x, y in zip(op.inputs, op.outputs):
      source = self._source(x)
      if source is not None:
        self._tensor_owners[y.name] = source
      values = self.local.get(x.name)
      self.local[y.name] = [None if not self._here(r) else _ABSENT if values is not None and values[r] is _ABSENT
                            else self._local(r, x) for r in range(len(self.devices))]

  def _from_stage(self, r, t, source):
    """Device ``r``'s piece of ``t``, which another stage computes: its device's value (a cross-device edge)."""
    coords = self.mesh.coords(r)
    for axis, position in zip(source.axes, _positions(self.mesh, source.axes, source.position)):
      coords[axis] = position
    other = self.mesh.index(coords)
    if not self._here(other):
      raise _errors.UnsupportedError(
          f"{t.op.type} {t.op.name} runs on device {r} and reads {t.name} from device {other}, which another process "
          "runs: a pipeline's stages in different processes are not supported in the global view yet.")
    return self._local(other, t)

  def _here(self, r) -> bool:
    return self.only is None or r in self.only

  def _local(self, r, t):
    if t.op.type == "Const" and t.name not in self.local:
      self.local[t.name] = [None] * len(self.devices)
    values = self.local[t.name]
    if values[r] is None:  # a constant, made on this device
      values[r] = self._const(r, tf.get_static_value(t), t.dtype)
    if values[r] is _ABSENT:
      raise _errors.RewriteError(f"{t.name} is computed by one device of each group only, and device {r} "
                                 "needs it: the sharded update's ownership is inconsistent (a bug).")
    return values[r]

  def output(self, t, replicated: bool = True) -> list:
    """Every device's value of global tensor ``t`` (gathered to its whole value if ``replicated``)."""
    values = []
    source = self._source(t) if self.ownership.pipelined else None
    for r in range(len(self.devices)):
      if not self._here(r):
        continue
      absent = source is not None and self.local[t.name][r] is _ABSENT
      x = self._from_stage(r, t, source) if absent else self._local(r, t)
      if replicated and t.dtype != tf.resource:
        x = self.relayout(r, x, self.partition.layouts[t.name], _base.replicated(t.shape.rank),
                          t.shape.as_list(), t.op)
      values.append(x)
    return values

  def finish(self, values: list) -> "Expansion":
    """The expansion: the copies and the target graph's ops merged in order; ``values`` named."""
    made = self.target.as_graph_def()  # creation order
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(made.versions)
    graph_def.library.CopyFrom(made.library)
    marks, m, copied = self._marks, 0, 0
    for index, node in enumerate(made.node, start=1):  # an op's place: the copies made before it
      while m < len(marks) and marks[m][0] < index:
        m += 1
      before = marks[m][1] if m < len(marks) else len(self._nodes)
      graph_def.node.extend(self._nodes[copied:before])
      copied = max(copied, before)
      if node.name in self._standins:
        continue
      if any(_split(i)[0] in self._standins for i in node.input):
        inputs = [self._standins[_split(i)[0]] if _split(i)[0] in self._standins else i for i in node.input]
        del node.input[:]
        node.input.extend(inputs)
      graph_def.node.append(node)
    graph_def.node.extend(self._nodes[copied:])
    outputs = [[self._ref(x) for x in per_device] for per_device in values]
    records = [records if self._here(r) else None for r, records in enumerate(self.records)]
    return Expansion(graph_def, outputs, records, frozenset(self._idle))


class _Comm:
  """Collectives a self-lowering rule asks for in the middle of its ops (see ``Decision.communicates``)."""

  def __init__(self, expander, r, op):
    self._expander, self._r, self._op = expander, r, op

  def all_reduce(self, x: tf.Tensor, op: str, axes: tuple) -> tf.Tensor:
    expander = self._expander
    y = expander._emit(self._r, x, "all_reduce", {"op": op}, tuple(axes), x.shape, self._op)  # pylint: disable=protected-access
    return expander._real(y)  # pylint: disable=protected-access  (the rule goes on with it)

  def all_gather(self, x: tf.Tensor, dim: int, axes: tuple) -> tf.Tensor:
    """The pieces of ``x`` of every device along ``axes``, concatenated along ``dim`` in the mesh's order."""
    expander = self._expander
    shape = x.shape.as_list()
    if shape[dim] is not None:
      shape[dim] *= expander.mesh.axis_size(tuple(axes))
    y = expander._emit(self._r, x, "all_gather", {"concat_dimension": dim}, tuple(axes), tf.TensorShape(shape),  # pylint: disable=protected-access
                       self._op)
    return expander._real(y)  # pylint: disable=protected-access

  def permute(self, x: tf.Tensor, pairs, axes: tuple) -> tf.Tensor:
    """``x`` sent point to point: a device at position ``d`` along ``axes`` gets the value of the one at ``s``
    for each ``(s, d)`` of ``pairs``; a device no pair names gets zeros."""
    expander = self._expander
    y = expander._emit(self._r, x, "permute", {"perm": tuple(sorted((int(s), int(d)) for s, d in pairs))}, tuple(axes), x.shape,  # pylint: disable=protected-access
                       self._op)
    return expander._real(y)  # pylint: disable=protected-access


_PREFIX = "expand"  # the copies' names: expand/replica_<r>/<op name in the global graph>
_COPY = re.compile(rf"^{_PREFIX}/replica_\d+/(.*)$")


_MADE = re.compile(r"^replica_(\d+)/(.*)$")  # the ops a rule makes for a copy, in Python: replica_<r>/<op name>/...


def _positions(mesh, axes, position: int) -> list:
  """Each axis's coordinate of ``position`` along ``axes`` (row-major, as ``Mesh.axis_index`` counts)."""
  out = []
  for axis in reversed(axes):
    position, here = divmod(position, mesh.shape[axis])
    out.append(here)
  return out[::-1]


_COPY_OF = re.compile(rf"^{_PREFIX}/replica_(\d+)/(.*)$")


def copy_of(name: str) -> tuple[int, str] | None:
  """``(device position, global op name)`` of a copy's node name (``expand/replica_<r>/<op>``); else None."""
  copy = _COPY_OF.match(name)
  return None if copy is None else (int(copy.group(1)), copy.group(2))


def copy_name(r: int, name: str) -> str:
  """The name of device position ``r``'s copy of (or node made for) global op ``name``."""
  return f"{_PREFIX}/replica_{r}/{name}"


def global_name(name: str) -> str | None:
  """The global graph's name of a device's copy (a node's or a tensor's name, ``expand/replica_<r>/...``); else None."""
  copy = _COPY.match(name)
  return copy.group(1) if copy is not None else None


def made_for(name: str, names) -> tuple[str, str] | None:
  """(the prefix of its device's copies, the global op) of a node made for a global op in ``names``, else None.

  A node made for a global op is its copy (``expand/replica_<r>/<op>``) or an op its rule made in Python
  (``replica_<r>/<op>/...``).
  """
  copy = _COPY.match(name)
  if copy is not None:
    return (name[:len(name) - len(copy.group(1))], copy.group(1)) if copy.group(1) in names else None
  made = _MADE.match(name)
  if made is None:
    return None
  parts = made.group(2).split("/")
  for k in range(len(parts) - 1, 0, -1):
    if "/".join(parts[:k]) in names:
      return f"{_PREFIX}/replica_{made.group(1)}/", "/".join(parts[:k])
  return None


def _split(ref: str) -> tuple[str, str]:
  """``"a:1"`` -> ``("a", "1")`` (standins have one output, and no control edges point at them)."""
  name, _, port = ref.partition(":")
  return name, port


@dataclasses.dataclass(frozen=True)
class Feed:
  """A value :func:`expand` takes from outside (a variable's handle): a placeholder node named ``name``.

  Cheaper than a placeholder op made in Python (a step of MobileNetV2 feeds
  2,320 handles), and fed by name when the expansion is imported.
  """

  name: str
  dtype: tf.DType
  shape: tf.TensorShape


@dataclasses.dataclass
class Expansion:
  """Every device's copy of a global graph (:func:`expand`).

  Attributes:
    graph_def: the copies, the step's inputs and collective placeholders, in order.
    outputs: per output of the global graph, per device, its tensor's name in ``graph_def``.
    records: per device, its collective placeholders' records in call order (for :func:`rewrite.plan`); None
      for a device not expanded (``only``).
    idle: the nodes of the zeros a pipelined step's devices make their idle collective calls on (what is made
      from them alone is never used: :func:`rewrite.without_idle` removes it once the calls are lowered).
  """

  graph_def: tf.compat.v1.GraphDef
  outputs: list
  records: list
  idle: frozenset = frozenset()


def expand(graph: tf.Graph, mesh, partition: _propagation.Partition, local_inputs: dict, outputs,
           locate: Callable[[tf.Operation], str] = lambda op: f"{op.type} {op.name}", ownership=None,
           only=None, lowerings=None) -> Expansion:
  """Every device's copy of ``graph``, with the ops the current graph holds.

  Call it with a plain ``tf.Graph`` as the default graph, holding the
  ``local_inputs``: the result is that graph's ops and the copies, as one
  ``GraphDef``.

  Args:
    graph: the traced global graph.
    mesh: the device mesh.
    partition: from :func:`_partition.propagate`.
    local_inputs: name of each placeholder of ``graph`` -> one local tensor per
      device (its piece of an argument; the device's component handle of a
      variable): tensors of the current graph, or :class:`Feed` values.
    outputs: tensors of ``graph`` whose whole values every device returns.
    locate: names where an op came from, for the placeholders' records.
    ownership: ops run by one device per group (``_partition_owners.assign``);
      None: every op on every device.
    only: the devices (mesh indices) to expand for; None: every device. One
      process of a multi-client job expands its own (``local_inputs`` may
      hold None for the others): its records are None for the others'
      devices, as :func:`rewrite.plan` takes them, and its outputs are its
      devices' values only.
    lowerings: the lowering instances the step's collectives use, by name
      (``Config.lowerings``; a multi-worker Replicator's carry its collective
      timeout): the collectives inside function bodies, lowered as each
      device's copy is made (:func:`expand_on_device`), take their settings.

  Returns:
    The :class:`Expansion`.
  """
  expander = _Expander(graph, mesh, partition, locate, ownership, only)
  reset = _LOWERINGS.set(dict(lowerings or {}))
  try:
    expander.run(local_inputs)
  finally:
    _LOWERINGS.reset(reset)
  return expander.finish([expander.output(t) for t in outputs])


def local_piece(x: tf.Tensor, layout, mesh, r: int) -> tf.Tensor:
  """Device ``r``'s piece of a whole value ``x`` in ``layout`` (a local slice)."""
  shape = x.shape.as_list()
  begin, size = [], []
  for d, axes in enumerate(layout):
    if axes:
      chunk = shape[d] // mesh.axis_size(axes)
      begin.append(mesh.axis_index(r, axes) * chunk)
      size.append(chunk)
    else:
      begin.append(0)
      size.append(-1)
  return tf.slice(x, begin, size) if any(layout) else x


def expand_on_device(graph: tf.Graph, mesh, partition: _propagation.Partition, r: int, *inputs, outputs=None,
                     locate: Callable[[tf.Operation], str] = lambda op: f"{op.type} {op.name}",
                     collectives: Callable | None = None) -> list:
  """Device ``r``'s copy of ``graph`` (a function's body), made in the current graph on ``inputs``.

  ``inputs`` are device ``r``'s pieces of the body's arguments; returns its
  pieces of the body's outputs, in their layouts (or, given ``outputs``,
  relayouted to those layouts). Call it while tracing a ``tf.function`` (its
  automatic control dependencies order the body's reads and writes and keep
  its effects). A body whose layouts need collectives needs ``collectives``:
  ``collectives(graph_def, records, names, lowerings) -> (graph_def, names,
  input_map)`` lowers the placeholders (``records``, device ``r``'s) of the
  copy in ``graph_def`` inside it, with the settings of the step's
  ``lowerings`` (:func:`expand`'s, by name; empty outside it), and says where
  the outputs ``names`` went and what to feed its new inputs (a loop's,
  ``rules._control_flow.InBody``).
  """
  scratch = tf.Graph()
  with scratch.as_default():
    standins = [tf.raw_ops.Placeholder(dtype=x.dtype, shape=x.shape) for x in inputs]
    local_inputs = {t.name: [x if k == r else None for k in range(len(mesh.devices))]
                    for t, x in zip(graph.inputs, standins)}
    expander = _Expander(graph, mesh, partition, locate, only=(r,))
    expander.run(local_inputs)
    pieces = [expander.output(t, replicated=False)[0] for t in graph.outputs]
    if outputs is not None:
      pieces = [x if want is None or isinstance(want, _base.Contents) or t.dtype == tf.resource
                else expander.relayout(r, x, partition.layouts[t.name], want, t.shape.as_list(), t.op)
                for x, t, want in zip(pieces, graph.outputs, outputs)]
    expansion = expander.finish([[x] for x in pieces])
  input_map = {x.name: y for x, y in zip(standins, inputs)}
  names = [per_device[0] for per_device in expansion.outputs]
  graph_def = expansion.graph_def
  if expansion.records[r]:
    if collectives is None:
      raise _errors.RewriteError("A function body expanded per device needs communication (a bug: its rule "
                                 "should have refused it, or passed collectives=).")
    graph_def, names, fed = collectives(graph_def, expansion.records[r], names, _LOWERINGS.get() or {})
    input_map.update(fed)
  imported = tf.graph_util.import_graph_def(graph_def, input_map=input_map, return_elements=names or None,
                                            name="body")
  return list(imported or [])
