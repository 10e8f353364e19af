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
