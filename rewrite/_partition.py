"""The global view's partitioner: layouts for every tensor of one global graph, then per-device ops.

1. :func:`propagate` gives every tensor of a traced global graph (static
   global shapes) a layout, op by op, from the layouts of its inputs (the
   step's arguments and the variables' handles) and the op's rule
   (``_rules_*`` modules). An op without a rule runs replicated on gathered
   inputs (a *fallback*, recorded).
2. :func:`expand` makes one copy of every op per device at local shapes
   (of the ops whose results are used), as one ``GraphDef``: inputs
   relayouted as the rule requires (a local slice, or an ``all_gather``
   placeholder), constant shape operands replaced by local values, and an
   ``all_reduce`` placeholder after every op whose output holds partial sums;
   with a sharded update (``_partition_owners``), an optimizer update runs on
   one device per batch group and a ``broadcast`` placeholder hands its result
   to the group. The placeholders are the ones :func:`rewrite.emit` leaves for
   the local view, so :func:`rewrite.plan` and :func:`rewrite.apply` lower them
   unchanged.

Ops are copied as their own ``NodeDef`` (any op type, its attributes as
traced), renamed, placed and rewired.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf

from rewrite import _errors
from rewrite import _op_kinds
from rewrite import _partition_owners
from rewrite import _placeholders
from rewrite import _relayout
from rewrite import _rules
from rewrite import _rules_contraction  # noqa: F401  (registers rules)
from rewrite import _rules_control_flow  # noqa: F401
from rewrite import _rules_convolution  # noqa: F401
from rewrite import _rules_effects  # noqa: F401
from rewrite import _rules_elementwise  # noqa: F401
from rewrite import _rules_gather  # noqa: F401
from rewrite import _rules_random  # noqa: F401
from rewrite import _rules_reduction  # noqa: F401
from rewrite import _rules_resource  # noqa: F401
from rewrite import _rules_scatter  # noqa: F401
from rewrite import _rules_segment  # noqa: F401
from rewrite import _rules_shape  # noqa: F401

_SOURCES = ("Placeholder", "Const")


@dataclasses.dataclass
class Partition:
  """Layouts chosen for one global graph.

  Attributes:
    layouts: tensor name -> layout (per dimension, the mesh axes it is split over).
    decisions: op name -> the rule's :class:`_rules.Decision`.
    fallbacks: names of ops that ran replicated for want of a rule.
  """

  layouts: dict
  decisions: dict
  fallbacks: list

  @property
  def unsupported(self) -> list[tuple[str, str]]:
    """``(op name, why)`` for every op that cannot run partitioned."""
    return [(name, d.unsupported) for name, d in self.decisions.items() if d.unsupported]

  def describe(self) -> str:
    rows = []
    for name, d in self.decisions.items():
      comms = [f"all_reduce({r[0]}, {r[1]})" for r in d.reduce if r]
      rows.append(f"{name}: out={d.outputs}{' ' + ', '.join(comms) if comms else ''}"
                  f"{' FALLBACK' if d.fallback else ''}")
    return "\n".join(rows)


MAX_ROUNDS = 8


def propagate(graph: tf.Graph, mesh, given: dict, handle_shapes: dict | None = None,
              summed: frozenset = frozenset(), data: frozenset = frozenset(),
              batch_axes: tuple = ()) -> Partition:
  """Layouts for every tensor of ``graph``, forward and backward to a fixed point.

  Forward, each op's rule gives its outputs' layouts from its inputs'.
  Backward, a tensor whose consumers all require the same layout *wants* it,
  and its producer's rule may produce it directly (an elementwise op on a
  sliced input, a ``Tile`` with local multiples) instead of every consumer
  slicing the whole value; the want travels up to the inputs. The two passes
  repeat until no layout changes.

  Args:
    graph: the traced global graph (every shape static).
    mesh: the device mesh (``mesh.Mesh``).
    given: tensor name -> layout for the graph's inputs (arguments and resource
      handles); other placeholders are replicated.
    handle_shapes: resource handle tensor name -> its variable's global shape.
    summed: resource handle tensor names of variables whose value is the sum
      of the devices' copies (on-read, ``SUM``-aggregated: a metric's state).
    data: tensor names of the step's data inputs (its batch). Where an op
      would gather a value computed from them along a mesh axis they are split
      over, because a value computed from variables alone is split over that
      axis on another dimension, the latter is gathered instead: the batch
      stays split and a weight split over the batch axis is gathered for its
      use, as fully sharded data parallelism does (:func:`_data_first`).
    batch_axes: the mesh axes the batch is split over where it is split (the
      data's own axes if empty); a batch of unknown size is not.

  Returns:
    The :class:`Partition`.
  """
  return Propagator(graph, mesh, handle_shapes, summed, data, batch_axes)(given)


class Propagator:
  """:func:`propagate` of one graph under many assignments of layouts (a layout search prices hundreds).

  The graph's ops are ordered once, shape arithmetic is folded once, and every
  rule's decision is remembered by the op, its inputs' layouts and the layouts
  wanted of its outputs (a rule is a function of those and of the graph, the
  mesh and the variables' shapes): an assignment that changes one variable's
  layout decides again only the ops whose inputs' layouts change.

  With ``alike``, ops alike (the same type, attributes, input and output
  shapes, constant inputs and variables' shapes: every block's copy of an
  op) share their decisions, so that a change is decided once, not once a
  block. For pricing only: a shared decision's ``lower``, ``attrs`` and
  reasons are another op's, so such a partition is not to be expanded.
  """

  def __init__(self, graph: tf.Graph, mesh, handle_shapes: dict | None = None, summed: frozenset = frozenset(),
               data: frozenset = frozenset(), batch_axes: tuple = (), alike: bool = False):
    dead = _dead(graph)
    self._ops = [op for op in ordered(graph) if op.name not in dead]
    self._mesh, self._handle_shapes, self._summed = mesh, handle_shapes or {}, frozenset(summed)
    self._data, self._batch_axes, self._alike = data, batch_axes, alike
    self._contexts: dict = {}  # the data's tensors and axes -> a context (its decisions remembered)
    self._derived = None  # the tensors computed from the data (once)

  def __call__(self, given: dict) -> Partition:
    """The :class:`Partition` of the graph with its inputs in ``given``'s layouts (see :func:`propagate`)."""
    ops = self._ops
    axes = _data_axes(given, self._data, self._batch_axes)
    if axes and self._derived is None:
      self._derived = _derived(ops, self._data)
    data = (self._derived, axes) if axes else (frozenset(), frozenset())
    context = self._contexts.get(data)
    if context is None:
      context = self._contexts[data] = _Context(self._mesh, self._handle_shapes, self._summed)
      context.data, context.data_axes = data
      context.alike = self._alike
    wants: dict = {}
    partition = _forward(ops, context, given, wants)
    for _ in range(MAX_ROUNDS):
      before, wants = wants, _backward(ops, context, partition, wants)
      if wants == before:
        return partition  # no new wish: a forward pass would decide the same
      again = _forward(ops, context, given, wants)
      if again.layouts == partition.layouts:
        return again
      partition = again
    return partition


def ordered(graph) -> list:
  """``graph``'s ops in creation order, except that an op comes after its inputs.

  Creation order is the step's program order, and topological but for ops
  TensorFlow rewrites after making them: a ``tf.while_loop``'s gradient gives
  the forward loop new inputs (its accumulators) made after it.
  """
  ops = graph.get_operations()
  index = {op.name: i for i, op in enumerate(ops)}
  late = [op for op in ops
          if any(index[x.op.name] > index[op.name] for x in op.inputs)
          or any(index[c.name] > index[op.name] for c in op.control_inputs)]
  if not late:
    return ops
  done: set = set()
  result: list = []

  def visit(op):  # depth first over inputs (iterative: long chains)
    stack = [(op, False)]
    while stack:
      o, expanded = stack.pop()
      if o.name in done:
        continue
      if expanded:
        done.add(o.name)
        result.append(o)
        continue
      stack.append((o, True))
      for x in reversed([x.op for x in o.inputs] + list(o.control_inputs)):
        if x.name not in done:
          stack.append((x, False))

  for op in ops:
    visit(op)
  return result


def _dead(graph) -> set:
  """Names of the ops of a function graph whose results nothing uses (no output, no effect depends on them).

  Left out of the partition: expanded, they would cost every device their
  work and, where their layouts need one, a collective (an unused gradient's
  partial sum, say), which the runtime cannot prune. Empty for a graph that
  is not a function's (no outputs known).
  """
  outputs = getattr(graph, "outputs", None)
  if outputs is None:
    return set()
  ops = graph.get_operations()
  by_name = {op.name: op for op in ops}
  stack = [t.op.name for t in outputs] + [op.name for op in getattr(graph, "control_outputs", ())]
  # Roots: effects. A read, or a random draw nobody reads (its own generator's state aside: a lazily built
  # module's initializer, lifted out of the step), has none.
  stack += [op.name for op in ops if op.type in _SOURCES
            or (op.op_def.is_stateful and op.type != "ReadVariableOp" and op.type not in _op_kinds.STATEFUL_RANDOM)]
  live: set = set()
  while stack:
    name = stack.pop()
    if name not in live:
      live.add(name)
      stack.extend(t.op.name for t in by_name[name].inputs)
  return {op.name for op in ops if op.name not in live}


_FOLDED_DTYPES = (tf.int32, tf.int64, tf.bool)
MAX_FOLDED_ELEMENTS = 64


class _Context:
  """What rules see besides the op: the mesh, the variables' shapes, and constant shape arithmetic."""

  def __init__(self, mesh, handle_shapes, summed=frozenset()):
    self.mesh = mesh
    self.handle_shapes = handle_shapes
    self.summed = summed
    self.data: frozenset = frozenset()  # tensors computed from the step's data inputs
    self.data_axes: frozenset = frozenset()  # the batch axes (where the batch is split)
    self._values: dict = {}
    self.decided: dict = {}  # (op, its inputs' layouts, its outputs' wanted layouts) -> the rule's decision
    self.alike = False  # ops alike share decisions (see Propagator)
    self._records: dict = {}
    self._kinds: dict = {}

  def record(self, op) -> "_Record":
    """What the propagation asks of ``op`` by the million, asked of TensorFlow once (its properties are slow)."""
    found = self._records.get(op)
    if found is None:
      found = self._records[op] = _Record(op, self._kind(op))
    return found

  def _kind(self, op):
    """What ``op``'s decisions are remembered by: its name; or, with ``alike``, a number for what makes ops alike."""
    if not self.alike:
      return op.name
    attrs = tuple(sorted((k, v.SerializeToString(deterministic=True)) for k, v in op.node_def.attr.items()
                         if not k.startswith("_")))
    ins = tuple((t.dtype, str(t.shape), str(self.handle_shapes.get(t.name)), t.name in self.summed,
                 t.name in self.data, self._constant(t)) for t in op.inputs)
    kind = (op.type, attrs, ins, tuple((t.dtype, str(t.shape)) for t in op.outputs))
    return self._kinds.setdefault(kind, len(self._kinds))  # (a number: a key hashed by the million)

  def _constant(self, t):
    """``t``'s value as a key, if it is a small integer one the traced shapes determine (a shape operand)."""
    if t.dtype not in _FOLDED_DTYPES or not t.shape.is_fully_defined() or t.shape.num_elements() > MAX_FOLDED_ELEMENTS:
      return None
    value = self.value(t)
    if value is None:
      return None
    value = np.asarray(value)
    return value.shape, value.dtype.str, value.tobytes()

  def know(self, t: tf.Tensor, value) -> None:
    """Records ``t``'s value (a shape query's global answer)."""
    self._values[t.name] = value

  def value(self, t: tf.Tensor):
    """``t``'s value if the traced shapes determine it (``tf.get_static_value``, or shape arithmetic folded)."""
    if t.name not in self._values:
      value = tf.get_static_value(t)
      if value is None and _foldable(t.op):
        inputs = [self.value(x) for x in t.op.inputs]
        if all(x is not None and x.size <= MAX_FOLDED_ELEMENTS for x in inputs):
          value = _evaluate(t.op, inputs)[t.value_index]
      self._values[t.name] = value
    return self._values[t.name]


_NOT_SOURCE = object()


class _Record:
  """One op's names, as the propagation asks them (see :meth:`_Context.record`).

  ``source``: a constant's or placeholder's own layout (replicated, unless given), else ``_NOT_SOURCE``.
  """

  __slots__ = ("name", "source", "inputs", "outputs", "data_inputs", "kind", "variant")

  def __init__(self, op, kind):
    self.name = op.name
    self.source = _rules.replicated(_rules.rank_of(op.outputs[0])) if op.type in _SOURCES else _NOT_SOURCE
    self.inputs = tuple(t.name for t in op.inputs)
    self.outputs = tuple(t.name for t in op.outputs)
    self.data_inputs = tuple(None if t.dtype == tf.resource else t.name for t in op.inputs)  # (handles: None)
    self.kind = kind
    self.variant = any(t.dtype == tf.variant for t in list(op.inputs) + list(op.outputs))


def _foldable(op) -> bool:
  """Small integer arithmetic without state (on shapes: gradient broadcasting, slices of shapes)."""
  if op.op_def.is_stateful or not op.inputs or op.type in ("Placeholder", "ReadVariableOp"):
    return False
  for t in op.outputs:
    if t.dtype not in _FOLDED_DTYPES or (t.shape.is_fully_defined() and t.shape.num_elements() > MAX_FOLDED_ELEMENTS):
      return False
  return all(x.dtype in _FOLDED_DTYPES for x in op.inputs)


def _evaluate(op, inputs):
  """Runs ``op`` on constant ``inputs`` (numpy values of each output)."""
  graph = tf.Graph()
  with graph.as_default():
    consts = [tf.constant(v, dtype=x.dtype) for v, x in zip(inputs, op.inputs)]
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.producer = op.graph.graph_def_versions.producer
    node = graph_def.node.add()
    node.CopyFrom(op.node_def)
    node.device = ""
    if "_class" in node.attr:
      del node.attr["_class"]
    del node.input[:]
    node.input.extend(c.op.name for c in consts)
    (copy,) = tf.graph_util.import_graph_def(graph_def, input_map={c.op.name: c for c in consts},
                                             return_elements=[node.name], name="fold")
  with tf.compat.v1.Session(graph=graph) as session:
    return session.run(list(copy.outputs))


def _decide(op, context, ins, wants, record=None) -> _rules.Decision:
  record = record or context.record(op)
  outs = tuple([wants.get(name) for name in record.outputs]) if wants else ()
  key = (record.kind, _key(ins), _key(outs)) if record.variant else (record.kind, tuple(ins), outs)
  decision = context.decided.get(key)
  if decision is None:
    decision = context.decided[key] = _decide_anew(op, context, ins, wants)
  return decision


def _key(layouts) -> tuple:
  """``layouts`` as a key: a variant's contents told apart from a layout (``Contents(()) == ()``)."""
  return tuple((x, True) if isinstance(x, _rules.Contents) else x for x in layouts)


def _decide_anew(op, context, ins, wants) -> _rules.Decision:
  rule = _rules.get(op.type)
  view = _rules.OpView(op, context.mesh, [wants.get(t.name) for t in op.outputs], context.handle_shapes,
                       context.value, context.summed, bodies=_BODIES)
  if rule is None:
    return _rules.fallback(view, ins)
  decision = _apply(rule, view, ins)
  if decision.fallback:  # the rule cannot split it so (a dimension of unknown size): without the weights' batch axes?
    again = _apply(rule, view, _without(view, context, ins, context.data_axes)) if context.data else decision
    return decision if again.fallback else again
  return _weights_stay(rule, view, context, ins, _data_first(rule, view, context, ins, decision))


def _apply(rule, view, ins) -> _rules.Decision:
  op = view.op
  try:
    decision = rule(view, ins)
  except _rules.UnknownRank:  # a shape of unknown rank (from a batch of unknown size): the whole value
    return _rules.fallback(view, ins)
  if _splits_unknown(op.inputs, decision.inputs) or _splits_unknown(op.outputs, decision.outputs):
    return _rules.fallback(view, ins)  # a dimension of unknown size cannot be split into pieces
  return decision


def _data_first(rule, view, context, ins, decision) -> _rules.Decision:
  """``decision``, or the rule's decision with a weight gathered where ``decision`` gathers the batch.

  Rules settle two operands split over one mesh axis on different dimensions
  by operand order (a contraction's first operand wins, a lookup's table
  wins). When the loser is a value computed from the step's data, split over
  a data axis (the batch), and the winner is computed from variables alone (a
  kernel split over "batch" as fully sharded data parallelism stores it), the
  batch would be gathered and every op after it would run on the whole batch.
  Then the rule decides again with that axis taken off the weight: it is
  gathered for this use (its bytes, not the activations') and the batch stays
  split. Kept only if the data keeps its split.

  A batch of unknown size is not split: there a value computed from it of
  unknown size would take a batch axis from a weight on another dimension
  (an embedding's width split over "batch"), and every shape query and
  reshape of it would fall back. The weight is gathered for its use there
  too.
  """
  lost = set()
  for t, have, need in zip(view.op.inputs, ins, decision.inputs):
    if t.name in context.data and _is_layout(have) and _is_layout(need):
      lost |= _moved(have, need) & context.data_axes
  if any(t.name in context.data for t in view.op.inputs):
    own = {a for t, have in zip(view.op.inputs, ins) if t.name in context.data and _is_layout(have)
           for a in _rules.axes_in(have)}
    for t, layout in zip(view.op.outputs, decision.outputs):
      if _is_layout(layout) and t.shape.rank is not None and None in t.shape.as_list():
        lost |= (_rules.axes_in(layout) & context.data_axes) - own
  if not lost:
    return decision
  stripped = _without(view, context, ins, lost)
  if stripped == list(ins):
    return decision
  again = _apply(rule, view, stripped)
  if again.fallback:
    return decision
  for t, have, need in zip(view.op.inputs, ins, again.inputs):
    if t.name in context.data and _is_layout(have) and _is_layout(need) and _moved(have, need) & lost:
      return decision  # the data is gathered all the same
  return again


def _weights_stay(rule, view, context, ins, decision) -> _rules.Decision:
  """``decision``, or one that moves the data to a weight split over the data's axis instead of gathering it.

  Expert parallelism (GShard's dispatch): experts' stacked kernels ``[experts,
  ...]`` split over the axis the tokens are split over (the batch axis, on
  their groups). Rules settle the conflict by operand order, and the tokens
  usually come first: every device gathers every expert. Where the data can
  take the weight's split on another of its dimensions by moving its pieces
  (one ``all_to_all``: tokens sent to the devices holding their experts) and
  that moves fewer bytes than gathering the weight (the data and the result,
  a k-th of each, against the weight), the rule decides again with the data's
  axes taken off.
  """
  if not context.data:
    return decision
  lost = set()  # axes a weight loses (gathered) where the data keeps them
  weights = []
  for t, have, need in zip(view.op.inputs, ins, decision.inputs):
    if t.name not in context.data and t.dtype != tf.resource and _is_layout(have) and _is_layout(need):
      gathered = _moved(have, need)
      if gathered:
        lost |= gathered
        weights.append(t)
  if not lost:
    return decision
  data_axes = {a for t, have in zip(view.op.inputs, ins) if t.name in context.data and _is_layout(have)
               for a in _rules.axes_in(have)}
  lost &= data_axes
  if not lost:
    return decision
  stripped = [tuple(tuple(a for a in split if a not in lost) for split in have)
              if t.name in context.data and _is_layout(have) else have for t, have in zip(view.op.inputs, ins)]
  again = _apply(rule, view, stripped)
  if again.fallback or again.lower is not None:
    return decision
  moved_bytes = 0
  for t, have, need in zip(view.op.inputs, ins, again.inputs):
    if not _is_layout(have) or not _is_layout(need) or t.dtype == tf.resource:
      continue
    if t.name not in context.data and _moved(have, need) & lost:
      return decision  # the weight is gathered all the same
    if t.name in context.data and have != need:
      steps = _relayout.steps(have, need, t.shape.as_list() if t.shape.rank is not None else None,
                              context.mesh.axis_size)
      if steps.gathered or not steps.moved:
        return decision  # the data would be gathered, not moved: gathering the weight is no worse
      moved_bytes += _bytes(t) // context.mesh.axis_size(tuple(sorted(lost)))
  moved_bytes += sum(_bytes(t) for t in view.op.outputs) // context.mesh.axis_size(tuple(sorted(lost)))  # and back
  return again if moved_bytes < sum(_bytes(t) for t in weights) else decision


def _bytes(t) -> int:
  """``t``'s global size in bytes (0 if unknown)."""
  if not t.shape.is_fully_defined() or t.dtype == tf.resource:
    return 0
  return t.shape.num_elements() * t.dtype.size


def _without(view, context, ins, axes) -> list:
  """``ins`` with ``axes`` taken off the layouts of the inputs not computed from the data (weights; not handles)."""
  return [tuple(tuple(a for a in split if a not in axes) for split in have)
          if t.name not in context.data and t.dtype != tf.resource and _is_layout(have) else have
          for t, have in zip(view.op.inputs, ins)]


def _moved(have, need) -> set:
  """The mesh axes a dimension of layout ``have`` is split over and the same dimension of ``need`` is not."""
  return {a for h, n in zip(have, need) for a in h if a not in n}


def _is_layout(layout) -> bool:
  return layout is not None and not isinstance(layout, _rules.Contents)


def _data_axes(given: dict, data: frozenset, batch_axes: tuple = ()) -> frozenset:
  """The batch axes: ``batch_axes``, else the axes the step's data inputs ``data`` are split over."""
  return frozenset(batch_axes) or frozenset(
      a for name in data if _is_layout(given.get(name)) for a in _rules.axes_in(given[name]))


def _derived(ops, data: frozenset) -> frozenset:
  """The tensors computed from the step's data inputs ``data``."""
  derived = set(data)
  for op in ops:
    if any(t.name in derived for t in op.inputs):
      derived.update(t.name for t in op.outputs)
  return frozenset(derived)


def _splits_unknown(tensors, layouts) -> bool:
  """Whether a layout splits a dimension whose size is unknown (a batch of any size, taken whole)."""
  for t, layout in zip(tensors, layouts):
    if layout is None or isinstance(layout, _rules.Contents) or t.shape.rank is None or t.dtype == tf.resource:
      continue
    if any(axes and n is None for n, axes in zip(t.shape.as_list(), layout)):
      return True
  return False


def _inputs_of(op, layouts, context, record=None):
  found = [layouts.get(name, _UNSET) for name in (record or context.record(op)).inputs]
  if _UNSET in found:  # (rare: an input no op before gave a layout)
    found = [_rules.replicated(_rules.rank_of(t)) if f is _UNSET else f for f, t in zip(found, op.inputs)]
  return found


_UNSET = object()


def _forward(ops, context, given, wants) -> Partition:
  layouts = dict(given)
  decisions = {}
  fallbacks = []
  for op in ops:
    record = context.record(op)
    if record.source is not _NOT_SOURCE:  # (its layout: replicated, unless given)
      if record.outputs[0] not in layouts:
        layouts[record.outputs[0]] = record.source
      continue
    decision = _decide(op, context, _inputs_of(op, layouts, context, record), wants, record)
    for k, value in decision.values.items():
      context.know(op.outputs[k], value)
    if decision.fallback:
      fallbacks.append(record.name)
    decisions[record.name] = decision
    for name, layout in zip(record.outputs, decision.outputs):
      layouts[name] = layout
  return Partition(layouts, decisions, fallbacks)


def _backward(ops, context, partition, wants) -> dict:
  """The layouts tensors want: the one all their consumers require, where it differs from theirs.

  Where consumers require different layouts, the finest of them is wanted if
  every other consumer takes it as it is (:func:`_finest_taken`).
  """
  wants = dict(wants)
  required: dict = {}  # tensor name -> (layout, consumer, its decision) for each consumer
  for op in reversed(ops):
    record = context.record(op)
    if record.source is not _NOT_SOURCE or record.name not in partition.decisions:
      continue
    for k, name in enumerate(record.outputs):
      needs = required.get(name)
      if not needs:
        continue
      want = needs[0][0]
      if any(n != want for n, _, _ in needs):
        want = _finest_taken(op.outputs[k], needs, context, partition, wants)
      if want is not None and want != partition.layouts.get(name):
        wants[name] = want
    # Re-decide with the wants, so that they reach this op's inputs in the same pass.
    decision = _decide(op, context, _inputs_of(op, partition.layouts, context, record), wants, record)
    for name, need in zip(record.data_inputs, decision.inputs):
      if need is not None and name is not None:
        required.setdefault(name, []).append((need, op, decision))
  return wants


def _finest_taken(t, needs, context, partition, wants):
  """Of the layouts ``t``'s consumers require, one that refines the others and that they all take, or None.

  A value used by two ops, one taking it split (an attention's output
  projection, split over the heads) and one whole (the gradient of that
  projection's kernel, which can as well take it split), would otherwise be
  computed whole, and every op before it too. Each consumer is decided again
  with ``t`` in the finer layout: it must take it as it is, and gather no
  other input and sum over no axis that it did not before.
  """
  layouts = [n for n, _, _ in needs]
  if not all(_is_layout(n) for n in layouts):
    return None
  finest = next((n for n in layouts if all(_refines(n, m) for m in layouts)), None)
  if finest is None:
    return None
  for need, consumer, before in needs:
    if need == finest:
      continue
    ins = [finest if x.name == t.name else have for x, have in zip(consumer.inputs, _inputs_of(consumer, partition.layouts, context))]
    after = _decide(consumer, context, ins, wants)
    if after.fallback or after.lower is not None or after.communicates:
      return None
    for x, have, was, now in zip(consumer.inputs, ins, before.inputs, after.inputs):
      if x.name == t.name:
        if now != finest:
          return None
      elif _is_layout(have) and _is_layout(was) and _is_layout(now) and not _moved(have, now) <= _moved(have, was):
        return None
    summed_before = {a for r in before.reduce if r for a in r[1]}
    if any(r and not set(r[1]) <= summed_before for r in after.reduce):
      return None
  return finest


def _refines(finer, coarser) -> bool:
  """Whether layout ``finer`` splits every dimension as ``coarser`` does, or more (a whole dimension split)."""
  return len(finer) == len(coarser) and all(c == f or not c for f, c in zip(finer, coarser))


# Ops that pass their inputs through unchanged at run time: not copied, their outputs are their inputs
# (MobileNetV2's step has 1,500 per device; the runtime would remove them, at a cost in the first call).
_ALIASES = ("Identity", "IdentityN", "StopGradient", "Snapshot")

_ABSENT = object()  # a local value a device does not compute (another device of its group owns the op)


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
    self.only = only  # expand for this device alone (a branch of an If, made per device)
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
    dims, zero = self._ref(self._const(r, shape.as_list(), tf.int32)), self._ref(self._const(r, 0, dtype))
    self._count += 1
    node = self._node(r, f"zeros_{self._count}", "Fill")
    node.input.extend([dims, zero])
    node.attr["T"].type = tf.as_dtype(dtype).as_datatype_enum
    node.attr["index_type"].type = tf.int32.as_datatype_enum
    return _Pending(node.name, 0, tf.as_dtype(dtype), shape)

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
    begin, size, shape = [], [], x.shape.as_list()
    sliced = False
    for d, (h, w) in enumerate(zip(have, want)):
      if w and h != w:
        n = self.mesh.axis_size(w)
        chunk = global_shape[d] // n
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
    for op in ordered(self.graph):
      if op.type == "Placeholder":
        name = op.outputs[0].name
        if name not in local_inputs and not op.outputs[0].consumers():
          continue  # a function body's own argument, replaced on import (_functions.body)
        if name not in local_inputs:
          raise _errors.RewriteError(f"The global graph's input {name} has no value to expand with.")
        self.local[name] = [self._fed(x) if isinstance(x, Feed) else x for x in local_inputs[name]]
        continue
      if op.type in ("Const", "NoOp") or op.name not in self.partition.decisions:
        continue  # constants are made per device on first use; dead ops are left out
      decision = self.partition.decisions[op.name]
      if decision.values:  # the same constant on every device (a shape query's global answer)
        for k, t in enumerate(op.outputs):
          self.local[t.name] = [self._const(r, decision.values[k], t.dtype) if self._here(r) else None
                                for r in range(len(self.devices))]
        continue
      owned = op.name in self.ownership.ops
      inputs_per_device = []
      for r in range(len(self.devices)):
        if not self._here(r) or not self.ownership.runs_on(op.name, self.mesh, r):
          inputs_per_device.append(None)  # another device of the group runs it
          continue
        inputs = []
        for i, t in enumerate(op.inputs):
          if i in decision.consts:
            inputs.append(self._const(r, decision.consts[i], t.dtype))
            continue
          source = self.ownership.ops.get(t.op.name)
          if source is not None and not owned:
            x = self._received(r, t, source, op)
          else:
            x = self._local(r, t)
          want = decision.inputs[i] if i < len(decision.inputs) else None
          if want is not None and t.dtype != tf.resource and want != layouts[t.name]:
            key = (t.name, r, want)  # one relayout per tensor, device and layout, whatever its consumers
            if key not in self._relayouts:
              self._relayouts[key] = self.relayout(r, x, layouts[t.name], want, t.shape.as_list(), op)
            x = self._relayouts[key]
          inputs.append(x)
        inputs_per_device.append(inputs)
      if decision.once:  # its inputs were relayouted everywhere (collectives need the group); it runs on one
        inputs_per_device = [inputs if r == 0 else None for r, inputs in enumerate(inputs_per_device)]
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
          for y, t, layout in zip(outputs, op.outputs, decision.outputs):
            if isinstance(y, tf.Tensor):
              y.set_shape(self._local_shape(t, layout))  # the rule's ops may not infer it from stand-ins
          outputs_per_device.append(outputs)
          self._mark()
      else:
        outputs_per_device = self._copies(op, decision, inputs_per_device)
      for r, outputs in enumerate(outputs_per_device):
        if outputs is None:
          for t in op.outputs:
            self.local.setdefault(t.name, [None] * len(self.devices))[r] = _ABSENT
          continue
        for k, t in enumerate(op.outputs):
          y = outputs[k]
          if decision.reduce[k] is not None:
            combine, axes = decision.reduce[k]
            for d, over in decision.scatter.get(k, ()):  # summed into each device's piece of dimension d
              shape = y.shape.as_list()
              shape[d] //= self.mesh.axis_size(over)
              y = self._emit(r, y, "reduce_scatter", {"op": combine, "scatter_dimension": d}, over,
                             tf.TensorShape(shape), op)
              axes = tuple(a for a in axes if a not in over)
            if axes and y.dtype == tf.bool:  # All, Any: the min or max of 0/1 (collectives take numbers)
              y = self._emit(r, self._cast(r, y, tf.int32), "all_reduce", {"op": combine}, axes, y.shape, op)
              y = self._cast(r, y, tf.bool)
            elif axes:
              y = self._emit(r, y, "all_reduce", {"op": combine}, axes, y.shape, op)
          self.local.setdefault(t.name, [None] * len(self.devices))[r] = y

  def _here(self, r) -> bool:
    return self.only is None or r == self.only

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
    for r in range(len(self.devices)):
      if not self._here(r):
        continue
      x = self._local(r, t)
      if replicated and t.dtype != tf.resource:
        x = self.relayout(r, x, self.partition.layouts[t.name], _rules.replicated(t.shape.rank),
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
    return Expansion(graph_def, outputs, self.records)


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


_PREFIX = "expand"  # the copies' names: expand/replica_<r>/<op name in the global graph>


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
    records: per device, its collective placeholders' records in call order (for :func:`rewrite.plan`).
  """

  graph_def: tf.compat.v1.GraphDef
  outputs: list
  records: list


def expand(graph: tf.Graph, mesh, partition: Partition, local_inputs: dict, outputs,
           locate: Callable[[tf.Operation], str] = lambda op: f"{op.type} {op.name}", ownership=None) -> Expansion:
  """Every device's copy of ``graph``, with the ops the current graph holds.

  Call it with a plain ``tf.Graph`` as the default graph, holding the
  ``local_inputs``: the result is that graph's ops and the copies, as one
  ``GraphDef``.

  Args:
    graph: the traced global graph.
    mesh: the device mesh.
    partition: from :func:`propagate`.
    local_inputs: name of each placeholder of ``graph`` -> one local tensor per
      device (its piece of an argument; the device's component handle of a
      variable): tensors of the current graph, or :class:`Feed` values.
    outputs: tensors of ``graph`` whose whole values every device returns.
    locate: names where an op came from, for the placeholders' records.
    ownership: ops run by one device per group (``_partition_owners.assign``);
      None: every op on every device.

  Returns:
    The :class:`Expansion`.
  """
  expander = _Expander(graph, mesh, partition, locate, ownership)
  expander.run(local_inputs)
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


def expand_on_device(graph: tf.Graph, mesh, partition: Partition, r: int, *inputs, outputs=None,
                     locate: Callable[[tf.Operation], str] = lambda op: f"{op.type} {op.name}") -> list:
  """Device ``r``'s copy of ``graph`` (a function's body), made in the current graph on ``inputs``.

  For a body that needs no communication (an ``If``'s branch whose layouts
  need no collective): ``inputs`` are device ``r``'s pieces of the body's
  arguments; returns its pieces of the body's outputs, in their layouts (or,
  given ``outputs``, sliced to those layouts: no gather is made). Call
  it while tracing a ``tf.function`` (its automatic control dependencies order
  the body's reads and writes and keep its effects).
  """
  scratch = tf.Graph()
  with scratch.as_default():
    standins = [tf.raw_ops.Placeholder(dtype=x.dtype, shape=x.shape) for x in inputs]
    local_inputs = {t.name: [x if k == r else None for k in range(len(mesh.devices))]
                    for t, x in zip(graph.inputs, standins)}
    expander = _Expander(graph, mesh, partition, locate, only=r)
    expander.run(local_inputs)
    pieces = [expander.output(t, replicated=False)[0] for t in graph.outputs]
    if outputs is not None:
      pieces = [x if want is None or isinstance(want, _rules.Contents) or t.dtype == tf.resource
                else expander.relayout(r, x, partition.layouts[t.name], want, t.shape.as_list(), t.op)
                for x, t, want in zip(pieces, graph.outputs, outputs)]
    expansion = expander.finish([[x] for x in pieces])
  if any(expansion.records):
    raise _errors.RewriteError("A function body expanded per device needs communication (a bug: its rule "
                               "should have refused it).")
  input_map = {x.name: y for x, y in zip(standins, inputs)}
  names = [per_device[0] for per_device in expansion.outputs]
  imported = tf.graph_util.import_graph_def(expansion.graph_def, input_map=input_map, return_elements=names or None,
                                            name="body")
  return list(imported or [])


_BODIES = _rules.Bodies(propagate=propagate, expand_on_device=expand_on_device)  # what the rules for If use
