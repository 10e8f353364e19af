"""Merging a step's duplicate variable reads.

A traced step reads a variable wherever its code asks for the value: Keras's
optimizers read the step counter and the learning rate once per variable they
update (``self.iterations + 1``, then the same ``pow``/``sqrt`` chain of
scalars for every variable). A read is stateful, so Grappler's common
subexpression elimination keeps every copy, and with them every scalar op
that follows. Two reads with the same inputs, data and control, on the same
device cannot be told apart by the graph: any write is ordered before both or
after both, or races with both alike, so one read can serve both. Merging
them lets Grappler fold what follows (the deep MLP with Adam on 4 devices:
484 reads -> 328, its step 0.94 of the unmerged [0.92, 0.96]). Only reads of
small values are merged (the caller says which: see :func:`merge_reads`).

Works on the serialized graph only, like :mod:`rewrite._apply`; only the
graph's own nodes, not the bodies of its functions.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

READS = frozenset({"ReadVariableOp"})
SMALL = 64  # elements: the reads :func:`small_reads` lets merge (scalars, small vectors)


def small_reads(op_of: Callable[[str], "tf.Operation | None"]) -> Callable[[str], bool]:
  """A ``mergeable`` for :func:`merge_reads`: reads whose traced op (``op_of(name)``) has a small static shape."""

  def mergeable(name: str) -> bool:
    op = op_of(name)
    if op is None or not op.outputs:
      return False
    shape = op.outputs[0].shape
    return shape.is_fully_defined() and shape.num_elements() <= SMALL

  return mergeable


def merge_reads(graph_def: tf.compat.v1.GraphDef, mergeable: Callable[[str], bool]) -> dict[str, str]:
  """Merges the reads of ``graph_def`` that no execution could tell apart (in place).

  Two reads are merged when they read the same resource with the same data
  and control inputs (in the same order), on the same device, as the same
  dtype, and ``mergeable(name)`` holds for both. Their consumers take the kept
  read (the first in the GraphDef), and control inputs that become duplicates
  are dropped.

  ``mergeable``: a read's value lives as long as its last consumer, and a
  variable written in place while a read of it is alive is copied first. A
  merged read of a weight, used by the forward pass and again by the update,
  would keep it alive across the update's write: the global view's 2x2 MLP
  step with every read merged took 1.11 of its time with none (all or
  nothing). Merge small values (a step counter, a learning rate) only.

  Returns:
    the name of each removed read -> the name of the read that replaces it.
  """
  kept: dict[tuple, str] = {}
  merged: dict[str, str] = {}
  for node in graph_def.node:
    if node.op in READS and mergeable(node.name):
      key = (node.op, tuple(node.input), node.device, node.attr["dtype"].type)
      first = kept.setdefault(key, node.name)
      if first != node.name:
        merged[node.name] = first
  if not merged:
    return merged
  for node in graph_def.node:
    if node.name in merged:
      continue
    if "_class" in node.attr:  # colocation with a removed read: with the read kept
      group = node.attr["_class"].list.s
      if any(loc.startswith(b"loc:@") and loc[5:].decode() in merged for loc in group):
        locations = [b"loc:@" + merged.get(loc[5:].decode(), loc[5:].decode()).encode()
                     if loc.startswith(b"loc:@") else loc for loc in group]
        del group[:]
        group.extend(dict.fromkeys(locations))
    if not any(_name(ref) in merged for ref in node.input):
      continue
    inputs, controls = [], set()
    for ref in node.input:
      ref = renamed_tensor(ref, merged)
      if ref.startswith("^"):
        if ref in controls:
          continue
        controls.add(ref)
      inputs.append(ref)
    del node.input[:]
    node.input.extend(inputs)
  for i in reversed([i for i, node in enumerate(graph_def.node) if node.name in merged]):
    del graph_def.node[i]
  return merged


def _name(ref: str) -> str:
  return ref.lstrip("^").partition(":")[0]


def renamed_tensor(ref: str, merged: dict[str, str]) -> str:
  """Tensor ``ref`` ('op:port', or '^op' for a control input) after :func:`merge_reads` returned ``merged``."""
  control = ref.startswith("^")
  name, colon, port = ref.lstrip("^").partition(":")
  if name not in merged:
    return ref
  return f"^{merged[name]}" if control else f"{merged[name]}{colon}{port}"
