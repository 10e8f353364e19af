"""Rules for control flow: an ``If`` whose branches run on each device's pieces, communicating inside if they must.

Keras emits conditionals inside a training step (an optimizer's
``gradient_accumulation_steps``: accumulate, or apply and reset; a loss's
check of its labels; a ``LossScaleOptimizer``: apply if the gradients are
finite). The predicate is a scalar, so every device has the same value (a
reduction that produced it was all-reduced) and takes the same branch. Each
branch's body is partitioned like the step (``_partition``), its arguments in
the layouts they have outside; a split argument from which a branch would
gather a value is gathered before the ``If`` instead, and the branches
partitioned again. If both branches give their outputs the same layouts,
each device runs a conditional over its own copies of the branches, made per
device. A branch that needs collectives (a sum over a split dimension)
has them inside each device's copy (:class:`InBody`: TensorFlow's collective
ops, which every device's copy asks for in the same order, as every device
takes the same branch; in whichever process makes the copy, with keys every
process computes alike). Otherwise the op falls back (gathered, replicated),
or, on a sharded variable's handle, is refused. ``While`` loops: ``_loops``,
which shares the branches' checks (:func:`first_gather`,
:func:`computed_from`, :func:`sliced_from`) and :class:`InBody`.
"""

from __future__ import annotations

import collections
import functools
import weakref

import numpy as np
import tensorflow as tf

from rewrite import _apply
from rewrite import _collective_ops
from rewrite import _communication
from rewrite import _functions
from rewrite import _lowering
from rewrite import _plan
from rewrite.rules import _base
from rewrite.rules import _random


def needs_gather(have, want) -> bool:
  """Whether a value in layout ``have`` needs a collective to be in layout ``want`` (a dimension's split changes)."""
  return want is not None and have is not None and any(h and h != w for h, w in zip(have, want))


def _communicates(partition) -> str:
  """The first op of a partitioned body that would need a collective ("" if none)."""
  for name, d in partition.decisions.items():
    if any(r is not None for r in d.reduce) or d.communicates or d.fallback or d.unsupported:
      return name
  return ""


def cannot_communicate(view, graph, partition) -> str:
  """Why the collectives of a partitioned body cannot be placed inside it ("" if they can, see :class:`InBody`).

  An op of the body that falls back (its gathers would go unseen), or is
  refused, is named; so is a summary written in it (the first device's copy
  writes it, and the other devices' copies cannot take its writer, a
  resource of the first device). A print runs in the first device's copy
  only, its inputs relayouted on every device. Devices in several processes
  are no reason: every process keys the collectives alike (:class:`_BodyKeys`).
  """
  for name, d in partition.decisions.items():
    o = graph.get_operation_by_name(name)
    if d.unsupported or d.fallback:
      return f"{o.type} {name} in it {'is refused' if d.unsupported else 'has no rule'}"
    if d.once and any(t.dtype == tf.resource for t in o.inputs):
      return f"{o.type} {name} in it writes to a resource of the first device only (a summary's writer)"
  return ""


def _processes(mesh) -> int:
  """How many processes (tasks) ``mesh``'s devices are in."""
  return len({_lowering.task_of(d) for d in mesh.devices})


class _BodyKeys:
  """Collective keys the devices' copies of one function body agree on, in every process, without talking.

  Every device's copy asks for the same collectives in the same order (the
  plan's ``index``), in whichever process makes it. An instance key is a
  hash (``_lowering.AgreedKeys``) of what every process knows alike: the
  body's place in the step (``_functions.path``: the names of the ops down to
  it), the collective's position in the body, its kind, parameters, dtype
  and shape. A group key is a hash of the group's devices' job-wide names on
  a mesh whose devices are in several processes, else counted in this
  process (as the step's own collectives' are). One body run again (each
  iteration, each call of the step, each build of it) uses the same keys: the
  instances are the same, and one device's run one after the other.
  """

  _AGREED = _lowering.AgreedKeys()  # (one per process: its check of two hashes colliding covers every body)
  _GROUPS = _lowering.ProcessKeys()

  def __init__(self, body: str, agreed: bool):
    self._body, self._agreed = body, agreed

  def group_key(self, devices) -> int:
    return (self._AGREED if self._agreed else self._GROUPS).group_key(devices)

  def instance_key(self, group_key: int, collective, part: str = "") -> int:
    shape = None if collective.shape.rank is None else collective.shape.as_list()
    return self._AGREED.named_key(group_key, f"{self._body}|{collective.index}|{collective.describe()}|"
                                             f"{collective.dtype.name}|{shape}|{part}")


