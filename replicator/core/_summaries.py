"""``tf.summary`` inside a step: one series per summary, as on one device.

Each replica is traced under the name scope ``replica_<r>/`` and
``tf.summary`` prefixes a summary's tag with the current name scope, so a
step's ``tf.summary.scalar("loss", ...)`` would write ``replica_0/loss``.
Only replica 0 records (the ``tf.distribute`` replica context entered while
each replica is traced gates summaries on replica 0, as MirroredStrategy
does); this pass strips the replica scope from the tags of the step graph's
summary writes, so the series is ``loss``: the name it has on one device.

To record a reduced value, reduce it first
(``tf.summary.scalar("loss", repl.all_reduce(loss, "mean"))``); to record
every replica's, gather it first (``repl.all_gather(loss[None])``, then one
scalar per entry).
"""

from __future__ import annotations

import re

import tensorflow as tf

# Summary-writing ops and the index of their tag input (TF 2.21 summary_ops.cc).
_TAG_INPUT = {
    "WriteSummary": 3,
    "WriteScalarSummary": 2,
    "WriteHistogramSummary": 2,
    "WriteImageSummary": 2,
    "WriteAudioSummary": 2,
}
_REPLICA_PREFIX = re.compile(rb"^replica_\d+/")


def _strip(nodes) -> None:
  by_name = {node.name: node for node in nodes}
  for node in nodes:
    index = _TAG_INPUT.get(node.op)
    if index is None or index >= len(node.input):
      continue
    source = by_name.get(node.input[index].lstrip("^").split(":")[0])
    if source is None or source.op != "Const" or source.attr["dtype"].type != tf.string.as_datatype_enum:
      continue
    values = source.attr["value"].tensor.string_val
    for i, value in enumerate(values):
      values[i] = _REPLICA_PREFIX.sub(b"", value)


def single_series(graph_def):
  """``graph_def`` with the replica scope removed from its summary tags (in place)."""
  _strip(graph_def.node)
  for function in graph_def.library.function:
    _strip(function.node_def)
  return graph_def
