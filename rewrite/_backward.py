"""A step's backward pass in its ``GraphDef``: which nodes are of it, and when it reaches a node.

Two rewrites make work wait for the backward pass instead of running it as
soon as its inputs exist (TensorFlow's executor runs any op whose inputs are
ready): a rematerialized block's recomputation (``rewrite._recompute``), and a
collective that gathers a forward value for the backward pass alone, such as
an FSDP kernel's all-gather (``rewrite._deferred``). Both wait on the same
nodes, :meth:`Flow.triggers`: the backward nodes that make the other inputs of
the readers (the gradient arriving at a layer), of which none depends on the
readers.

A node is of the backward pass as ``rewrite._memory`` counts it: under a
``gradient_tape``/``gradients`` name scope, or reading a tensor of such a node
(the tape's sums of gradients, an optimizer's update).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import tensorflow as tf

from rewrite import _memory


def node_of(ref: str) -> str:
  """``"^a"``, ``"a:1"``, ``"a"`` -> ``"a"``."""
  return ref.lstrip("^").partition(":")[0]


class Flow:
  """The nodes of a ``GraphDef`` (changed in place), their readers and which of them are backward."""

  def __init__(self, graph_def):
    self.graph_def = graph_def
    self.nodes = {node.name: node for node in graph_def.node}
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
    """
    consumers = list(consumers)
    besides = set(besides)
    after = self.after(consumers) if after is None else after
    return sorted({node_of(ref) for r in consumers for ref in self.nodes[r].input if not ref.startswith("^")
                   and node_of(ref) in self.backward and node_of(ref) not in after
                   and node_of(ref) not in besides})

  def add(self, node) -> None:
    """Adds ``node`` (a ``NodeDef``) to the graph."""
    added = self.graph_def.node.add()
    added.CopyFrom(node)
    self.nodes[added.name] = added
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
