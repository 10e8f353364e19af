"""A step's backward pass in its ``GraphDef``: which nodes are of it, and when it reaches a node.

Two rewrites make work wait for the backward pass instead of running it as
soon as its inputs exist (TensorFlow's executor runs any op whose inputs are
ready): a rematerialized block's recomputation (``rewrite._recompute``), and a
collective that gathers a forward value for the backward pass alone, such as
an FSDP kernel's all-gather (``rewrite._deferred``). Both wait on the same
nodes, :meth:`Flow.triggers`: the backward nodes that make the other inputs of
the readers (the gradient arriving at a layer), of which none depends on the
readers. Where the readers have no such input (a backward op slicing a block
of a forward value with constants: the keys of a blockwise attention's
backward pass), the gradient arriving is looked for further on, in what the
readers feed (the product of those keys with the gradient).

A node is of the backward pass as ``rewrite._memory`` counts it: under a
``gradient_tape``/``gradients`` name scope, or reading a tensor of such a node
(the tape's sums of gradients, an optimizer's update); and a node the
partition made of a collective's result for backward readers alone (a local
slice of a gathered value for a backward op, when a further axis splits it).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import tensorflow as tf

from rewrite import _memory
from rewrite import _placeholders

LOOK_AHEAD = 16  # readers followed from the consumers to the gradient arriving (a block's slice, its scores, their product)


def node_of(ref: str) -> str:
  """``"^a"``, ``"a:1"``, ``"a"`` -> ``"a"``."""
  return ref.lstrip("^").partition(":")[0]


class Flow:
  """The nodes of a ``GraphDef`` (changed in place), their readers and which of them are backward."""

  def __init__(self, graph_def):
    self.graph_def = graph_def
    self.nodes = {node.name: node for node in graph_def.node}
    self.position = {node.name: i for i, node in enumerate(graph_def.node)}  # (the order the nodes were made in)
    self.readers: dict[str, set[str]] = collections.defaultdict(set)
    data: dict[str, list[str]] = collections.defaultdict(list)  # node -> the nodes reading an output of it
    seeds = []
    for node in graph_def.node:
      for ref in node.input:
        source = node_of(ref)
        self.readers[source].add(node.name)
        if not ref.startswith("^"):
          data[source].append(node.name)
      if "gradient" in node.name and _memory.is_backward(node.name):
        seeds.append(node.name)
    self._data = data
    self.backward = self.closure(seeds)
    for node in reversed(graph_def.node):  # (readers first) a relayout of a collective's result for backward ops
      readers = data.get(node.name)
      if (readers and node.name not in self.backward and all(r in self.backward for r in readers)
              and any(_placeholders.PLACEHOLDER_SCOPE in node_of(ref).split("/") for ref in node.input
                      if not ref.startswith("^"))):
        self.backward.add(node.name)

  def closure(self, seeds: Iterable[str]) -> set[str]:
    """``seeds`` and every node reading (by a data edge) an output of one, transitively."""
    stack = list(seeds)
    found = set(stack)
    while stack:
      for r in self._data.get(stack.pop(), ()):
        if r not in found:
          found.add(r)
          stack.append(r)
    return found

  def data_readers(self, name: str) -> list[str]:
    """The nodes reading an output of ``name`` (not by a control edge), in name order."""
    return sorted(set(self._data.get(name, ())))

  def after(self, names: Iterable[str], forward_only: bool = False) -> set[str]:
    """``names`` and every node that depends on one of them (with ``forward_only``, of the forward pass: what
    depends on them only through the backward pass left out)."""
    found, stack = set(), list(names)
    while stack:
      name = stack.pop()
      if name not in found:
        found.add(name)
        stack += [r for r in self.readers.get(name, ())
                  if r not in found and not (forward_only and r in self.backward)]
    return found

  def triggers(self, consumers: Iterable[str], besides: Iterable[str] = (), after: set[str] | None = None
               ) -> list[str]:
    """The backward nodes making the data inputs of ``consumers`` that depend on none of them (nor ``besides``).

    Work given a control input on each waits until the backward pass reaches the consumers: the gradient
    arriving at them exists. Empty: nothing of the backward pass precedes them. ``after``: ``self.after(consumers)``,
    if the caller has it.

    Where the consumers read nothing of the backward pass but what ``besides`` names and constants (a slice of
    a forward value), the nodes they feed are followed (up to :data:`LOOK_AHEAD` readers on) to the first with
    such inputs: the gradient arriving is those inputs, or where one was made after a consumer in the graph's
    order, what it was made from (the gradient a reshape of it reads), so that a trigger depends on no
    collective made for the consumers or after them (``rewrite._deferred``'s order).
    """
    consumers = list(consumers)
    besides = set(besides)
    after = self.after(consumers) if after is None else after

    def inputs(names):
      return {node_of(ref) for r in names for ref in self.nodes[r].input if not ref.startswith("^")
              and node_of(ref) in self.backward and node_of(ref) not in after and node_of(ref) not in besides}

    found = inputs(consumers)
    if found or not consumers:
      return sorted(found)
    first = min(self.position.get(r, len(self.position)) for r in consumers)

    def made_before(names):  # names, each made after the first consumer followed up to what it was made from
      made, stack, seen = set(), list(names), set()
      while stack and len(seen) < LOOK_AHEAD * 8:
        name = stack.pop()
        if name not in seen:
          seen.add(name)
          if self.position.get(name, first) < first:
            made.add(name)
          else:
            stack += inputs([name])
      return made

    frontier, seen = consumers, set(consumers)
    for _ in range(LOOK_AHEAD):
      frontier = sorted({r for n in frontier for r in self._data.get(n, ()) if r in self.backward and r not in seen})
      seen.update(frontier)
      found = made_before(inputs(frontier))
      if found or not frontier:
        return sorted(found)
    return []

  def add(self, node) -> None:
    """Adds ``node`` (a ``NodeDef``) to the graph."""
    added = self.graph_def.node.add()
    added.CopyFrom(node)
    self.nodes[added.name] = added
    self.position[added.name] = len(self.position)
    for ref in added.input:
      self.readers[node_of(ref)].add(added.name)
      if not ref.startswith("^"):
        self._data[node_of(ref)].append(added.name)

  def waiting(self, name: str, ref: str, dtype, device: str, triggers: Iterable[str]) -> str:
    """Adds an ``Identity`` named ``name`` of tensor ``ref`` with control inputs on ``triggers``, of the
    backward pass: its output, ``ref``'s value once the triggers ran (a collective reading it waits so)."""
    node = tf.compat.v1.NodeDef(name=name, op="Identity", device=device)
    node.attr["T"].type = tf.as_dtype(dtype).as_datatype_enum
    node.input.append(ref)
    node.input.extend("^" + t for t in triggers)
    self.add(node)
    self.backward.add(name)
    return f"{name}:0"

  def rewire(self, name: str, refs: list[str]) -> None:
    """Sets the inputs of node ``name`` to ``refs``."""
    node = self.nodes[name]
    for ref in node.input:
      self.readers[node_of(ref)].discard(name)
      if not ref.startswith("^") and name in self._data.get(node_of(ref), ()):
        self._data[node_of(ref)].remove(name)
    del node.input[:]
    node.input.extend(refs)
    for ref in refs:
      self.readers[node_of(ref)].add(name)
      if not ref.startswith("^"):
        self._data[node_of(ref)].append(name)
