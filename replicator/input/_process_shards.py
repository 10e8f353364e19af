"""A dataset of global batches read in shards by a multi-client job's processes, each its own files.

By default every process of a multi-client job reads every global batch and
keeps its replicas' rows: the job's steps see the batches one device would,
at the cost of every process reading (and preprocessing) the whole dataset.
A dataset whose options ask for sharding
(``options.experimental_distribute.auto_shard_policy``, as
``tf.distribute``'s multi-worker strategies read it) is read in shards:

* ``FILE``: each process reads its own share of the dataset's files (file
  ``i`` by the ``i % shards``-th shard), the way
  ``MultiWorkerMirroredStrategy`` shards a file-based pipeline;
* ``HINT``: each ``dataset.shard(tf.data.experimental.SHARD_HINT,
  tf.data.experimental.SHARD_HINT)`` in the pipeline becomes this process's
  shard (for data in memory: shard before the expensive ``map``);
* ``AUTO``, ``DATA``, ``OFF``: every process reads every global batch (the
  default above; ``DATA`` is what it does, with equal numbers).

Each process then takes its share of the global batch size from its own
stream (``dataset.rebatch``), so a step across the job still sees
``global_batch_size`` rows, as many a replica as one device would give it
(only which rows differs: those of the process's files). Processes whose
replicas take the same rows (a model axis across processes) read the same
shard. The shards can end at different steps: the step agrees on the end,
and until every shard has ended, a process whose shard has runs its replicas
on empty batches, as ``tf.distribute`` does.

The rewrite is tf.data's own (``AutoShardDataset``, through ``tf.raw_ops``
and ``tf.data.experimental.to_variant``/``from_variant``; public, checked on
TensorFlow 2.21).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
import tree

import rewrite
from replicator.core import _errors

POLICY = tf.data.experimental.AutoShardPolicy
SHARDED = (POLICY.FILE, POLICY.HINT)

OVERLAPPING = (
    "The dataset's auto_shard_policy={policy} asks each process of the multi-client job to read its own shard, but "
    "the processes' replicas take overlapping, unequal sets of the global batch's parts (by process: {sets}): no "
    "shard of files gives each process exactly its rows. Fix: split the batch so that each process's replicas take "
    "whole parts of their own (batch_axes whose positions do not cross processes unevenly), or leave the policy at "
    "AUTO (every process reads every global batch and keeps its rows)."
)
NO_BATCH_SIZE = (
    "The dataset's auto_shard_policy={policy} asks each process of the multi-client job to read its own shard and "
    "take its share of the global batch, but the dataset's batch size could not be found (tf.data found none: "
    "{why}). Fix: end the pipeline with dataset.batch(global_batch_size) (after any unbatch or map), or leave the "
    "policy at AUTO."
)
UNSHARDABLE = (
    "The dataset's auto_shard_policy={policy} asks each process of the multi-client job to read its own shard, but "
    "tf.data could not shard it: {why}. {fix}"
)
FIX_FILE = ("FILE sharding needs a pipeline that reads files (TFRecordDataset, TextLineDataset, ... from a list of "
            "file names, e.g. tf.data.Dataset.list_files(pattern, shuffle=False).interleave(tf.data.TFRecordDataset)). "
            "Fix: for data in memory, use HINT with dataset.shard(tf.data.experimental.SHARD_HINT, "
            "tf.data.experimental.SHARD_HINT) before the map, or leave the policy at AUTO.")
FIX_HINT = ("HINT sharding needs dataset.shard(tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT) "
            "in the pipeline. Fix: add it where the rows are still unprocessed, or leave the policy at AUTO.")


def policy(dataset: tf.data.Dataset):
  """The dataset's own ``experimental_distribute.auto_shard_policy`` (``AUTO`` unless set)."""
  return dataset.options().experimental_distribute.auto_shard_policy


def by_process(devices: Sequence[str], pipelines: Sequence[int]) -> list[list[int]]:
  """The parts of the global batch each process's replicas take (``pipelines``: every replica's), by process."""
  parts: dict = {}
  for device, pipeline in zip(devices, pipelines):
    parts.setdefault(rewrite.task_of(device), []).append(pipeline)
  return list(parts.values())


