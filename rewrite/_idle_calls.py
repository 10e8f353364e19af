"""What a pipelined step's idle collective calls leave: removed once the calls are lowered.

In a pipelined global-view step (``_partition_stages``) a device makes the
collective calls of the ops it does not run (another stage's, or another
microbatch position's) on zeros, so that every device's calls match and the
plan pairs them (``_expansion``). Lowered, a group of such calls alone is
ops on zeros whose results nothing reads; a group mixing them with real
calls (the sum of a metric's components, on every stage) uses their zeros.
TensorFlow would prune the unused ops when the step's function runs; they
would still cost the import, and the memory report would count their
tensors. This pass removes them: every node computed from the zeros alone
(constants aside) that no other node needs.
"""

from __future__ import annotations

import tensorflow as tf


def without_idle(graph_def: tf.compat.v1.GraphDef, idle, keep=()) -> tf.compat.v1.GraphDef:
  """``graph_def`` without the nodes made from the ``idle`` nodes alone that no remaining node reads.

  Args:
    graph_def: the lowered step.
    idle: names of the zeros the idle calls were made on (``Expansion.idle``).
    keep: names of nodes to keep (the step's outputs).
  """
  if not idle:
    return graph_def
  nodes = {node.name: node for node in graph_def.node}
  derived = set(n for n in idle if n in nodes)
  for node in graph_def.node:  # (in order: a node's inputs before it)
    data = [_source(i) for i in node.input if not i.startswith("^")]
    if node.name not in derived and data and all(d in derived or nodes.get(d) is not None and nodes[d].op == "Const"
                                                  for d in data) and any(d in derived for d in data):
      derived.add(node.name)
  readers: dict = {}
  for node in graph_def.node:
    for i in node.input:
      readers.setdefault(_source(i), set()).add(node.name)
  dead = {n for n in derived if n not in keep}
  needed = [n for n in dead if readers.get(n, set()) - dead]  # a derived node another node needs is kept
  while needed:
    name = needed.pop()
    if name not in dead:
      continue
    dead.discard(name)
    needed.extend(_source(i) for i in nodes[name].input if _source(i) in dead)
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  for node in graph_def.node:
    if node.name not in dead:
      out.node.add().CopyFrom(node)
  return out


def _source(ref: str) -> str:
  return ref.lstrip("^").split(":")[0]