class _InBodyOps(_collective_ops.CollectiveOps):
  """TensorFlow's collective ops, made inside a device's copy of a body: its ordering token is the body's own."""

  def external_value(self, key: str):
    return None  # (fed the token the body takes: InBody)


class InBody:
  """The collectives of one function body (a loop's condition or body, a branch), inside each device's copy.

  A body's placeholders cannot reach the step's plan (the rewrite replaces
  nodes of the step's graph, not of its functions): each device's copy
  (``OpView.bodies.expand_on_device(..., collectives=...)``) lowers its own
  here, as ``CollectiveReduceV2`` and friends whose keys every device's copy
  agrees on (:class:`_BodyKeys`), chained in the body's order and ordered by
  the resource ``token`` the copy takes: the op that calls the body takes an
  ordering token of its device (a ``While`` as a loop variable; without a
  resource among its loop variables, the collectives of a ``While``'s body
  time out on logical CPUs, TF 2.21). Every device runs the body as often as
  the others and in the same order, as the op's predicate or counter is
  whole on every device.

  On a mesh whose devices are in several processes, each process makes its
  own devices' copies (a multi-client job's): the keys are ones every process
  computes alike, and the ops wait for their group at most the timeout of
  the step's collective ops (``expand_on_device``'s ``lowerings``; a
  multi-worker Replicator's collective timeout and a margin), so that a
  process whose loop runs other iterations than its peers' fails with a
  named error instead of waiting forever.

  ``inside``: where ``repl.explain`` finds them (``Decision.inside``): the
  first device's, each ``(where, record, why)``.
  """

  def __init__(self, view, graph, partition, where: str, inside: list, again: str = ""):
    self.mesh, self.where, self.inside = view.mesh, where, inside
    self.keys = _BodyKeys(_functions.path(graph), agreed=_processes(view.mesh) > 1)
    self._expected = collections.defaultdict(list)
    for event in _communication.walk(graph, partition, [], view.mesh.shape):
      if isinstance(event, _communication.Needed):
        self._expected[event.op_name].append((event.kind, event.axes, event.why))
    self._again = again  # why of a collective the walk does not know (a loop variable relayouted at the body's end)
    self._first = None  # the device whose collectives are listed

  def lowering(self, lowerings=None):
    """Collective ops with this body's keys, and the timeout of the step's (``lowerings``: its lowerings by name)."""
    step = (lowerings or {}).get(_collective_ops.CollectiveOps.name)
    ops = _InBodyOps(step.timeout_seconds if isinstance(step, _collective_ops.CollectiveOps) else 0.0)
    ops.keys = self.keys
    return ops

  def __call__(self, token, graph_def, records, names, lowerings=None):
    """``graph_def`` (device ``records[0].replica``'s copy) with its placeholders lowered; see ``expand_on_device``."""
    r = records[0].replica
    lowering = self.lowering(lowerings)
    plan = _plan.plan([list(records) if k == r else None for k in range(self.mesh.size)], self.mesh,
                      lambda c: lowering.name)
    rewritten = _apply.apply(graph_def, plan, {lowering.name: lowering})
    self._list(r, records)
    return (rewritten.graph_def, [rewritten.output_name(n) for n in names],
            {name: token for name in rewritten.external_inputs})

  def _list(self, r, records) -> None:
    """Lists device ``r``'s collectives for ``repl.explain``: the first device's (of each expansion)."""
    if self._first is not None and r > self._first:
      return
    self._first = r
    self.inside[:] = [item for item in self.inside if item[0] != self.where]
    expected = {name: list(items) for name, items in self._expected.items()}
    for record in records:
      _, _, op_name = record.call.partition(" ")
      why = self._again
      for item in expected.get(op_name, ()):
        if item[:2] == (record.kind, record.axes):
          expected[op_name].remove(item)
          why = item[2]
          break
      self.inside.append((self.where, record, why))


