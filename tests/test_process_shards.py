"""A dataset of global batches read in shards by a multi-client job's processes (in one process: each shard).

Each shard is made as the process that reads it makes it (``process_dataset``,
``PaddedShard``); that the processes of a real job read their own files and
agree on the end is tests/test_multi_client.py's.
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import replicator
from replicator.input import _distributed_dataset
from replicator.input import _process_shards

POLICY = tf.data.experimental.AutoShardPolicy
FILE_ROWS = (6, 6, 8, 4)  # files 0 and 2: 14 rows; files 1 and 3: 10


def with_policy(dataset, policy):
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = policy
  return dataset.with_options(options)


@pytest.fixture(name="files", scope="module")
def _files(tmp_path_factory):
  """TFRecord files of FILE_ROWS rows; row i holds i."""
  directory = tmp_path_factory.mktemp("shards")
  names, start = [], 0
  for f, rows in enumerate(FILE_ROWS):
    names.append(str(directory / f"rows_{f}.tfrecord"))
    with tf.io.TFRecordWriter(names[-1]) as writer:
      for i in range(start, start + rows):
        writer.write(tf.io.serialize_tensor(tf.constant(i, tf.int64)).numpy())
    start += rows
  return names


def rows_dataset(files, batch, policy=POLICY.FILE, drop_remainder=False):
  rows = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset, cycle_length=1)
  rows = rows.map(lambda s: tf.ensure_shape(tf.io.parse_tensor(s, tf.int64), []))
  return with_policy(rows.batch(batch, drop_remainder=drop_remainder), policy)


def batches(dataset):
  return [b.numpy().tolist() for b in dataset]


def test_the_parts_each_process_takes_are_grouped_by_its_task():
  devices = [f"/job:worker/replica:0/task:{t}/device:CPU:{d}" for t in range(2) for d in range(2)]
  assert _process_shards.by_process(devices, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
  assert _process_shards.by_process(devices, [0, 0, 1, 1]) == [[0, 0], [1, 1]]  # Megatron within a worker
  assert _process_shards.by_process(devices, [0, 1, 0, 1]) == [[0, 1], [0, 1]]  # Megatron across workers


def test_processes_taking_the_same_parts_read_one_shard():
  assert _process_shards.shard_of([[0, 1], [2, 3]], [0, 1], "FILE") == (2, 0)
  assert _process_shards.shard_of([[2, 3], [0, 1]], [0, 1], "FILE") == (2, 0)  # ordered by their parts
  assert _process_shards.shard_of([[0, 1], [0, 1], [2, 3], [2, 3]], [2, 3], "FILE") == (2, 1)
  assert _process_shards.shard_of([[0], [0]], [0], "FILE") == (1, 0)
  with pytest.raises(replicator.InputMismatchError, match=r"overlapping, unequal sets of the global batch's parts "
                                                          r"\(by process: \[\[0, 1\], \[1, 2\]\]\)"):
    _process_shards.shard_of([[0, 1], [1, 2]], [0, 1], "FILE")


@pytest.mark.parametrize("rows, parts, own, expected", [(16, 4, [0, 1], 8), (10, 4, [0, 1], 6), (10, 4, [2, 3], 4),
                                                         (10, 4, [1, 1], 3), (7, 2, [1], 3)])
def test_a_process_takes_its_parts_rows_of_the_global_batch(rows, parts, own, expected):
  assert _process_shards.rows_of(rows, parts, own) == expected
  # As the global batch is split over the parts (one device's split).
  sizes = _distributed_dataset.split_sizes(tf.constant(rows), parts).numpy()
  assert sum(sizes[p] for p in set(own)) == expected


def test_each_shard_reads_its_own_files_in_batches_of_its_share(files):
  dataset = rows_dataset(files, 8)
  shards = [batches(_process_shards.process_dataset(dataset, 2, i, parts=4, own=[2 * i, 2 * i + 1]))
            for i in range(2)]
  # Shard 0: files 0 and 2 (rows 0-5, 12-19); shard 1: files 1 and 3 (rows 6-11, 20-23); 4 rows a step each.
  assert shards[0] == [[0, 1, 2, 3], [4, 5, 12, 13], [14, 15, 16, 17], [18, 19]]
  assert shards[1] == [[6, 7, 8, 9], [10, 11, 20, 21], [22, 23]]
  # Statically batched: batches of a static share (the shard's rows left over after its last full batch dropped).
  static = _process_shards.process_dataset(rows_dataset(files, 8, drop_remainder=True), 2, 1, parts=2, own=[1])
  assert static.element_spec.shape.as_list() == [4]
  assert batches(static) == [[6, 7, 8, 9], [10, 11, 20, 21]]  # the batch of 8 from shard 1: [22, 23] dropped


def test_a_shard_hint_in_the_pipeline_becomes_the_process_shard():
  data = tf.data.Dataset.range(12).shard(tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT)
  dataset = with_policy(data.map(lambda i: i * 10).batch(4), POLICY.HINT)
  assert batches(_process_shards.process_dataset(dataset, 2, 1, parts=2, own=[1])) == [[10, 30], [50, 70],
                                                                                      [90, 110]]
  # 4 rows over 3 parts: the first takes 2.
  assert batches(_process_shards.process_dataset(dataset, 3, 0, parts=3, own=[0])) == [[0, 30], [60, 90]]


def test_what_cannot_be_sharded_says_why_and_what_to_do(files):
  in_memory = tf.data.Dataset.range(12).batch(4)
  with pytest.raises(replicator.InputMismatchError) as e:
    _process_shards.process_dataset(with_policy(in_memory, POLICY.FILE), 2, 0, parts=2, own=[0])
  assert str(e.value).startswith("The dataset's auto_shard_policy=FILE asks each process of the multi-client job to "
                                 "read its own shard, but tf.data could not shard it: Found an unshardable source "
                                 "dataset")
  assert "Fix: for data in memory, use HINT with dataset.shard(tf.data.experimental.SHARD_HINT" in str(e.value)
  # HINT without a hint: every process would read every row (and give each step its copies).
  with pytest.raises(replicator.InputMismatchError, match=r"could not shard it: the pipeline has no shard hint\. "
                                                          r"HINT sharding needs dataset\.shard\("):
    _process_shards.process_dataset(with_policy(in_memory, POLICY.HINT), 2, 0, parts=2, own=[0])
  # A map after the batch hides the batch size from tf.data.
  after = with_policy(rows_dataset(files, 8).map(lambda x: x * 2), POLICY.FILE)
  with pytest.raises(replicator.InputMismatchError, match=r"the dataset's batch size could not be found .* such as a "
                                                          r"map\)\. Fix: end the pipeline with dataset\.batch"):
    _process_shards.process_dataset(after, 2, 0, parts=2, own=[0])


def test_the_global_view_shard_sits_at_its_block_of_the_global_batch(files):
  dataset = rows_dataset(files, 8, drop_remainder=True)
  shard = _process_shards.PaddedShard(dataset, [[0, 1], [2, 3]], [2, 3], parts=4, agree=None)
  assert shard.dataset.element_spec.shape.as_list() == [8]
  assert batches(shard.dataset) == [[0, 0, 0, 0, 6, 7, 8, 9], [0, 0, 0, 0, 10, 11, 20, 21]]
  first = _process_shards.PaddedShard(dataset, [[0, 1], [2, 3]], [0, 1], parts=4, agree=None)
  assert batches(first.dataset)[0] == [0, 1, 2, 3, 0, 0, 0, 0]
  assert next(first.iterator).numpy().tolist() == [0, 1, 2, 3, 0, 0, 0, 0]


def test_the_global_view_shard_needs_static_consecutive_divisible_parts(files):
  with pytest.raises(replicator.InputMismatchError, match=r"traces the step at the global batch's static shape, but "
                                                          r"the dataset's elements are .*Fix: batch it with "
                                                          r"drop_remainder=True"):
    _process_shards.PaddedShard(rows_dataset(files, 8), [[0, 1], [2, 3]], [0, 1], parts=4, agree=None)
  with pytest.raises(replicator.InputMismatchError, match=r"the global batch's 6 rows do not divide over the 4 "
                                                          r"positions of the batch axes"):
    _process_shards.PaddedShard(rows_dataset(files, 6, drop_remainder=True), [[0, 1], [2, 3]], [0, 1], parts=4,
                                agree=None)
  with pytest.raises(replicator.InputMismatchError, match=r"this process's devices take the batch's parts \[0, 2\] "
                                                          r"\(of 4\), not consecutive ones"):
    _process_shards.PaddedShard(rows_dataset(files, 8, drop_remainder=True), [[0, 2], [1, 3]], [0, 2], parts=4,
                                agree=None)


def test_a_distributed_dataset_of_one_shard_splits_its_rows_over_the_process_replicas(files):
  """The second process of 2 x 2 (parts 2 and 3 of 4): its shard's batches of 4 rows, 2 a replica."""
  distributed = _distributed_dataset.DistributedDataset(rows_dataset(files, 8), [2, 3], "/device:CPU:0",
                                                        num_pipelines=4, shard=(2, 1))
  assert (distributed.num_parts, distributed.parts) == (2, (0, 1))
  found = [[v.numpy().tolist() for v in per_replica.values] for per_replica in distributed]
  assert found == [[[6, 7], [8, 9]], [[10, 11], [20, 21]], [[22], [23]]]
  assert distributed.agree is None  # (one process: no agreement)


def test_one_process_reads_every_batch_whatever_the_policy(files):
  """Sharding is for the processes of a multi-client job: one process's Replicator reads the dataset whole."""
  repl = replicator.Replicator(cpus(2))
  distributed = repl.distribute_dataset(rows_dataset(files, 8))
  assert distributed.shard is None
  seen = [np.concatenate([v.numpy() for v in per_replica.values]).tolist() for per_replica in distributed]
  assert sum(seen, []) == list(range(sum(FILE_ROWS)))
