"""``GatherV2`` at constant indices along a split dimension in the global view: rows moved point to point.

A reorder of the rows of a dimension split over mesh axes (as many rows out
as in, each from a known row) keeps the split: each device's rows that stay
are its own, the others arrive by ``permute``s (a round per partial
permutation of the devices), never by a gather of the dimension.
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator
from rewrite.rules import _gather

ROWS, TILE = 16, 4  # 16 rows over 4 devices

CASES = {
    # The zigzag order of 8 chunks of 2 rows: device p holds chunks p and 7 - p (ring attention's balanced order).
    "zigzag": np.concatenate([np.arange(2 * c, 2 * c + 2) for p in range(4) for c in (p, 7 - p)]),
    "reversed": np.arange(ROWS)[::-1].copy(),
    "rotated_by_two_rows": np.roll(np.arange(ROWS), 2),
    "the_first_row_everywhere": np.zeros(ROWS, np.int64),
}


def _moved_rows(indices):
  """Rows that arrive from another device: the output row's device is not its input row's."""
  return sum(i // TILE != j // TILE for i, j in enumerate(indices))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_constant_reorder_along_a_split_dimension_is_numpys_and_moves_only_the_rows_that_leave(name):
  indices = CASES[name]
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": 4}, devices=cpus(4)), view="global",
                               batch_axes=(), input_layouts=(None, "seq", None), strict=True)
  x = np.random.default_rng(0).normal(size=(2, ROWS, 3)).astype(np.float32)
  data = tf.data.Dataset.from_tensors(x)

  def step(x):
    return tf.gather(x * 2.0, tf.constant(indices), axis=1)

  np.testing.assert_array_equal(repl.run(step, data).numpy(), np.take(x * 2.0, indices, axis=1))
  rows = repl.explain(step, data).collective_rows
  assert not [c for c in rows if c.kind in ("all_gather", "all_reduce") and "to return it" not in (c.why or "")], rows
  permutes = [c for c in rows if c.kind == "permute"]
  assert all(c.axes == ("seq",) and "GatherV2 of constant rows along dim 1" in c.why for c in permutes), permutes
  # Each round a partial permutation: its bytes a device's one message; summed over the messages, the rows moved.
  _, rounds = _gather.moves(indices, ROWS, 4)
  assert [c.bytes_per_device for c in permutes] == [count * 2 * 3 * 4 for count, _ in rounds]
  assert sum(count * len(sent) for count, sent in rounds) == _moved_rows(indices)


def test_the_zigzag_reorder_is_two_rounds_of_a_chunk():
  # Device 3 sends chunk 7 to device 0 and chunk 6 to device 1, device 1 chunk 2 to device 2 and chunk 3 to device 3,
  # device 0 chunk 1 to device 1, device 2 chunk 4 to device 3: a ring and a swap.
  own, rounds = _gather.moves(CASES["zigzag"], ROWS, 4)
  assert [(count, sorted(sent)) for count, sent in rounds] == [(2, [(0, 1), (1, 2), (2, 3), (3, 0)]),
                                                               (2, [(1, 3), (3, 1)])]
  assert [len(o) for o in own] == [2, 0, 2, 0]
