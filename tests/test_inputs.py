"""input_fn datasets: uneven lengths use every row (or drop the remainder when asked)."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import replicator

LENGTHS = (10, 11, 12, 13)  # rows per replica: 46 in all


def _input_fn(ctx):
  start = sum(LENGTHS[:ctx.replica_id])
  rows = np.arange(start, start + LENGTHS[ctx.replica_id], dtype=np.float32)
  return tf.data.Dataset.from_tensor_slices(rows[:, None]).batch(2)


def _epoch(repl):
  seen, steps = [], 0
  step = lambda x: x[:, 0]  # noqa: E731
  while True:
    try:
      out = repl.run(step, _input_fn)
    except replicator.EndOfInput:
      return steps, sorted(float(v) for per in out_values(seen) for v in per)
    steps += 1
    seen.append(out)


def out_values(seen):
  return [t.numpy().tolist() for out in seen for t in out]


def test_every_row_of_uneven_datasets_reaches_a_step():
  # Was: 5 steps, 40 of the 46 rows, then EndOfInput without a word.
  steps, rows = _epoch(replicator.Replicator(cpus(4)))
  assert steps == 7  # the longest dataset: 13 rows in batches of 2
  assert rows == list(range(46))  # every row once; replicas that ran out saw empty batches


def test_drop_remainder_ends_the_epoch_with_the_shortest():
  steps, rows = _epoch(replicator.Replicator(cpus(4), drop_remainder=True))
  assert steps == 5 and len(rows) == 40


def test_unbatched_elements_end_with_the_shortest_and_say_so():
  repl = replicator.Replicator(cpus(2))
  lengths = (2, 3)

  def input_fn(ctx):
    return tf.data.Dataset.range(lengths[ctx.replica_id])  # scalars: no rows to leave out

  assert [int(t) for t in repl.run(lambda x: x, input_fn)] == [0, 0]
  repl.run(lambda x: x, input_fn)
  with pytest.raises(replicator.EndOfInput, match=r"the elements left on the longer ones were not used: "
                                                  r"TensorSpec\(shape=\(\), .* Fix: batch the dataset"):
    repl.run(lambda x: x, input_fn)


def _threads_and_rss_mb():
  with open("/proc/self/status") as f:
    status = dict(line.split(":", 1) for line in f if ":" in line)
  return int(status["Threads"]), int(status["VmRSS"].split()[0]) / 1024


def test_new_datasets_and_input_fns_are_released():
  # Was: 150 calls with new datasets grew the process by 815 MB and to 1,809 threads;
  # 100 new datasets were all still alive after gc.collect().
  import gc  # pylint: disable=import-outside-toplevel
  import weakref  # pylint: disable=import-outside-toplevel
  repl = replicator.Replicator(cpus(4))
  step = lambda x: tf.reduce_sum(x)  # noqa: E731
  data = np.ones([8, 2], np.float32)

  def call(i):
    if i % 2:
      dataset = tf.data.Dataset.from_tensors(data)  # global batches, a new dataset each call
      repl.run(step, dataset)
    else:
      repl.run(step, lambda ctx: tf.data.Dataset.from_tensors(data[:2]))  # a new input_fn each call
      dataset = None
    return dataset

  for i in range(20):
    call(i)
  gc.collect()
  threads, rss = _threads_and_rss_mb()
  alive = []
  for i in range(80):  # (the leak was ~5 MB a call: 400 MB here)
    dataset = call(i)
    if dataset is not None and i % 20 == 1:
      alive.append(weakref.ref(dataset))
    del dataset
  gc.collect()
  threads_after, rss_after = _threads_and_rss_mb()
  assert threads_after <= threads + 2, (threads, threads_after)
  assert rss_after - rss < 60, (rss, rss_after)  # MB over 80 calls (was ~5 MB per call)
  assert sum(ref() is not None for ref in alive) <= 1  # the last one may still be the step's source
  assert repl.trace_count == 2  # one step per kind of input, reused by every new dataset and input_fn


def test_new_datasets_are_released_in_the_global_view():
  # Was (issue 26): 300 calls, each with a new dataset not read to its end, kept all 300 with their iterators
  # (+1,200 threads, +60 MB): the Replicator's map from id(dataset) held them.
  import gc  # pylint: disable=import-outside-toplevel
  import weakref  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)), view="global")
  step = lambda x: tf.reduce_sum(x)  # noqa: E731
  data = np.ones([8, 2], np.float32)

  def call():
    dataset = tf.data.Dataset.from_tensors(data).repeat()  # never read to its end
    assert float(repl.run(step, dataset)) == 16.0
    return dataset

  for _ in range(30):
    call()
  gc.collect()
  threads, rss = _threads_and_rss_mb()
  alive = []
  for i in range(300):
    dataset = call()
    if i % 30 == 1:
      alive.append(weakref.ref(dataset))
    del dataset
  gc.collect()
  threads_after, rss_after = _threads_and_rss_mb()
  assert threads_after <= threads + 2, (threads, threads_after)
  assert rss_after - rss < 50, (rss, rss_after)  # MB over 300 calls
  assert sum(ref() is not None for ref in alive) == 0
  assert repl.trace_count == 1  # one step, reused by every new dataset
  # A dataset kept by the caller still continues where it was: the next call takes its next batch.
  counting = tf.data.Dataset.range(3).map(lambda i: tf.fill([4, 2], tf.cast(i, tf.float32)))
  assert [float(repl.run(step, counting)) for _ in range(3)] == [0.0, 8.0, 16.0]