class Nested:
  """Lists, in ``inside`` (``Decision.inside``), the collectives inside the loops and conditionals of an op's bodies.

  Their ops are lowered while the op's copies of its bodies are made (:meth:`lowered`, after each device's): the
  first device's are listed, each ``where`` naming the body and the op in it.
  """

  def __init__(self, inside: list, parts):
    self.inside, self.parts, self.first = inside, parts, None  # parts: (where, graph, partition) of each body

  def lowered(self, r: int) -> None:
    if self.first is not None and r > self.first:
      return
    self.first = r
    found = []
    for attr, graph, partition in self.parts:
      for name, d in partition.decisions.items():
        kind = "loop" if graph.get_operation_by_name(name).type in ("While", "StatelessWhile") else "conditional"
        found += [(f"{attr}: in the {kind} {name}, its {where}", record, why) for where, record, why in d.inside]
    self.inside[:] = [item for item in self.inside if ": in the " not in item[0]] + found


def ordering_token(device_index: int) -> tf.Tensor:
  """A fresh ordering token (a resource handle no kernel reads) for the device whose copy is being made."""
  return tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name=f"in_body_ordering_token_{_lowering.new_key()}",
                                name=f"ordering_token_{device_index}")


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> {(op, layouts, mesh): answer}


def _branches(view, layouts):
  """Both branches partitioned, or None and why not (cached: rules run on every propagation pass)."""
  by_op = _CACHE.setdefault(view.op.graph, {})
  key = (view.op.name, repr(layouts), id(view.mesh))
  if key not in by_op:
    by_op[key] = _partitioned_branches(view, layouts)
  return by_op[key]


def _partitioned_branches(view, layouts):
  """Both branches partitioned, or None and why not; a split argument a branch would gather is gathered first.

  A branch that gathers a value computed from split arguments (Keras's
  ``LossScaleOptimizer`` applies Adam in its branch: a replicated variable's
  gradient arrives split when its layer's input is) cannot communicate there,
  but the arguments can be gathered before the ``If``, where a step without
  the conditional would have gathered them too. So those arguments (tensors,
  not a sharded variable's handle) are asked for replicated, and the branches
  partitioned again. Returns ``((parts, output layouts, input layouts, whether they communicate inside), "")``;
  failing without collectives in the branches, they are partitioned again with them (:class:`InBody`).
  """
  op = view.op
  given = list(layouts)
  for talk in (False, True):  # without collectives in the branches, if that can be; else with them
    layouts = list(given)
    wanted = [None] * len(op.inputs)  # the If's inputs: as they are, or replicated (gathered before it)
    while True:
      branches, why, gather = _try_branches(view, layouts, talk)
      if branches is not None:
        parts, unified = branches
        return (parts, unified, wanted, talk), ""
      if not gather:
        break
      for k in gather:
        layouts[1 + k] = wanted[1 + k] = _base.replicated(_base.rank_of(op.inputs[1 + k]))
  return None, why