def shard_of(pipelines_by_process: Sequence[Sequence[int]], own: Sequence[int], policy_name: str) -> tuple[int, int]:
  """``(shards, index)``: how many shards the processes read, and which one is this process's (``own`` pipelines).

  Processes whose replicas take the same parts of the global batch read one
  shard; the shards are ordered by their first part.

  Examples:
    >>> shard_of([[0, 1], [2, 3]], [2, 3], "FILE")
    (2, 1)
    >>> shard_of([[0], [0]], [0], "FILE")  # the model split across both processes: one shard
    (1, 0)
  """
  sets = sorted({frozenset(p) for p in pipelines_by_process}, key=min)
  for a in sets:
    for b in sets:
      if a is not b and a & b:
        raise _errors.InputMismatchError(OVERLAPPING.format(
            policy=policy_name, sets=[sorted(p) for p in pipelines_by_process]))
  return len(sets), sets.index(frozenset(own))


def rows_of(global_rows: int, parts: int, own: Sequence[int]) -> int:
  """This process's rows of a global batch of ``global_rows`` split into ``parts`` parts (its ``own``).

  As :func:`replicator.input._distributed_dataset.split_sizes` splits: the
  first ``global_rows % parts`` parts take one more row.

  Examples:
    >>> rows_of(10, 4, [0, 1]), rows_of(10, 4, [2, 3])
    (6, 4)
  """
  base, extra = divmod(global_rows, parts)
  return sum(base + (p < extra) for p in set(own))


def global_batch_size(dataset: tf.data.Dataset, name: str) -> int:
  """The rows of the dataset's (full) batches: static in its element spec, or found by tf.data in its pipeline."""
  rows = {s.shape[0] if s.shape.rank else None for s in tree.flatten(dataset.element_spec)}
  if len(rows) == 1 and None not in rows:
    return rows.pop()
  batch = int(tf.raw_ops.ComputeBatchSize(input_dataset=tf.data.experimental.to_variant(dataset)))
  if batch < 1:  # (a map after the batch, say: tf.data cannot tell that it keeps the rows)
    raise _errors.InputMismatchError(NO_BATCH_SIZE.format(policy=name, why="a transformation after the batch it "
                                                                            "cannot see through, such as a map"))
  return batch


def end_agreement(dataset: tf.data.Dataset, agree):
  """``agree`` if the processes' shards of ``dataset`` may end (at different steps), else None (one process, or none
  can end: repeated forever, which its shards hide from ``cardinality``). Every process calls it at the same point."""
  if agree is None:
    return None
  finite = int(dataset.cardinality()) != int(tf.data.INFINITE_CARDINALITY)
  return agree if agree.any(finite, "input may end") else None


def _has_shard_hint(dataset: tf.data.Dataset) -> bool:
  """Whether the pipeline has a ``shard(SHARD_HINT, ...)`` (a ``ShardDataset`` of a constant -1 shards)."""
  serialized = tf.raw_ops.DatasetToGraphV2(input_dataset=tf.data.experimental.to_variant(dataset))
  graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
  consts = {node.name: node for node in graph.node if node.op == "Const"}
  hint = tf.data.experimental.SHARD_HINT
  for node in graph.node:
    if node.op == "ShardDataset" and len(node.input) > 1:
      count = consts.get(node.input[1].split(":")[0])
      if count is not None and list(count.attr["value"].tensor.int64_val) == [hint]:
        return True
  return False


def process_dataset(dataset: tf.data.Dataset, shards: int, index: int, parts: int,
                    own: Sequence[int]) -> tf.data.Dataset:
  """This process's shard of ``dataset`` (sharded by its own policy), in batches of its share of the global batch."""
  chosen = policy(dataset)
  name = POLICY(chosen).name
  if chosen == POLICY.HINT and not _has_shard_hint(dataset):  # else every process would read every row
    raise _errors.InputMismatchError(UNSHARDABLE.format(policy=name, why="the pipeline has no shard hint",
                                                        fix=FIX_HINT))
  batch = global_batch_size(dataset, name)
  static = all(s.shape.rank and s.shape[0] is not None for s in tree.flatten(dataset.element_spec))
  rebatched = dataset.rebatch(rows_of(batch, parts, own), drop_remainder=static)
  flat = tree.flatten(rebatched.element_spec)
  try:
    variant = tf.raw_ops.AutoShardDataset(
        input_dataset=tf.data.experimental.to_variant(rebatched), num_workers=shards, index=index,
        auto_shard_policy=int(chosen), num_replicas=0, output_types=[s.dtype for s in flat],
        output_shapes=[s.shape for s in flat])
  except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
    why = e.message.split(": goo.gle")[0].split("}}")[-1].strip()
    raise _errors.InputMismatchError(UNSHARDABLE.format(
        policy=name, why=why, fix=FIX_FILE if chosen == POLICY.FILE else FIX_HINT)) from None
  return tf.data.experimental.from_variant(variant, rebatched.element_spec).with_options(dataset.options())


