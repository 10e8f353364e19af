"""The global view's sharded update: work repeated on every device of a batch group, done once.

After propagation, an optimizer's update of a variable that is replicated over
the batch axes is the same computation on every device of each batch group:
the gradient arrives whole (all-reduced), and the slots are whole. Expanded as
traced, every device repeats it, so the graph and the work grow with the
number of devices. This pass gives each such update one *owner* per group
along the batch axes: the update's ops, its slots' reads and writes included,
run on the owner alone, and the value written to the variable is broadcast
from the owner to its group, where every device writes it. The slots are
current on their owner only (the caller marks them, so reads from outside a
step take the owner's), as with the local view's
``wrap_optimizer(update="sharded")``. Results are unchanged: the owner runs
exactly the ops every device would have run.

Which ops. An op may run on one device of a group if it computes, without
communication, a value that is the same on every device of the group (no
output split over the batch axes, no all-reduce, no gathered input), it has
no effects other than reading or writing a variable, and every consumer of
its outputs also runs there, or writes a variable on every device (the
broadcast). A variable is *owned* if every op that uses it runs on the owner.
Those conditions are settled by removing offenders until none is left. Each
broadcast write (a *sink*) then claims the ops it needs; an op two sinks
claim runs everywhere (the optimizer's step counter, say), and so does a
sink's work that owns no variable (plain SGD: a broadcast would cost more
than the multiplication it saves). Owners are spread over the group's
positions by the bytes of the variables they own.

This module knows nothing about Keras: it sees the traced graph, the
partition and the variables' handles.
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow as tf

ASSIGNS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
_STATEFUL_ALLOWED = ("ReadVariableOp",) + ASSIGNS


@dataclasses.dataclass(frozen=True)
class Owner:
  """The device of each group along ``axes`` at ``position`` (``Mesh.axis_index``)."""

  axes: tuple
  position: int


@dataclasses.dataclass
class Ownership:
  """Which ops of the global graph run on one owner per group, and what is broadcast.

  Attributes:
    ops: op name -> its :class:`Owner` (ops not listed run on every device).
    variables: resource handle tensor name -> the :class:`Owner` of a variable
      only its owner reads and writes (an optimizer's slots).
    broadcasts: ``(op name, input index)`` -> the :class:`Owner` whose value an
      op run on every device receives (a variable's write).
    pipelined: the owners are a pipeline's stages (``_partition_stages``): an
      op of one owner reads another's value from that owner's device (the
      device of its group at the other's position), and every device makes
      the collective calls of the ops it does not run (on zeros, left unused),
      so that the devices' calls match.
  """

  ops: dict = dataclasses.field(default_factory=dict)
  variables: dict = dataclasses.field(default_factory=dict)
  broadcasts: dict = dataclasses.field(default_factory=dict)
  pipelined: bool = False

  def runs_on(self, op_name: str, mesh, r: int) -> bool:
    """Whether device ``r`` runs op ``op_name``."""
    owner = self.ops.get(op_name)
    return owner is None or mesh.axis_index(r, owner.axes) == owner.position


@dataclasses.dataclass
class _Node:
  """What the pass needs of one op, read once (a TensorFlow op's properties are slow to read)."""

  name: str
  type: str
  inputs: list  # tensor names
  producers: list  # op names, per input
  resource: list  # per input: a resource handle?
  outputs: list  # tensor names


def assign(graph: tf.Graph, partition, mesh, axes: tuple, handle_bytes: dict, fixed: dict | None = None,
           load: list | None = None, may_own: set | None = None) -> Ownership:
  """Owners for the work ``graph`` repeats on every device of each group along ``axes``.

  Args:
    graph: the traced global graph.
    partition: its ``Partition``.
    mesh: the device mesh.
    axes: the batch axes (of size > 1); empty: nothing to share.
    handle_bytes: resource handle tensor name -> its variable's bytes (whole).
    fixed: handle tensor name -> the owner position its variable already has
      (an earlier step's); an update that owns it keeps that position.
    load: bytes owned so far per position along ``axes``; updated.
    may_own: if given, the only handles whose variables may be owned (left
      current on their owner only); another variable's update is broadcast.

  Returns:
    The :class:`Ownership`.
  """
  axes = tuple(axes)
  if not axes or mesh.axis_size(axes) == 1:
    return Ownership()
  fixed = dict(fixed or {})
  positions = mesh.axis_size(axes)
  load = load if load is not None else [0] * positions
  fetched = {t.name for t in graph.outputs}
  nodes, candidates = [], set()
  for op in graph.get_operations():
    inputs = list(op.inputs)
    node = _Node(op.name, op.type, [t.name for t in inputs], [t.op.name for t in inputs],
                 [t.dtype == tf.resource for t in inputs], [t.name for t in op.outputs])
    if node.name in partition.decisions:
      nodes.append(node)
      if _candidate(op, partition, axes, fetched):
        candidates.add(node.name)
  consumers = collections.defaultdict(list)  # tensor name -> [(node, input index)]
  for node in nodes:
    for i, t in enumerate(node.inputs):
      consumers[t].append((node, i))
  handle_users = {name: [node for node, _ in consumers.get(name, ())] for name in handle_bytes}
  while True:
    owned, owned_variables = _settle(nodes, candidates, consumers, handle_users, may_own)
    cones = _cones(nodes, owned, owned_variables, handle_users)
    shared = {name for name, sinks in cones.items() if len(sinks) > 1}
    for handle in owned_variables:  # a variable two updates touch runs everywhere
      if len({frozenset(cones.get(node.name, ())) for node in handle_users[handle]}) > 1:
        shared.update(node.name for node in handle_users[handle])
    if not shared:
      break
    candidates -= shared
  by_sink = collections.defaultdict(list)
  for name, sinks in cones.items():
    (sink,) = sinks
    by_sink[sink].append(name)
  variables_of = collections.defaultdict(list)  # sink -> the owned variables all of whose users it claims
  for handle in owned_variables:
    sinks = {frozenset(cones.get(node.name, ())) for node in handle_users[handle]}
    if len(sinks) == 1 and len(next(iter(sinks))) == 1:
      variables_of[next(iter(next(iter(sinks))))].append(handle)
  plans = []
  for sink, names in by_sink.items():
    variables = variables_of.get(sink)
    if not variables:
      continue  # nothing to keep on an owner: a broadcast would cost more than it saves
    plans.append((sink, names, variables, sum(handle_bytes[h] for h in variables)))
  ownership = Ownership()
  for sink, names, variables, nbytes in sorted(plans, key=lambda p: (-p[3], p[0])):
    known = {fixed[h] for h in variables if h in fixed}
    position = known.pop() if len(known) == 1 else min(range(positions), key=lambda p: (load[p], p))
    load[position] += nbytes
    owner = Owner(axes, position)
    for name in names:
      ownership.ops[name] = owner
    for h in variables:
      ownership.variables[h] = owner
    ownership.broadcasts[sink] = owner
  return ownership


def _candidate(op, partition, axes, fetched) -> bool:
  """Whether ``op`` computes the same value on every device of a group without communicating."""
  decision = partition.decisions[op.name]
  if decision.fallback or decision.lower is not None or decision.values or decision.unsupported or decision.once:
    return False
  if any(r is not None for r in decision.reduce):
    return False
  if op.op_def.is_stateful and op.type not in _STATEFUL_ALLOWED:
    return False
  if any(t.name in fetched for t in op.outputs):
    return False
  for t, layout in zip(op.outputs, decision.outputs):
    if t.dtype in (tf.resource, tf.variant) or layout is None or any(set(a) & set(axes) for a in layout):
      return False
  for i, t in enumerate(op.inputs):
    if t.dtype == tf.resource:
      continue
    have = partition.layouts.get(t.name)
    want = decision.inputs[i] if i < len(decision.inputs) else None
    if have is None or any(set(a) & set(axes) for a in have):
      return False
    if want is not None and any(h and h != w for h, w in zip(have, want)):
      return False  # a gathered input: a collective every device of the group joins
  return True


def _is_sink(node, index, owned_variables) -> bool:
  """Whether input ``index`` of ``node`` (run everywhere) may come from an owner: a variable's new value."""
  return node.type in ASSIGNS and index == 1 and node.inputs[0] not in owned_variables


def _settle(nodes, candidates, consumers, handle_users, may_own=None):
  """The largest set of candidates whose consumers all run on the owner too (or are sinks).

  A variable outside ``may_own`` (if given) is never owned: its update is a
  sink, broadcast from the owner that computes it.
  """
  owned = set(candidates)
  while True:
    owned_variables = {h for h, users in handle_users.items() if users and all(u.name in owned for u in users)
                       and (may_own is None or h in may_own)}
    removed = False
    for node in reversed(nodes):
      if node.name not in owned:
        continue
      ok = not (node.type in ASSIGNS and node.inputs[0] not in owned_variables)
      for t in node.outputs:
        for consumer, index in consumers.get(t, ()):
          if consumer.name not in owned and not _is_sink(consumer, index, owned_variables):
            ok = False
      if not ok:
        owned.discard(node.name)
        removed = True
    if not removed:
      return owned, owned_variables


def _cones(nodes, owned, owned_variables, handle_users) -> dict:
  """Per owned op, the sinks (``(op name, input index)``) its value reaches or that need it.

  Backward from each sink's value through owned ops (a read of an owned
  variable brings in the variable's other uses), then forward: an owned op no
  sink needs, fed by owned ops of some sinks, joins them (it cannot run
  everywhere on a value only the owner has).
  """
  by_name = {node.name: node for node in nodes}
  cones = collections.defaultdict(set)
  for users in handle_users.values():
    for sink in users:
      if not (_is_sink(sink, 1, owned_variables) and sink.producers[1] in owned):
        continue
      label = (sink.name, 1)
      stack, seen, variables = [sink.producers[1]], set(), set()
      while stack:
        name = stack.pop()
        if name in seen or name not in owned:
          continue
        seen.add(name)
        cones[name].add(label)
        node = by_name[name]
        stack.extend(p for p, resource in zip(node.producers, node.resource) if not resource)
        handle = node.inputs[0] if node.type in _STATEFUL_ALLOWED else None
        if handle in owned_variables and handle not in variables:
          variables.add(handle)
          stack.extend(u.name for u in handle_users[handle])  # the variable's other reads and writes
  for node in nodes:  # creation order: producers first
    if node.name not in owned or node.name in cones:
      continue
    joined = set()
    for p in node.producers:
      if p in owned:
        joined |= cones.get(p, set())
    if joined:
      cones[node.name] = joined
  return dict(cones)