def _try_branches(view, layouts, talk=False):
  """``(branches or None, why not, the split tensor arguments whose gathering before the If would help)``.

  ``talk``: a branch may need collectives (placed inside it, :class:`InBody`).
  """
  op = view.op
  args = list(op.inputs[1:])
  parts = []
  for side, attr in enumerate(("then_branch", "else_branch")):
    body = _functions.body(op, attr, args)
    given = {x.name: _side(layout, side) for x, layout in zip(body.inputs, layouts[1:]) if layout is not None}
    handle_shapes = {x.name: view.handle_shapes[t.name] for x, t in zip(body.inputs, args)
                     if t.name in view.handle_shapes}
    summed = {x.name for x, t in zip(body.inputs, args) if t.name in view.summed}
    partition = view.bodies.propagate(body, view.mesh, given, handle_shapes, summed,
                                      random_salt=_random.body_salt(op, attr))
    gather = first_gather(body, partition)
    if gather is not None:
      o, t = gather
      split = _split_arguments(body, [t], layouts)
      if split or not talk:  # (gathered before the If, once; else inside the branch)
        return None, f"{o.type} {o.name} in its {attr} gathers a split input", split
    busy = _communicates(partition)
    if busy and not talk:  # a partial sum, say: gathering its inputs would send more than its collective
      o = body.get_operation_by_name(busy)
      return None, f"{o.type} {busy} in its {attr} needs communication", []
    refused = cannot_communicate(view, body, partition) if talk else ""
    if refused:
      return None, f"its {attr} would communicate inside, and {refused}", []
    parts.append((body, partition))
  outs = [[p.layouts.get(t.name) for t in body.outputs] for body, p in parts]
  unified = [_unify(a, b) for a, b in zip(*outs)]
  if any(u is _DIFFERENT for u in unified):
    return None, "its branches give their outputs different layouts", []
  return (parts, unified), "", []


def _split_arguments(body, tensors, layouts) -> list[int]:
  """The branch arguments that ``tensors`` are computed from, if every split one among them is a tensor.

  Empty if none is split, or if one is a sharded variable's handle or a
  variant (neither can be gathered): then gathering arguments cannot help.
  """
  found = set()
  for k in computed_from(body, tensors):
    layout = layouts[1 + k]
    if isinstance(layout, _base.Contents):
      if _base.holds_split(layout):
        return []
    elif layout is not None and any(layout):
      if body.inputs[k].dtype in (tf.resource, tf.variant):
        return []
      found.add(k)
  return sorted(found)


def computed_from(body, tensors) -> list[int]:
  """The positions of the arguments of function body ``body`` that ``tensors`` (its tensors) are computed from.

  A variable's handle is followed no further than the handle (a read is
  computed from it, not from what wrote the variable).
  """
  position = {x.name: k for k, x in enumerate(body.inputs)}
  found, seen, stack = set(), set(), [t for t in tensors if t.dtype != tf.resource]
  while stack:
    t = stack.pop()
    if t.name in seen:
      continue
    seen.add(t.name)
    k = position.get(t.name)
    if k is None:
      # IdentityN passes each input to its output alone (tf.distribute's all_reduce of a replica context that
      # has one replica: every gradient through one op).
      stack.extend([t.op.inputs[t.value_index]] if t.op.type == "IdentityN" else t.op.inputs)
      continue
    found.add(k)
  return sorted(found)


def first_gather(body, partition):
  """``(op, tensor)``: the first op of a partitioned body that would gather a split input ``tensor``; else None."""
  for o in body.get_operations():
    d = partition.decisions.get(o.name)
    if d is None:
      continue
    for i, t in enumerate(o.inputs):
      want = d.inputs[i] if i < len(d.inputs) else None
      if t.dtype != tf.resource and needs_gather(partition.layouts.get(t.name), want):
        return o, t
  return None


_DIFFERENT = object()


class Either(_base.Contents):
  """A variant output of an ``If`` that holds different things per branch: ``(then's, else's)`` contents.

  A ``tf.cond`` under a gradient tape returns both branches' intermediates
  in shared optional slots (the same position holds a then-intermediate or
  an else-intermediate); its gradient's ``If`` reads each with the same
  predicate, so each of its branches sees its own side.
  """


def _side(layout, side: int):
  return layout[side] if isinstance(layout, Either) else layout


def sliced_from(target, source) -> bool:
  """Whether a value in layout ``source`` becomes one in ``target`` by a local slice (no communication)."""
  return (target is not None and source is not None and len(target) == len(source)
          and all(not s or s == t for s, t in zip(source, target)))


