"""How a traced update wrote a variable: a few rows (scatters) or the whole value.

A sparse gradient (``tf.IndexedSlices``) reaches an optimizer either way:
Keras 3's SGD and Adagrad and Sonnet 2's optimizers scatter into the rows it
names, while Keras 3's Adam, AdamW or SGD with momentum decay their slots and
move every row. ``wrap_optimizer``'s sharded update asks which one happened,
by looking at the ops the update added to the step graph, to choose how the
other replicas get the new value (see ``ReplicatedOptimizer``).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

# Ops that write only the rows named by their indices.
_ROW_WRITES = ("ResourceScatter", "ResourceSparseApply")
# Ops that take a variable's handle without writing it.
_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp"})


def writes_rows_only(graph: tf.Graph, ops: Sequence[tf.Operation], variable: tf.Variable) -> bool:
  """Whether ``ops`` write ``variable`` at least once, and only by scatters into rows.

  Any other op that takes the variable's handle (an assignment, a call of a
  nested function, anything unknown) counts as a write of the whole value.

  Args:
    graph: the graph the ops were traced in (it captured the variable's handle).
    ops: the operations an update added.
    variable: an ordinary resource variable (a replica's component).
  """
  handles = [internal for external, internal in graph.captures if external is variable.handle]
  if not handles:
    return False
  handle = handles[0]
  kinds = [op.type for op in ops if any(t is handle for t in op.inputs)]
  writes = [k for k in kinds if k not in _READS]
  return bool(writes) and all(k.startswith(_ROW_WRITES) for k in writes)
