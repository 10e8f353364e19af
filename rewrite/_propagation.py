"""The global view's layout propagation: a layout for every tensor of one traced global graph.

:func:`propagate` gives every tensor of a traced global graph (static global
shapes) a layout, op by op, from the layouts of its inputs (the step's
arguments and the variables' handles) and the op's rule (the ``rewrite.rules``
modules). An op without a rule runs replicated on gathered inputs (a
*fallback*, recorded). The context the rules see and the decisions remembered
are ``_propagation_context``'s; the per-device graphs are ``_expansion``'s.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from rewrite import _errors
from rewrite import _op_kinds
from rewrite import _propagation_context
from rewrite import _relayout
from rewrite._propagation_context import NOT_SOURCE  # (compared once an op a pass)
from rewrite.rules import _base
from rewrite.rules import _contraction  # noqa: F401  (registers rules)
from rewrite.rules import _control_flow  # noqa: F401
from rewrite.rules import _convolution  # noqa: F401
from rewrite.rules import _effects  # noqa: F401
from rewrite.rules import _elementwise  # noqa: F401
from rewrite.rules import _gather  # noqa: F401
from rewrite.rules import _loops  # noqa: F401
from rewrite.rules import _random  # noqa: F401
from rewrite.rules import _reduction  # noqa: F401
from rewrite.rules import _resource  # noqa: F401
from rewrite.rules import _roll  # noqa: F401
from rewrite.rules import _scatter  # noqa: F401
from rewrite.rules import _segment  # noqa: F401
from rewrite.rules import _shape  # noqa: F401
from rewrite.rules import _tensor_lists  # noqa: F401


@dataclasses.dataclass
class Partition:
  """Layouts chosen for one global graph.

  Attributes:
    layouts: tensor name -> layout (per dimension, the mesh axes it is split over).
    decisions: op name -> the rule's :class:`_base.Decision`.
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
              batch_axes: tuple = (), *, bodies: _base.Bodies, pinned: dict | None = None) -> Partition:
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
    bodies: how rules partition and expand the body of a function an op calls
      (an ``If``'s branches): the partitioner's own functions
      (``_partition.BODIES``; call :func:`_partition.propagate`, which hands them).
    pinned: op name -> layout, for identity ops whose output must be in that
      layout (a layout constraint the step states: ``repl.with_layout``, a
      Keras ``LayoutMap`` key for a layer's output). Their input is relayouted
      to it, whatever the rules would choose, and the ops before them are
      asked for it (a wish, as any consumer's).

  Returns:
    The :class:`Partition`.
  """
  return Propagator(graph, mesh, handle_shapes, summed, data, batch_axes, bodies=bodies, pinned=pinned)(given)


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

  ``bodies`` and ``pinned`` as for :func:`propagate` (:func:`_partition.propagator` hands the partitioner's own
  bodies).
  """

  def __init__(self, graph: tf.Graph, mesh, handle_shapes: dict | None = None, summed: frozenset = frozenset(),
               data: frozenset = frozenset(), batch_axes: tuple = (), alike: bool = False, *, bodies: _base.Bodies,
               pinned: dict | None = None):
    dead = _dead(graph)
    self._ops = [op for op in ordered(graph) if op.name not in dead]
    self._mesh, self._handle_shapes, self._summed = mesh, handle_shapes or {}, frozenset(summed)
    self._data, self._batch_axes, self._alike = data, batch_axes, alike
    self._bodies = bodies
    self._pinned = dict(pinned or {})
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
      context = self._contexts[data] = _propagation_context.Context(self._mesh, self._handle_shapes, self._summed,
                                                                    self._bodies, self._pinned)
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
  stack += [op.name for op in ops if op.type in _propagation_context.SOURCES
            or (op.op_def.is_stateful and op.type != "ReadVariableOp" and op.type not in _op_kinds.STATEFUL_RANDOM)]
  live: set = set()
  while stack:
    name = stack.pop()
    if name not in live:
      live.add(name)
      stack.extend(t.op.name for t in by_name[name].inputs)
  return {op.name for op in ops if op.name not in live}


def _decide(op, context, ins, wants, record=None) -> _base.Decision:
  record = record or context.record(op)
  outs = tuple([wants.get(name) for name in record.outputs]) if wants else ()
  key = (record.kind, _key(ins), _key(outs)) if record.variant else (record.kind, tuple(ins), outs)
  decision = context.decided.get(key)
  if decision is None:
    decision = context.decided[key] = _decide_anew(op, context, ins, wants)
  return decision


def _key(layouts) -> tuple:
  """``layouts`` as a key: a variant's contents told apart from a layout (``Contents(()) == ()``)."""
  return tuple((x, True) if isinstance(x, _base.Contents) else x for x in layouts)


def _decide_anew(op, context, ins, wants) -> _base.Decision:
  pin = context.pinned.get(op.name)
  if pin is not None:  # a layout the step states: its input relayouted to it
    return _base.Decision(inputs=[pin], outputs=[pin], reasons={0: f"the layout the step states for it ({op.name})"})
  rule = _base.get(op.type)
  view = _base.OpView(op, context.mesh, [wants.get(t.name) for t in op.outputs], context.handle_shapes,
                      context.value, context.summed, bodies=context.bodies)
  if rule is None:
    return _base.fallback(view, ins)
  decision = _apply(rule, view, ins)
  if decision.fallback:  # the rule cannot split it so (a dimension of unknown size): without the weights' batch axes?
    again = _apply(rule, view, _without(view, context, ins, context.data_axes)) if context.data else decision
    return decision if again.fallback else again
  decision = _weights_stay(rule, view, context, ins, _data_first(rule, view, context, ins, decision))
  return _pending(view, _activations_gathered(rule, view, context, ins, decision))


def _pending(view, decision) -> _base.Decision:
  """``decision``, its partial sums left to the ``Sum`` that alone reads them (``_base.Pending``), where it can."""
  reduce = decision.reduce[0] if decision.reduce else None
  if (reduce is None or reduce[0] != "sum" or not reduce[1] or decision.lower is not None
          or any(decision.scatter.values()) or not _propagation_context.summed_after(view.op)
          or not _is_layout(decision.outputs[0])):
    return decision
  return dataclasses.replace(decision, outputs=[_base.Pending(decision.outputs[0], reduce[1])], reduce=[None])


def _apply(rule, view, ins) -> _base.Decision:
  if all(map(_plain, ins)) and all(map(_plain, view.wants)):
    return _apply_plain(rule, view, ins)  # (the common case, by the million: nothing merged or pending)
  pending = [x for x in ins if isinstance(x, _base.Pending)]
  if pending:  # a Sum of partial sums (_pending): it sums them with its own
    decision = _apply(rule, view, [tuple(x) if isinstance(x, _base.Pending) else x for x in ins])
    if view.op.type == "ConcatV2":
      return _joined_partials(view, ins, decision)
    if view.op.type != "Sum" or decision.fallback or decision.lower is not None:
      raise _errors.RewriteError(f"{view.op.type} {view.op.name} reads partial sums left for a Sum (a bug).")
    combine, axes = decision.reduce[0] or ("sum", ())
    extra = tuple(a for x in pending for a in x.summed if a not in axes)
    decision = dataclasses.replace(decision, reduce=[(combine, tuple(axes) + extra)] + list(decision.reduce[1:]))
    return decision
  merged = _base.merged_in(list(ins) + list(view.wants))
  if merged and view.op.type != "Reshape":  # (a reshape makes and unmakes merged dimensions: it sees them)
    if _base.position_blind(view.op.type):
      decision = _apply_blind(rule, view, ins, merged)
      if decision is not None:
        return decision
    # Seen whole: gathered first (all-gathered, the blocks put in order), also by a rule that takes an input as
    # it is (None: an If's arguments, its branches partitioned for whole values).
    seen = [_base.unmerged(x) for x in ins]
    decision = _apply_plain(rule, dataclasses.replace(view, wants=[_base.unmerged(w) for w in view.wants]), seen)
    inputs = list(decision.inputs) + [None] * (len(ins) - len(decision.inputs))
    for i, (have, whole) in enumerate(zip(ins, seen)):
      if inputs[i] is None and have is not whole and view.op.inputs[i].dtype not in (tf.resource, tf.variant):
        inputs[i] = whole
    decision.inputs = inputs
    return decision
  return _apply_plain(rule, view, ins)


def _joined_partials(view, ins, decision) -> _base.Decision:
  """A ``ConcatV2`` of partial sums (``_pending``): joined, then summed once, or reduce-scattered where wanted split.

  Blocks of partial sums over the same axes make the partial sums of their concatenation: one all-reduce of the
  whole (or, where the consumers want it split over those axes, one reduce-scatter), not one a block. Blocks
  summed over different axes (or some complete) are each all-reduced over their own, then joined.
  """
  values = ins[:-1]
  summed = {x.summed for x in values if isinstance(x, _base.Pending)}
  if decision.fallback or decision.lower is not None:
    raise _errors.RewriteError(f"ConcatV2 {view.op.name} of partial sums could not be partitioned (a bug).")
  if len(summed) == 1 and all(isinstance(x, _base.Pending) for x in values):
    axes = next(iter(summed))
    out, scatter = _base.scatter_partials(view, decision.outputs[0], axes)
    return dataclasses.replace(decision, outputs=[out], reduce=[("sum", axes)], scatter={0: scatter} if scatter else {})
  axis = int(view.const(len(ins) - 1)) % len(decision.outputs[0])

  def lower(r, inputs, comm):
    parts = [comm.all_reduce(x, "sum", have.summed) if isinstance(have, _base.Pending) else x
             for x, have in zip(inputs[:-1], values)]
    return [tf.concat(parts, axis)]

  return dataclasses.replace(decision, lower=lower, communicates=tuple(
      ("all_reduce", x.summed, "partial sum") for x in values if isinstance(x, _base.Pending)))


def _plain(layout) -> bool:
  """Whether ``layout`` is an ordinary one: no partial sums left pending, no merged dimension."""
  if layout is None or isinstance(layout, _base.Contents):
    return True
  return type(layout) is tuple and all(type(e) is tuple for e in layout)  # pylint: disable=unidiomatic-typecheck


def _apply_blind(rule, view, ins, merged) -> _base.Decision | None:
  """A position-blind rule's decision for inputs with :class:`_base.Merged` dimensions, or None if it cannot have one.

  The rule sees each merged dimension as split over its axes; in its
  decision, a dimension of the merged size split over those axes is the
  merged dimension (an input wanted so is relayouted into it: its rows put
  in the merged order). None where two merged dimensions share axes but not
  their parts, or the decision reduce-scatters onto one.
  """
  by_axes = {}
  for m in merged:
    if by_axes.setdefault(tuple(m), m) != m:
      return None
  plain = lambda layout: layout if layout is None or isinstance(layout, _base.Contents) else tuple(  # noqa: E731
      tuple(e) if isinstance(e, _base.Merged) else e for e in layout)
  seen = dataclasses.replace(view, wants=[plain(w) for w in view.wants],
                             merged_axes=frozenset(a for m in merged for a in m))
  decision = _apply_plain(rule, seen, [plain(x) for x in ins])
  if decision.fallback or any(scatter for scatter in decision.scatter.values()):
    return None

  def back(tensors, layouts):
    out = []
    for t, layout in zip(tensors, layouts):
      if layout is None or isinstance(layout, _base.Contents) or t.dtype == tf.resource or t.shape.rank is None:
        out.append(layout)
        continue
      shape = t.shape.as_list()
      out.append(tuple(by_axes[tuple(e)] if e and tuple(e) in by_axes and d < len(shape)
                       and shape[d] == by_axes[tuple(e)].size else e for d, e in enumerate(layout)))
    return out

  decision.inputs = back(view.op.inputs, decision.inputs) + list(decision.inputs[len(view.op.inputs):])
  decision.outputs = back(view.op.outputs, decision.outputs)
  return decision


def _apply_plain(rule, view, ins) -> _base.Decision:
  op = view.op
  try:
    decision = rule(view, ins)
  except _base.UnknownRank:  # a shape of unknown rank (from a batch of unknown size): the whole value
    return _base.fallback(view, ins)
  if _splits_unknown(op.inputs, decision.inputs) or _splits_unknown(op.outputs, decision.outputs):
    return _base.fallback(view, ins)  # a dimension of unknown size cannot be split into pieces
  return decision


def _data_first(rule, view, context, ins, decision) -> _base.Decision:
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
           for a in _base.axes_in(have)}
    for t, layout in zip(view.op.outputs, decision.outputs):
      if _is_layout(layout) and t.shape.rank is not None and None in t.shape.as_list():
        lost |= (_base.axes_in(layout) & context.data_axes) - own
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
  # Or the data gathered and its result scattered back where the result is wanted as ``again`` gives it.
  wished = decision if decision.scatter else _apply(rule, dataclasses.replace(view, wants=list(again.outputs)), ins)
  if not wished.fallback and _scattered_back(view, context, ins, wished, again, lost):
    return dataclasses.replace(wished, outputs=list(again.outputs))  # (the scattered result sliced as again's)
  return again


def _scattered_back(view, context, ins, decision, again, lost) -> bool:
  """Whether ``decision`` gathers the data only to scatter its result back over ``lost``, for fewer bytes than
  ``again`` gathers the weights.

  A lookup in a table whose rows are split over the batch axis (an embedding table split over the workers,
  larger than one): the ids are gathered (integers, a few bytes a row), each device looks up those in its own
  rows, and the rows looked up are reduce-scattered back onto the batch; the table stays split.
  """
  if not decision.scatter:
    return False
  for ours, theirs in zip(decision.outputs, again.outputs):  # the result as ``again`` gives it, by a local slice
    if not (_is_layout(ours) and _is_layout(theirs) and len(ours) == len(theirs)
            and all(o == t or (o and _relayout.refined(o, t)) for o, t in zip(ours, theirs))):
      return False
  k = context.mesh.axis_size(tuple(sorted(lost)))
  scattered = sum(_bytes(t) // _pieces(context.mesh, layout) * (k - 1)
                  for t, layout in zip(view.op.outputs, decision.outputs) if _is_layout(layout))
  return (_gathered_bytes(view, context, ins, decision.inputs, lost, data=True) + scattered
          < _gathered_bytes(view, context, ins, again.inputs, lost, data=False))


def _gathered_bytes(view, context, ins, needs, lost, data: bool) -> int:
  """The bytes a device sends gathering over ``lost`` the inputs (from ``ins`` to ``needs``) computed from the
  step's data (``data``) or not (weights)."""
  k = context.mesh.axis_size(tuple(sorted(lost)))
  return sum(_bytes(t) // _pieces(context.mesh, have) * (k - 1) for t, have, need in zip(view.op.inputs, ins, needs)
             if (t.name in context.data) == data and t.dtype != tf.resource and _is_layout(have) and _is_layout(need)
             and _moved(have, need) & lost)


def _weights_stay(rule, view, context, ins, decision) -> _base.Decision:
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
  lost, weights = _weights_gathered(view, context, ins, decision)
  if not lost:
    return decision
  again = _data_without(rule, view, context, ins, lost)
  if again is None:
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
  return again if moved_bytes < sum(_bytes(t) for t, _, _ in weights) else decision


def _activations_gathered(rule, view, context, ins, decision) -> _base.Decision:
  """``decision``, or one gathering the data instead of a weight where that sends fewer bytes.

  Megatron's sequence parallelism: between tensor-parallel blocks the
  tokens are split over the tensor-parallel axis, which also splits the
  blocks' kernels. Rules settle the conflict by operand order (the tokens
  first: each kernel gathered). Gathering the tokens' piece instead (their
  sequence over that axis) keeps the kernel split, and the block's output
  partial sums are reduce-scattered back onto the sequence. Taken where the
  data's bytes gathered are fewer than the weights', and never for the batch
  axes (gathering the batch would repeat the step's work on every device).
  """
  if not context.data:
    return decision
  lost, weights = _weights_gathered(view, context, ins, decision)
  lost -= set(context.data_axes)
  if not lost:
    return decision
  again = _data_without(rule, view, context, ins, lost)
  if again is None:
    return decision
  if any(t.name not in context.data and t.dtype != tf.resource and _is_layout(have) and _is_layout(need)
         and _moved(have, need) & lost for t, have, need in zip(view.op.inputs, ins, again.inputs)):
    return decision  # the weight is gathered all the same
  k = context.mesh.axis_size(tuple(sorted(lost)))
  weight_bytes = sum(_bytes(t) // _pieces(context.mesh, have) * (k - 1) for t, have, _ in weights)
  return again if _gathered_bytes(view, context, ins, again.inputs, lost, data=True) < weight_bytes else decision


def _weights_gathered(view, context, ins, decision) -> tuple[set, list]:
  """``(axes, weights)``: the axes ``decision`` gathers weights over (inputs not computed from the data) where the
  data is split over them, and those weights' ``(tensor, layout, layout needed)``."""
  lost, weights = set(), []
  for t, have, need in zip(view.op.inputs, ins, decision.inputs):
    if t.name not in context.data and t.dtype != tf.resource and _is_layout(have) and _is_layout(need):
      gathered = _moved(have, need)
      if gathered:
        lost |= gathered
        weights.append((t, have, need))
  data_axes = {a for t, have in zip(view.op.inputs, ins) if t.name in context.data and _is_layout(have)
               for a in _base.axes_in(have)}
  return lost & data_axes, weights


def _data_without(rule, view, context, ins, axes) -> _base.Decision | None:
  """The rule's decision with ``axes`` taken off the data's layouts, or None if it falls back or lowers itself."""
  stripped = [_stripped(have, axes) if t.name in context.data and _is_layout(have) else have
              for t, have in zip(view.op.inputs, ins)]
  again = _apply(rule, view, stripped)
  return None if again.fallback or again.lower is not None else again


def _pieces(mesh, layout) -> int:
  """Into how many pieces ``layout`` splits its tensor."""
  return max(1, mesh.axis_size(tuple(a for axes in layout for a in axes)) if _base.axes_in(layout) else 1)


def _bytes(t) -> int:
  """``t``'s global size in bytes (0 if unknown)."""
  if not t.shape.is_fully_defined() or t.dtype == tf.resource:
    return 0
  return t.shape.num_elements() * t.dtype.size


def _without(view, context, ins, axes) -> list:
  """``ins`` with ``axes`` taken off the layouts of the inputs not computed from the data (weights; not handles)."""
  return [_stripped(have, axes) if t.name not in context.data and t.dtype != tf.resource and _is_layout(have) else have
          for t, have in zip(view.op.inputs, ins)]


def _stripped(layout, axes) -> tuple:
  """``layout`` with ``axes`` taken off its splits (a merged dimension losing any: whole)."""
  return tuple(() if isinstance(split, _base.Merged) and set(split) & set(axes)
               else tuple(a for a in split if a not in axes) if not isinstance(split, _base.Merged) else split
               for split in layout)


def _moved(have, need) -> set:
  """The mesh axes a dimension of layout ``have`` is split over and the same dimension of ``need`` is not."""
  return {a for h, n in zip(have, need) for a in h if a not in n}


def _is_layout(layout) -> bool:
  return layout is not None and not isinstance(layout, _base.Contents)


def _data_axes(given: dict, data: frozenset, batch_axes: tuple = ()) -> frozenset:
  """The batch axes: ``batch_axes``, else the axes the step's data inputs ``data`` are split over."""
  return frozenset(batch_axes) or frozenset(
      a for name in data if _is_layout(given.get(name)) for a in _base.axes_in(given[name]))


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
    if layout is None or isinstance(layout, _base.Contents) or t.shape.rank is None or t.dtype == tf.resource:
      continue
    if any(axes and n is None for n, axes in zip(t.shape.as_list(), layout)):
      return True
  return False


def _inputs_of(op, layouts, context, record=None):
  found = [layouts.get(name, _UNSET) for name in (record or context.record(op)).inputs]
  if _UNSET in found:  # (rare: an input no op before gave a layout)
    found = [_base.replicated(_base.rank_of(t)) if f is _UNSET else f for f, t in zip(found, op.inputs)]
  return found


_UNSET = object()


def _forward(ops, context, given, wants) -> Partition:
  layouts = dict(given)
  decisions = {}
  fallbacks = []
  for op in ops:
    record = context.record(op)
    if record.source is not NOT_SOURCE:  # (its layout: replicated, unless given)
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
    if record.source is not NOT_SOURCE or record.name not in partition.decisions:
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
    if after.fallback or any(kind != "permute" for kind, *_ in after.communicates) or (
        after.lower is not None and not after.communicates):
      return None  # (a halo's permutes move its neighbours' rows, not the value: taken as it is)
    for x, have, was, now in zip(consumer.inputs, ins, before.inputs, after.inputs):
      if x.name == t.name:
        if now != finest:
          return None
      elif _is_layout(have) and _is_layout(was) and _is_layout(now) and not _moved(have, now) <= _moved(have, was):
        return None
    summed_before = {a for r in before.reduce if r for a in r[1]}
    for k, r in enumerate(after.reduce):  # a new partial sum: only of a small output (a bias's gradient), not t's size
      if r and not set(r[1]) <= summed_before and 4 * _bytes(consumer.outputs[k]) > _bytes(t):
        return None
  return finest


def _refines(finer, coarser) -> bool:
  """Whether layout ``finer`` splits every dimension as ``coarser`` does, or more (a whole dimension split, or a
  split one split further: ``("batch",)`` to ``("batch", "model")``, a local slice)."""
  return len(finer) == len(coarser) and all(c == f or not c or _relayout.refined(c, f) for f, c in zip(finer, coarser))
