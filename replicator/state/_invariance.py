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
* constants vary along nothing, and any other op varies where its inputs do;
* control flow: a ``tf.cond``'s (``If``) result varies where its predicate
  or the chosen branch's result does; a ``tf.while_loop``'s loop variables
  where their initial values, the body's results, or (for those the body
  changes) the trip count do, found by iterating to a fixed point; inside a
  body, its arguments vary as the values they stand for.

Code inside a ``tf.cond`` branch or a ``tf.while_loop`` body runs on some
replicas and not on others (or a different number of times) when the
predicate or trip count varies: :meth:`Analysis.conditions` says along which
axes, for the checks of writes there (control dependence: a write of an
equal value under a condition that differs between replicas is a write
that differs). It reads the ``If`` and ``While`` ops' ``_true_graph``,
``_false_graph``, ``_cond_graph`` and ``_body_graph`` attributes, which
TensorFlow's ``cond_v2`` and ``while_v2`` set (checked on TF 2.21); without
them a loop's trip count is taken to vary along every axis.

A Python value that differs per replica (``float(repl.replica_id)``) is a
constant of each replica's trace and cannot be seen: use ``repl.axis_index``.
"""

from __future__ import annotations

import tensorflow as tf

from replicator.state import _access

# Collectives whose every group member gets the same result.
_SAME_RESULT = frozenset({"all_reduce", "all_gather", "broadcast"})
# Stateful random draws: each replica's op draws its own numbers.
_RANDOM = frozenset({"RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal",
                     "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial",
                     "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt",
                     "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial"})
_CONDS = frozenset({"If", "StatelessIf"})
_CASES = frozenset({"Case", "StatelessCase"})
_LOOPS = frozenset({"While", "StatelessWhile"})
# Ops whose outputs each have their own axes.
_PER_OUTPUT = frozenset({"IdentityN"}) | _CONDS | _CASES | _LOOPS


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
    self._callers: dict[int, tuple[int, dict[str, tf.Operation]]] = {}  # graph -> (ops seen, function -> op)
    # While op -> (axes of each loop variable, axes of the trip count); a guess while its fixed point is sought.
    self._loops: dict[tuple, tuple[list[frozenset[str]], frozenset[str]]] = {}
    # Writes inside control flow, checked once the trace is complete (``_variables``): a body is traced
    # before the op that runs it exists, so its predicate and loop variables are known only then.
    self.deferred: list = []

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

  def conditions(self, graph: tf.Graph) -> list[tuple[tf.Operation, frozenset[str]]]:
    """For each control-flow op around code of ``graph`` (innermost first): the axes along which it varies.

    That is along which whether the code runs (a ``tf.cond``'s predicate, a
    ``tf.switch_case``'s branch index) or how many times (a
    ``tf.while_loop``'s trip count) may differ between replicas; a plain
    function call's is empty. Call it once the trace is complete.
    """
    found = []
    while getattr(graph, "outer_graph", None) is not None:
      op = self._caller(graph)
      if op is None:
        break
      if op.type in _CONDS or op.type in _CASES:
        found.append((op, self._walk(op.inputs[0])))
      elif op.type in _LOOPS:
        loop = self._loop(op)
        found.append((op, self.all_axes if loop is None else loop[1]))
      else:
        found.append((op, frozenset()))
      graph = op.graph
    return found

  def _caller(self, graph: tf.Graph) -> tf.Operation | None:
    """The op of the enclosing graph that runs function graph ``graph`` (None: not made yet, or unknown)."""
    outer = graph.outer_graph
    operations = outer.get_operations()
    seen, by_function = self._callers.get(id(outer), (-1, {}))
    if seen != len(operations):
      by_function = {name: op for op in operations for name in _access.called_functions(op)}
      self._callers[id(outer)] = (len(operations), by_function)
    return by_function.get(graph.name)

  def _loop(self, op: tf.Operation) -> tuple[list[frozenset[str]], frozenset[str]] | None:
    """``(axes of each loop variable, axes of the trip count)`` of While ``op``; None if its graphs are unknown.

    A loop variable varies where its initial value or the body's result for
    it does, and, if the body changes it, where the trip count does (one
    replica runs more iterations); the trip count where the condition's
    result does. Iterated from the initial values to a fixed point (the
    axes only grow); what was inferred from a guess is forgotten.
    """
    key = (id(op.graph), op.name)
    if key in self._loops:
      return self._loops[key]
    cond, body = getattr(op, "_cond_graph", None), getattr(op, "_body_graph", None)
    n = len(op.inputs)
    if cond is None or body is None or not len(body.inputs) == len(body.outputs) == len(cond.inputs) == n:
      return None
    changed = [not _passes_through(out, arg) for out, arg in zip(body.outputs, body.inputs)]
    axes = [self._walk(t) for t in op.inputs]
    while True:
      self._loops[key] = (axes, self.all_axes)
      memo, loops = dict(self._memo), dict(self._loops)
      trip = self._walk(cond.outputs[0])
      after = [self._walk(t) for t in body.outputs]
      self._memo, self._loops = memo, loops
      grown = [a | b | (trip if c else frozenset()) for a, b, c in zip(axes, after, changed)]
      if grown == axes:
        break
      axes = grown
    self._loops[key] = (axes, trip)
    return self._loops[key]

  def _walk(self, root: tf.Tensor) -> frozenset[str]:
    """Post-order over the tensors ``root`` depends on (iterative: step graphs are deep)."""
    stack = [(root, False)]
    while stack:
      tensor, expanded = stack.pop()
      key = _key(tensor)
      if key in self._memo:
        continue
      sources = self._source(tensor)
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

  def _source(self, tensor: tf.Tensor) -> frozenset[str] | None:
    """The axes of a value that starts here or is found apart from its inputs (None: it varies where they do)."""
    op = tensor.op
    if op.type in _RANDOM:
      return self.all_axes
    if op.type == "Placeholder":
      captured = self._capture_of(op)
      if captured is None:
        return self.input_axes if op.name in self.inputs else self._argument(tensor)
      if tf.is_symbolic_tensor(captured):  # a value of the enclosing graph (a tf.cond branch's input)
        return self._walk(captured)
      if captured.dtype == tf.resource:
        return self.variable_axes(captured)
      return frozenset()  # a captured eager constant
    if op.type in _CONDS:
      branches = [getattr(op, "_true_graph", None), getattr(op, "_false_graph", None)]
      if all(b is not None and len(b.outputs) == len(op.outputs) for b in branches):
        axes = self._walk(op.inputs[0])
        for branch in branches:
          axes |= self._walk(branch.outputs[tensor.value_index])
        return axes
    if op.type in _LOOPS:
      loop = self._loop(op)
      if loop is not None:
        return loop[0][tensor.value_index]
    return None

  def _argument(self, tensor: tf.Tensor) -> frozenset[str]:
    """The axes of an argument of a function graph: those of the value passed (a loop variable's), else all."""
    graph = tensor.graph
    if getattr(graph, "outer_graph", None) is None:
      return self.all_axes
    op = self._caller(graph)
    position = next((i for i, t in enumerate(graph.inputs) if t.name == tensor.name), None)
    if op is None or position is None:
      return self.all_axes  # the op that runs it is not made yet
    if op.type in _LOOPS:
      loop = self._loop(op)
      return self.all_axes if loop is None else loop[0][position]
    index = _access.first_argument(op) + position
    return self._walk(op.inputs[index]) if index < len(op.inputs) else self.all_axes


def _key(tensor: tf.Tensor) -> tuple:
  """Memo key: an op's outputs share their axes, except IdentityN's (output i is input i) and control flow's."""
  op = tensor.op
  if op.type in _PER_OUTPUT:
    return (id(op.graph), op.name, tensor.value_index)
  return (id(op.graph), op.name)


def _passes_through(output: tf.Tensor, argument: tf.Tensor) -> bool:
  """Whether a loop body's result is its argument, unchanged (through identities)."""
  while output.name != argument.name and output.op.type == "Identity":
    output = output.op.inputs[0]
  return output.name == argument.name


def _parents(tensor: tf.Tensor) -> list[tf.Tensor]:
  """The tensors ``tensor``'s value is computed from.

  ``IdentityN`` (what ``tf.custom_gradient`` wraps a result and its inputs
  in, as the collectives do) passes input i to output i.
  """
  op = tensor.op
  if op.type == "IdentityN":
    return [op.inputs[tensor.value_index]]
  return list(op.inputs)
