"""Rematerialization as a graph rewrite: a block's forward values computed again in the backward pass.

``replicator.remat`` rematerializes while a step is traced (a function's
gradient recomputes it). This module does it to a step already traced, so
that a search (``layouts="auto"`` under a memory budget) can choose which
blocks to rematerialize after seeing the whole step, without tracing again.

A **block** is a name scope of the traced step (a Keras layer's, a Sonnet
module's, a ``tf.name_scope``'s): :func:`blocks` finds the candidates by
descending from the top of the scopes into the scope that holds most (2/3) of
the bytes the backward pass keeps (a model's scope, not its loss's), and
taking the scopes at the first level where none does (the blocks of a model,
the layers of a ``Sequential``). In a block:

* **saved, internal**: a tensor a forward op of the block makes, that a
  backward op reads, and that no forward op outside the block reads (what the
  next block reads, its input, is kept as it is: it is a checkpoint);
* **recomputed**: the forward ops of the block the internal saved tensors
  depend on, other than stateful ones (random ops with state, variable reads
  and writes: their outputs are kept, so a recomputed stateless random op draws
  from the first pass's seeds and gives its values) and constants. A
  collective a recomputed op reads (an FSDP kernel's gather, a Megatron
  block's all-reduce) is issued again with the recomputation, on the same
  inputs, as Megatron's full recomputation does: its forward result is not
  held until the backward pass;
* **kept**: what the recomputed ops read from the forward pass: the block's
  inputs, variable reads, stateful ops' outputs.

:func:`rematerialize` rewrites a global view's expansion (every device's copy,
``expand/replica_<r>/<name>``): on each device it copies a block's recomputed
ops under ``gradient_tape/recompute/`` (so they count as backward ops), makes
every backward reader of an internal saved tensor read the copy instead, and
gives the copies whose inputs are all kept a control input on the backward ops
that make those readers' other inputs (the gradient arriving at the block),
so that the recomputation runs once the backward pass reaches the block, not
with the forward pass. The values are the first pass's: the same ops on the
same inputs.

This module knows nothing about Keras.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence

import tensorflow as tf

from rewrite import _backward
from rewrite import _expansion
from rewrite import _memory
from rewrite import _placeholders

# A scope holding this share of its parent's saved bytes is descended into: its children are the blocks.
DOMINANT = 2 / 3
RECOMPUTE_SCOPE = "gradient_tape/recompute"  # the copies' scope: under gradient_tape, so backward ops
_KEPT_TYPES = frozenset({"Const", "HostConst", "Placeholder", "PlaceholderWithDefault"})
_NOT_VALUES = (tf.resource, tf.variant)


@dataclasses.dataclass(frozen=True)
class Block:
  """A block of a traced step that can be rematerialized (see the module).

  Attributes:
    scope: its name scope (``model/block_3``).
    recomputed: the names of the forward ops computed again, in the graph's order.
    saved: the internal saved tensors (the backward pass reads the recomputed ones instead).
    kept: the tensors the recomputation reads from the forward pass.
    first_backward: the first op of the backward pass (in the graph's order) that reads a saved tensor.
  """

  scope: str
  recomputed: tuple[str, ...]
  saved: tuple[str, ...]
  kept: tuple[str, ...]
  first_backward: str = ""


def backward_ops(graph: tf.Graph) -> set[str]:
  """The names of the backward pass's ops of a traced graph (``rewrite._backward.Flow``'s rule)."""
  return _backward.Flow(graph.as_graph_def()).backward


def _bytes(t: tf.Tensor) -> int:
  """A tensor's bytes at its static shape (an unknown dimension counted as 1)."""
  if t.shape.rank is None:
    return t.dtype.size
  return math.prod(1 if n is None else n for n in t.shape.as_list()) * t.dtype.size


def _scope_parts(name: str) -> list[str]:
  return name.split("/")[:-1]


def cloneable(op: tf.Operation) -> bool:
  """Whether ``op`` can be computed again: stateless, not a constant or placeholder, its outputs values."""
  if op.type in _KEPT_TYPES or op.op_def.is_stateful or op.name.split("/")[-1].startswith(
      _placeholders.PLACEHOLDER_SCOPE):
    return False
  return not any(t.dtype in _NOT_VALUES for t in op.outputs)


def saved_tensors(ops: Sequence[tf.Operation], backward: set[str]) -> dict[str, tf.Tensor]:
  """Tensor name -> tensor, of the forward tensors a backward op reads other than for its shape (not reads)."""
  saved = {}
  for op in ops:
    if op.name not in backward or op.type in _memory.SHAPE_ONLY:
      continue
    for t in op.inputs:
      if (t.op.name not in backward and t.op.type not in _memory.CONSTANTS and t.dtype not in _NOT_VALUES
          and t.op.type not in _memory.VARIABLE_READS):  # (a read is the variable's buffer)
        saved[t.name] = t
  return saved


