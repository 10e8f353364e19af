"""How a traced step reads and writes a variable: whole values or a few rows.

A sparse gradient (``tf.IndexedSlices``) reaches an optimizer either way:
Keras 3's SGD and Adagrad and Sonnet 2's optimizers scatter into the rows it
names, while Keras 3's Adam, AdamW or SGD with momentum decay their slots and
move every row. And a model reads its table either by rows (``tf.gather`` on
the variable: ``ResourceGather``) or whole (Keras 3's ``Embedding`` converts
the variable to a tensor first: ``ReadVariableOp``). ``wrap_optimizer``'s
sharded update asks both, by looking at the ops that take the variable's
handle in the step graph, to choose how the replicas get the new value (see
``ReplicatedOptimizer.owners``).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

# Ops that write only the rows named by their indices.
_ROW_WRITES = ("ResourceScatter", "ResourceSparseApply")
# Ops that take a variable's handle without writing it; all but the last two read by rows.
_ROW_READS = frozenset({"ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp"})
READS = _ROW_READS | {"ReadVariableOp"}  # every op that only reads through a handle


def _uses(graph: tf.Graph, ops: Sequence[tf.Operation], variable: tf.Variable) -> list[str]:
  """The types of the ops among ``ops`` that take ``variable``'s handle (captured by ``graph``)."""
  handles = [internal for external, internal in graph.captures if external is variable.handle]
  if not handles:
    return []
  handle = handles[0]
  return [op.type for op in ops if any(t is handle for t in op.inputs)]


def writes_rows_only(graph: tf.Graph, ops: Sequence[tf.Operation], variable: tf.Variable) -> bool:
  """Whether ``ops`` write ``variable`` at least once, and only by scatters into rows.

  Any other op that takes the variable's handle (an assignment, a call of a
  nested function, anything unknown) counts as a write of the whole value.

  Args:
    graph: the graph the ops were traced in (it captured the variable's handle).
    ops: the operations to look at (an update's).
    variable: an ordinary resource variable (a replica's component).
  """
  writes = [k for k in _uses(graph, ops, variable) if k not in READS]
  return bool(writes) and all(k.startswith(_ROW_WRITES) for k in writes)


def reads_whole(graph: tf.Graph, ops: Sequence[tf.Operation], variable: tf.Variable) -> bool:
  """Whether any of ``ops`` reads ``variable``'s whole value (``ReadVariableOp``).

  TensorFlow copies a variable's whole buffer for such a read once the
  variable has been written by rows (it keeps the read value from changing
  under later scatters), so a variable read whole and written by rows costs a
  copy per step on every device that scatters into it.
  """
  return "ReadVariableOp" in _uses(graph, ops, variable)


# Ops whose first input is a resource they write (variables; a tf.random.Generator's state).
_WRITE_PREFIXES = ("Assign", "ResourceScatter", "ResourceApply", "ResourceSparseApply", "ResourceStridedSliceAssign",
                   "StatefulStandardNormal", "StatefulUniform", "StatefulTruncatedNormal", "StatefulRandomBinomial",
                   "RngSkip", "RngReadAndSkip")
# Function-calling ops: the position of the first input passed to the function, and its function attributes.
_CALLS = {"If": (1, ("then_branch", "else_branch")), "StatelessIf": (1, ("then_branch", "else_branch")),
          "Case": (1, ("branches",)), "StatelessCase": (1, ("branches",)),
          "While": (0, ("cond", "body")), "StatelessWhile": (0, ("cond", "body")),
          "PartitionedCall": (0, ("f",)), "StatefulPartitionedCall": (0, ("f",))}


def called_functions(op: tf.Operation) -> list[str]:
  """The names of the functions ``op`` runs: a tf.cond's branches, a tf.while_loop's condition and body, a call's."""
  if op.type not in _CALLS:
    return []
  _, attrs = _CALLS[op.type]
  return [name for attr in attrs if attr in op.node_def.attr for name in _functions(op.node_def.attr[attr])]


def first_argument(op: tf.Operation) -> int:
  """The position of ``op``'s first input that is passed to the functions it runs (after a tf.cond's predicate)."""
  return _CALLS[op.type][0]


def _is_write(op_type: str) -> bool:
  return op_type.startswith(_WRITE_PREFIXES)


def _functions(attr) -> list[str]:
  """The function names an op attribute holds (one function, or a list of them)."""
  if attr.HasField("func"):
    return [attr.func.name]
  return [f.name for f in attr.list.func]


def written_placeholders(graph: tf.Graph) -> dict[str, str]:
  """Placeholders of ``graph`` whose resource the graph writes: placeholder name -> the writing op's name.

  Looks into the functions that ``tf.cond``, ``tf.while_loop`` and nested
  function calls run, following each resource through their arguments.
  """
  library = {f.signature.name: f for f in graph.as_graph_def().library.function}
  memo: dict[str, set[int]] = {}

  def written_arguments(name: str) -> set[int]:
    if name in memo:
      return memo[name]
    memo[name] = set()  # recursion guard
    function = library.get(name)
    if function is None:
      return set()
    arguments = {a.name: i for i, a in enumerate(function.signature.input_arg)}
    written = set()
    for node in function.node_def:
      inputs = [i for i in node.input if not i.startswith("^")]
      if _is_write(node.op) and inputs and inputs[0] in arguments:
        written.add(arguments[inputs[0]])
      elif node.op in _CALLS:
        offset, attrs = _CALLS[node.op]
        for attr in attrs:
          for callee in _functions(node.attr[attr]) if attr in node.attr else ():
            for k in written_arguments(callee):
              if offset + k < len(inputs) and inputs[offset + k] in arguments:
                written.add(arguments[inputs[offset + k]])
    memo[name] = written
    return written

  result: dict[str, str] = {}
  for op in graph.get_operations():
    targets = []
    if op.type in _CALLS:
      offset, attrs = _CALLS[op.type]
      for attr in attrs:
        if attr not in op.node_def.attr:
          continue
        for callee in _functions(op.node_def.attr[attr]):
          targets.extend(op.inputs[offset + k] for k in written_arguments(callee) if offset + k < len(op.inputs))
    elif _is_write(op.type) and op.inputs:
      targets.append(op.inputs[0])
    for t in targets:
      if t.dtype == tf.resource and t.op.type == "Placeholder":
        result.setdefault(t.op.name, op.name)
  return result