def _unify(a, b):
  """One layout for an output both branches give (variants: what each branch's holds).

  Tensors: the same layout, or the more split one where the other branch's
  value is sliced to it (a branch returning zeros, say), locally.
  """
  if isinstance(a, _base.Contents) and isinstance(b, _base.Contents):
    return a if a == b or not b else b if not a else Either((a, b))
  if a == b or sliced_from(a, b):
    return a
  return b if sliced_from(b, a) else _DIFFERENT


@_base.register("OptionalFromValue")
def optional_from_value(view, layouts):
  return _base.Decision(inputs=[None] * len(layouts), outputs=[_base.Contents(layouts)])


@_base.register("OptionalNone")
def optional_none(view, layouts):
  return _base.Decision(inputs=[], outputs=[_base.Contents(())])


@_base.register("OptionalGetValue")
def optional_get_value(view, layouts):
  contents = layouts[0]
  if not isinstance(contents, _base.Contents) or len(contents) != len(view.op.outputs):
    return _base.fallback(view, layouts)  # what it holds is not known: replicated
  shapes = [view.local_shape(t.shape.as_list(), layout, np.int64).tolist() if layout else t.shape
            for t, layout in zip(view.op.outputs, contents)]
  types = [t.dtype for t in view.op.outputs]

  def lower(r, inputs):  # the attribute that states its outputs' shapes gets the local ones
    return tf.raw_ops.OptionalGetValue(optional=inputs[0], output_types=types, output_shapes=shapes)

  return _base.Decision(inputs=[None], outputs=list(contents), lower=lower)


@_base.register("OptionalHasValue")
def optional_has_value(view, layouts):
  return _base.Decision(inputs=[None], outputs=[()])


@_base.register("If", "StatelessIf")
def if_(view, layouts):
  branches, why = _branches(view, layouts)
  if branches is None:
    decision = _base.fallback(view, layouts)
    if decision.unsupported:
      decision.unsupported = f"{decision.unsupported} ({why})"
    elif decision.fallback:
      decision.why = why
    return decision
  parts, out_layouts, in_layouts, talk = branches
  inside: list = []  # the collectives inside the branches (repl.explain's)
  talks = [InBody(view, body, part, attr, inside) if talk else None
           for (body, part), attr in zip(parts, ("then_branch", "else_branch"))]
  nested = Nested(inside, [(attr, body, part) for (body, part), attr in zip(parts, ("then_branch", "else_branch"))])
  kept = []

  def lower(r, inputs):
    pred, args = inputs[0], list(inputs[1:])
    if any(talks):  # the branches take the device's ordering token
      args.append(ordering_token(r))
    specs = [tf.TensorSpec(x.shape, x.dtype) for x in args]
    branches = [tf.function(functools.partial(_on_device, view, body, part, r, out_layouts, talk),
                            autograph=False).get_concrete_function(*specs)
                for (body, part), talk in zip(parts, talks)]
    nested.lowered(r)
    for branch in branches:
      branch.add_to_graph()  # into the expansion's graph, whose library goes with it
    # Alive as long as the decision (the built step keeps its partition): a collected function is removed
    # from TensorFlow's runtime by name, and the step's imported copy of it with it.
    kept.extend(branches)
    make = tf.raw_ops.If if view.op.type == "If" or any(talks) else tf.raw_ops.StatelessIf
    outputs = make(cond=pred, input=args, Tout=[t.dtype for t in view.op.outputs], then_branch=branches[0],
                   else_branch=branches[1])
    return list(outputs) if isinstance(outputs, (list, tuple)) else []

  return _base.Decision(inputs=in_layouts, outputs=out_layouts, lower=lower, inside=inside)


def _on_device(view, body, partition, r, outputs, talk, *args):
  """Device ``r``'s copy of a branch, made in the function being traced, with the functions it calls.

  With ``talk`` (its :class:`InBody`), the last argument is the device's ordering token (the branch's collectives
  take it); else, if the other branch's do, it is left unused.
  """
  _functions.import_called(view.op)
  n = len(body.inputs)
  extra = {} if talk is None else {"collectives": functools.partial(talk, args[n])}
  return view.bodies.expand_on_device(body, view.mesh, partition, r, *args[:n], outputs=outputs, **extra)