def _block(scope: str, ops: Sequence[tf.Operation], backward: set[str], saved: dict) -> Block | None:
  prefix = scope + "/"
  inside = {op.name for op in ops if op.name.startswith(prefix) and op.name not in backward}
  internal = []
  for t in saved.values():
    if t.op.name not in inside or not cloneable(t.op):
      continue
    if all(r.name in inside or r.name in backward for r in t.consumers()):
      internal.append(t)
  if not internal:
    return None
  recomputed, stack = set(), [t.op for t in internal]
  while stack:
    op = stack.pop()
    if op.name in recomputed:
      continue
    recomputed.add(op.name)
    stack += [t.op for t in op.inputs if t.op.name in inside and cloneable(t.op) and t.op.name not in recomputed]
  order = [op.name for op in ops if op.name in recomputed]
  kept = dict.fromkeys(t.name for op in ops if op.name in recomputed for t in op.inputs
                       if t.op.name not in recomputed)
  readers = {r.name for t in internal for r in t.consumers() if r.name in backward}
  first = next((op.name for op in ops if op.name in readers), "")
  return Block(scope, tuple(order), tuple(sorted(t.name for t in internal)), tuple(kept), first)


def blocks(graph: tf.Graph) -> list[Block]:
  """The blocks of a traced step that could be rematerialized, in the graph's order (see the module)."""
  ops = graph.get_operations()
  backward = backward_ops(graph)
  if not backward:
    return []
  saved = saved_tensors(ops, backward)
  weighted = [(_scope_parts(t.op.name), _bytes(t)) for t in saved.values()]
  prefix: list[str] = []
  while True:  # down into the scope holding most of a scope's saved bytes (a model's, not its loss's)
    children: dict[str, int] = {}
    for path, n in weighted:
      if len(path) > len(prefix) and path[:len(prefix)] == prefix:
        children[path[len(prefix)]] = children.get(path[len(prefix)], 0) + n
    largest = max(children, key=children.get, default=None)
    if largest is None or (len(children) > 1 and children[largest] < DOMINANT * sum(children.values())):
      break
    prefix.append(largest)
  names = ["/".join(prefix + [child]) for child in children]
  first = {}
  for i, op in enumerate(ops):
    for name in names:
      if name not in first and op.name.startswith(name + "/"):
        first[name] = i
  found = [_block(name, ops, backward, saved) for name in sorted(names, key=lambda n: first.get(n, 0))]
  return [b for b in found if b is not None]



@dataclasses.dataclass(frozen=True)
class Rematerialized:
  """What :func:`rematerialize` did.

  Attributes:
    graph_def: the rewritten graph.
    recomputed: (device key, block scope) of each block rematerialized, on each device.
    skipped: (device key, block scope, why) of each block left as it was on a device.
    records: the collectives' placeholders' records, with the recomputation's own (see :func:`rematerialize`).
  """

  graph_def: tf.compat.v1.GraphDef
  recomputed: tuple[tuple[str, str], ...]
  skipped: tuple[tuple[str, str, str], ...]
  records: list | None = None


