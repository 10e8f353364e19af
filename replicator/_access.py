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
_READS = _ROW_READS | {"ReadVariableOp"}


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
  writes = [k for k in _uses(graph, ops, variable) if k not in _READS]
  return bool(writes) and all(k.startswith(_ROW_WRITES) for k in writes)


def reads_whole(graph: tf.Graph, ops: Sequence[tf.Operation], variable: tf.Variable) -> bool:
  """Whether any of ``ops`` reads ``variable``'s whole value (``ReadVariableOp``).

  TensorFlow copies a variable's whole buffer for such a read once the
  variable has been written by rows (it keeps the read value from changing
  under later scatters), so a variable read whole and written by rows costs a
  copy per step on every device that scatters into it.
  """
  return "ReadVariableOp" in _uses(graph, ops, variable)
