"""Values gathered for the forward pass, gathered again for the backward pass instead of held until it.

Attention over a split sequence gathers each layer's keys and values (every
device's queries meet every key); the backward pass reads them again, and
TensorFlow keeps what it reads from the forward pass until then: each
device would hold every layer's whole keys and values, P times its own. As
context parallelism does (Megatron-LM, PyTorch's), the backward pass gathers
them again instead, from the pieces each device keeps anyway.

:func:`blocks` finds them in a partitioned step: a forward tensor the
backward pass reads, computed by a short chain of cheap ops (elementwise,
shape changes: a bias added, heads repeated for grouped-query attention, a
transpose) from an input the partition gathers (an all-gather of split
pieces, not a slice). Each becomes a :class:`rewrite._recompute.Block` that
:func:`rewrite._recompute.rematerialize` recomputes in the backward pass:
the chain's ops copied, its gathers issued again, waiting for the backward
pass to reach them. A variable's read gathered (an FSDP kernel) is regathered
by the expansion itself (``rewrite._relayout.reuse_key``).
"""

from __future__ import annotations

import tensorflow as tf

from rewrite import _memory
from rewrite import _recompute
from rewrite.rules import _elementwise

# Ops cheap enough to compute again: no contraction, nothing stateful; their output no bigger than a few inputs.
CHEAP = frozenset(_elementwise.UNARY + _elementwise.BINARY) | frozenset({
    "Reshape", "Transpose", "ExpandDims", "Squeeze", "Tile", "StridedSlice", "Slice", "ConcatV2", "Pack",
    "BroadcastTo", "Select", "BiasAdd"})
MAX_CHAIN = 8  # ops of one chain at most (the gather, then a bias, a repeat's three ops, a transpose)


def _gathers(have, want) -> bool:
  """Whether relayouting ``have`` to ``want`` gathers (a dimension's split changes from some axes to others)."""
  return (have is not None and want is not None and len(have) == len(want)
          and any(h and h != w for h, w in zip(have, want)))


def blocks(graph: tf.Graph, partition, backward: set[str] | None = None) -> list[_recompute.Block]:
  """The gathered values of ``graph`` (partitioned by ``partition``) to gather again for the backward pass.

  Args:
    graph: the traced global graph.
    partition: its partition (``layouts``, ``decisions``).
    backward: the names of its backward ops (default: ``rewrite._recompute.backward_ops``).

  Returns:
    One block per saved tensor so computed, in the graph's order; its ``scope`` names the tensor.
  """
  ops = graph.get_operations()
  layouts, decisions = partition.layouts, partition.decisions

  def gathering(op) -> bool:  # an op reading an activation (not a variable's value) relayouted by a gather
    decision = decisions.get(op.name)
    if decision is None or decision.lower is not None:
      return False
    return any(i < len(decision.inputs) and t.op.type not in _memory.VARIABLE_READS
               and _gathers(layouts.get(t.name), decision.inputs[i]) for i, t in enumerate(op.inputs))

  def summed(t) -> bool:  # a partial sum's result (all-reduced or reduce-scattered): not gathered again
    decision = decisions.get(t.op.name)
    return decision is not None and t.value_index < len(decision.reduce) and decision.reduce[t.value_index] is not None

  def cheap(op) -> bool:
    decision = decisions.get(op.name)
    return (op.type in CHEAP and op.name not in backward and decision is not None and _recompute.cloneable(op)
            and not any(r is not None for r in decision.reduce) and not any(summed(t) for t in op.inputs))

  if not any(gathering(op) for op in ops):  # (most steps: nothing to find, and the backward pass not looked for)
    return []
  backward = _recompute.backward_ops(graph) if backward is None else backward
  if not backward:
    return []
  chains: dict[str, frozenset] = {}  # op name -> the cheap ops from gathers to it (empty: none)

  def chain(op) -> frozenset:
    if op.name in chains:
      return chains[op.name]
    chains[op.name] = frozenset()  # (cycles cannot happen in a graph; this is the default)
    if not cheap(op):
      return chains[op.name]
    found = {op.name} if gathering(op) else set()
    for t in op.inputs:
      below = chain(t.op)
      if below:
        found |= below | {op.name}
    chains[op.name] = frozenset(found) if len(found) <= MAX_CHAIN else frozenset()
    return chains[op.name]

  saved = _recompute.saved_tensors(ops, backward)
  order = {op.name: i for i, op in enumerate(ops)}
  groups: list[tuple[set, list]] = []  # (ops, saved tensors): chains that share an op are one block
  for t in sorted(saved.values(), key=lambda t: order[t.op.name]):
    recomputed = set(chain(t.op))
    if not recomputed:
      continue
    tensors = [t]
    for group in [g for g in groups if g[0] & recomputed]:
      groups.remove(group)
      recomputed |= group[0]
      tensors += group[1]
    groups.append((recomputed, sorted(tensors, key=lambda x: order[x.op.name])))
  found = []
  for recomputed, tensors in sorted(groups, key=lambda g: min(order[n] for n in g[0])):
    names = sorted(recomputed, key=order.get)
    kept = tuple(dict.fromkeys(x.name for name in names for x in graph.get_operation_by_name(name).inputs
                               if x.op.name not in recomputed))
    readers = [r.name for t in tensors for r in t.consumers() if r.name in backward]
    first = min(readers, key=order.get) if readers else ""
    found.append(_recompute.Block(f"gathered {tensors[0].name}", tuple(names), tuple(t.name for t in tensors),
                                  kept, first))
  return found