def rematerialize(graph_def, chosen: Iterable[Block], made_for=None, records=None,
                  position: Mapping[str, int] | None = None) -> Rematerialized:
  """``graph_def`` with the blocks ``chosen`` recomputed in its backward pass, on every device's copy.

  Args:
    graph_def: a step's graph: a global view's expansion, or a traced graph.
    chosen: blocks of the traced graph (:func:`blocks`).
    made_for: ``(node name, global op names)`` -> (its device's key, the op in ``names`` it was made for), or
      None; default ``rewrite._expansion.made_for`` (a copy, or an op a rule made for it: the partitioned form
      of a stateless op is stateless); for a traced graph itself, ``lambda n, names: ("", n) if n in names
      else None``.
    records: per device, its collectives' placeholders' records (an expansion's). A recomputed op that reads a
      collective's result made for the forward pass (an FSDP kernel gathered) reads a collective of its own,
      made with the recomputation (waiting as it does): the forward pass's is not held until the backward pass.
      Each device's records get it at the same place: before the first one made for an op at or after the
      block's first backward reader in the traced graph (``position``: the traced ops' names -> their index),
      so that every device issues its collectives in one order.
    position: see ``records``.
  """
  made_for = made_for or _expansion.made_for
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(graph_def)
  chosen = list(chosen)
  wanted = {name for block in chosen for name in block.recomputed}
  made: dict[tuple[str, str], list[str]] = collections.defaultdict(list)  # (device key, global op) -> its nodes
  for node in out.node:
    found = made_for(node.name, wanted)
    if (found is not None and node.op not in _KEPT_TYPES
        and _placeholders.PLACEHOLDER_SCOPE not in node.name.split("/")):
      made[found].append(node.name)
  flow = _backward.Flow(out)
  placeholders = {record.node: (r, record) for r, device_records in enumerate(records or ())
                  for record in device_records or ()}
  inserted: dict[int, list] = collections.defaultdict(list)  # device -> (place in its records, a new record)
  done, skipped = [], []
  for key in sorted({key for key, _ in made}):
    for block in chosen:
      here = [name for op in block.recomputed for name in made.get((key, op), ())]
      if not here:
        continue
      consumers = sorted({r for name in here for r in flow.data_readers(name) if r in flow.backward})
      if not consumers:
        skipped.append((key, block.scope, "no backward op reads what it recomputes on this device"))
        continue
      triggers = flow.triggers(consumers, besides=here)
      if not triggers:
        skipped.append((key, block.scope, "nothing of the backward pass precedes it there"))
        continue
      rename = {name: f"{key}{RECOMPUTE_SCOPE}/{name[len(key):] if name.startswith(key) else name}"
                for name in here}

      renamed = functools.partial(_renamed, rename)

      again = {}  # a forward collective's placeholder -> the recomputation's own
      for name in here:
        for ref in flow.nodes[name].input:
          source = _backward.node_of(ref)
          if ref.startswith("^") or source not in placeholders or source in again:
            continue
          r, record = placeholders[source]
          if _backward.node_of(record.input) in flow.backward:
            continue
          again[source] = _again(flow, record, key, triggers)
          inserted[r].append((_place(records[r], block, position), again[source][1]))
      for name in here:
        clone = tf.compat.v1.NodeDef()
        clone.CopyFrom(flow.nodes[name])
        clone.name = rename[name]
        del clone.input[:]
        clone.input.extend(_gathered(renamed(ref), again) for ref in flow.nodes[name].input)
        if not any(_backward.node_of(ref) in rename for ref in flow.nodes[name].input):  # a root: waits
          clone.input.extend("^" + t for t in triggers)
        flow.add(clone)
        flow.backward.add(clone.name)
      for r in consumers:
        flow.rewire(r, [renamed(ref) if not ref.startswith("^") else ref for ref in flow.nodes[r].input])
      done.append((key, block.scope))
  if records is not None:
    records = [_inserted(device_records, inserted.get(r, ())) for r, device_records in enumerate(records)]
  return Rematerialized(out, tuple(done), tuple(skipped), records)


def _renamed(rename: dict, ref: str) -> str:
  """``ref`` (a data or control input) naming its node's copy, if ``rename`` has one."""
  node = _backward.node_of(ref)
  if node not in rename:
    return ref
  port = ref.partition(":")[2]
  return ("^" if ref.startswith("^") else "") + rename[node] + (f":{port}" if port else "")


def _again(flow: _backward.Flow, record, key: str, triggers: list[str]):
  """A copy of ``record``'s placeholder for the recomputation, its input waiting for ``triggers``: (node, record)."""
  name = base = f"{key}{RECOMPUTE_SCOPE}/{record.node[len(key):] if record.node.startswith(key) else record.node}"
  copies = 1
  while name in flow.nodes:  # the same collective read by another block's recomputation: one each
    copies += 1
    name = f"{base}_{copies}"
  waited = flow.waiting(f"{name}/waits", record.input, record.dtype, record.device, triggers)
  node = tf.compat.v1.NodeDef()
  node.CopyFrom(flow.nodes[record.node])
  node.name = name
  flow.add(node)
  flow.backward.add(name)
  return name, dataclasses.replace(record, node=name, input=waited)


def _gathered(ref: str, again: dict) -> str:
  node = _backward.node_of(ref)
  if ref.startswith("^") or node not in again:
    return ref
  port = ref.partition(":")[2]
  return again[node][0] + (f":{port}" if port else "")


def _place(device_records, block: Block, position: Mapping[str, int] | None) -> int:
  """Where a collective of ``block``'s recomputation goes in a device's records (see :func:`rematerialize`)."""
  if not position or block.first_backward not in position:
    return len(device_records)
  start = position[block.first_backward]
  for i, record in enumerate(device_records):
    if position.get(record.call.partition(" ")[2], -1) >= start:
      return i
  return len(device_records)


def _inserted(device_records, new) -> list | None:
  """``device_records`` with the ``(place, record)`` of ``new`` inserted, each record's index its place."""
  if device_records is None:
    return None
  by_place = collections.defaultdict(list)
  for place, record in new:
    by_place[place].append(record)
  merged = []
  for i in range(len(device_records) + 1):
    merged += by_place.get(i, [])
    if i < len(device_records):
      merged.append(device_records[i])
  return [dataclasses.replace(record, index=i) for i, record in enumerate(merged)]