GLOBAL_NOT_STATIC = (
    "The dataset's auto_shard_policy={policy} asks each process of the multi-client job to read its own shard; the "
    "global view traces the step at the global batch's static shape, but the dataset's elements are {spec}. Fix: "
    "batch it with drop_remainder=True (each process then drops the rows of its shard left over after its last full "
    "share), or leave the policy at AUTO."
)
GLOBAL_INDIVISIBLE = (
    "The dataset's auto_shard_policy={policy} asks each process of the multi-client job to read its own shard of "
    "rows, but the global batch's {rows} rows do not divide over the {parts} positions of the batch axes: the global "
    "view would give every device the whole batch, which no process reads. Fix: a global batch size divisible by "
    "{parts}, or leave the policy at AUTO."
)
GLOBAL_SCATTERED = (
    "The dataset's auto_shard_policy={policy} asks each process of the multi-client job to read its own shard; in "
    "the global view a process's rows are one block of the global batch, but this process's devices take the "
    "batch's parts {own} (of {parts}), not consecutive ones. Fix: batch axes whose positions within a process are "
    "consecutive (the mesh's process axis first, as MultiWorkerReplicator's (\"worker\", \"device\")), or leave the "
    "policy at AUTO."
)


class PaddedShard:
  """The global view's input in one process of a multi-client job: its shard, at the global batch's shape.

  The global view traces the step at the global batch's static shape and
  gives each device its block of rows. This process reads only its shard, in
  batches of its share; each batch is placed at its block's rows of a
  global-shaped batch (the other rows are zeros that none of its devices
  takes). The shards can end at different steps: ``agree`` (None: no shard
  can end, or one process) tells the step to agree on the end, which ends
  the epoch for every process when the first shard ends (the rows of the
  others' last steps are dropped: the global view's steps are of one shape).
  """

  def __init__(self, dataset: tf.data.Dataset, pipelines_by_process, own: Sequence[int], parts: int, agree):
    name = POLICY(policy(dataset)).name
    if not all(s.shape.rank and s.shape.is_fully_defined() for s in tree.flatten(dataset.element_spec)):
      raise _errors.InputMismatchError(GLOBAL_NOT_STATIC.format(policy=name, spec=dataset.element_spec))
    rows = global_batch_size(dataset, name)
    if rows % parts:
      raise _errors.InputMismatchError(GLOBAL_INDIVISIBLE.format(policy=name, rows=rows, parts=parts))
    mine = sorted(set(own))
    if mine != list(range(mine[0], mine[-1] + 1)):
      raise _errors.InputMismatchError(GLOBAL_SCATTERED.format(policy=name, own=mine, parts=parts))
    shards, index = shard_of(pipelines_by_process, own, name)
    start, size = rows // parts * mine[0], rows // parts * len(mine)

    def pad(*leaves):
      padded = [tf.pad(x, [[start, rows - start - size]] + [[0, 0]] * (x.shape.rank - 1)) for x in leaves]
      for x, leaf in zip(padded, leaves):
        x.set_shape([rows] + leaf.shape[1:].as_list())
      return tuple(padded)

    shard = process_dataset(dataset, shards, index, parts, own)
    structure = shard.element_spec
    self.dataset = shard.map(lambda *e: tree.unflatten_as(structure, list(pad(*tree.flatten(e)))))
    self.agree = end_agreement(dataset, agree)
    self._iterator = None

  @property
  def iterator(self):
    """The iterator of ``repl.run``'s steps over the padded batches (made on first use)."""
    if self._iterator is None:
      self._iterator = iter(self.dataset)
    return self._iterator
