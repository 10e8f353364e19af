"""Which mesh axes a value of a replica's trace varies along (as JAX's ``shard_map`` checks replication).

A replicated variable stays replicated only if every replica writes the same
value. While a step is traced, a write asks :meth:`Analysis.varying` for the
mesh axes along which the written value may differ between replicas, found
by walking the graph back to its sources:

* step inputs vary along the axes whose replicas get different inputs;
* a replicated variable's value varies along the axes it is sharded on (its
  pieces differ); on-read variables and per-replica random-seed states vary
  along every axis; other variables (created outside the Replicator) do not;
* a collective's result does not vary along the axes it communicated over
  (all_reduce, all_gather, broadcast), or varies along them (reduce_scatter,
  all_to_all, permute: each member gets its own part);
* ``repl.axis_index(axes)`` varies along ``axes``; stateful random ops along
  every axis;
* constants vary along nothing, and any other op varies where its inputs do.

A Python value that differs per replica (``float(repl.replica_id)``) is a
constant of each replica's trace and cannot be seen: use ``repl.axis_index``.
"""

from __future__ import annotations

import tensorflow as tf

# Collectives whose every group member gets the same result.
_SAME_RESULT = frozenset({"all_reduce", "all_gather", "broadcast"})
# Stateful random draws: each replica's op draws its own numbers.
_RANDOM = frozenset({"RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal",
                     "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial",
                     "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt",
                     "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial"})


class Analysis:
  """The varying axes of values in one trace (memoized by op; the graph only grows).

  Args:
    all_axes: the mesh axes of more than one device.
    input_axes: axes along which the step's inputs vary.
    inputs: names of the step graph's input ops (the step's arguments).
    variable_axes: maps a captured resource handle (the eager handle object's
      ``id``) to the axes its variable's value varies along; handles it does
      not know vary along nothing.
  """

  def __init__(self, all_axes: frozenset[str], input_axes: frozenset[str], inputs: set[str], variable_axes):
    self.all_axes = all_axes
    self.input_axes = input_axes
    self.inputs = inputs
    self.variable_axes = variable_axes
    self._memo: dict[tuple, frozenset[str]] = {}
    self._captures: dict[int, tuple[int, dict[str, object]]] = {}  # graph -> (captures seen, op name -> value)

  def varying(self, tensor: tf.Tensor) -> frozenset[str]:
    """The mesh axes along which ``tensor`` may differ between replicas."""
    if not tf.is_symbolic_tensor(tensor):
      return frozenset()
    return self._walk(tensor)

  def set(self, tensor: tf.Tensor, axes) -> None:
    """Records the axes of a value that starts here (a collective's result, ``axis_index``)."""
    self._memo[_key(tensor)] = frozenset(axes) & self.all_axes

  def collective(self, kind: str, x: tf.Tensor, y: tf.Tensor, axes) -> None:
    """Records the axes of collective result ``y`` of input ``x`` over ``axes``."""
    varying = self.varying(x)
    self.set(y, varying - set(axes) if kind in _SAME_RESULT else varying | set(axes))

  def _walk(self, root: tf.Tensor) -> frozenset[str]:
    """Post-order over the tensors ``root`` depends on (iterative: step graphs are deep)."""
    stack = [(root, False)]
    while stack:
      tensor, expanded = stack.pop()
      key = _key(tensor)
      if key in self._memo:
        continue
      sources = self._source(tensor.op)
      if sources is not None:
        self._memo[key] = sources
        continue
      parents = _parents(tensor)
      if not expanded:
        stack.append((tensor, True))
        stack.extend((p, False) for p in parents if _key(p) not in self._memo)
        continue
      axes = frozenset()
      for p in parents:
        axes |= self._memo.get(_key(p), frozenset())
      self._memo[key] = axes
    return self._memo[_key(root)]

  def _capture_of(self, op: tf.Operation):
    """The outside value a placeholder of a function graph stands for, or None (a function argument)."""
    captures = getattr(op.graph, "captures", ())
    seen, by_name = self._captures.get(id(op.graph), (-1, {}))
    if seen != len(captures):
      by_name = {internal.op.name: external for external, internal in captures}
      self._captures[id(op.graph)] = (len(captures), by_name)
    return by_name.get(op.name)

  def _source(self, op: tf.Operation) -> frozenset[str] | None:
    """The axes of an op that starts a value (None: it varies where its inputs do)."""
    if op.type in _RANDOM:
      return self.all_axes
    if op.type == "Placeholder":
      captured = self._capture_of(op)
      if captured is None:
        return self.input_axes if op.name in self.inputs else self.all_axes
      if tf.is_symbolic_tensor(captured):  # a value of the enclosing graph (a tf.cond branch's input)
        return self._walk(captured)
      if captured.dtype == tf.resource:
        return self.variable_axes(captured)
      return frozenset()  # a captured eager constant
    return None


def _key(tensor: tf.Tensor) -> tuple:
  """Memo key: an op's outputs share their axes, except IdentityN's (output i is input i)."""
  op = tensor.op
  if op.type == "IdentityN":
    return (id(op.graph), op.name, tensor.value_index)
  return (id(op.graph), op.name)


def _parents(tensor: tf.Tensor) -> list[tf.Tensor]:
  """The tensors ``tensor``'s value is computed from.

  ``IdentityN`` (what ``tf.custom_gradient`` wraps a result and its inputs
  in, as the collectives do) passes input i to output i.
  """
  op = tensor.op
  if op.type == "IdentityN":
    return [op.inputs[tensor.value_index]]
  return list(op.inputs)
