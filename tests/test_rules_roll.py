"""``tf.roll`` over split dimensions in the global view: whole tiles moved point to point, against one device."""

import numpy as np
import pytest
import tensorflow as tf
from test_partition_rules import _equal_to_one_device

CASES = {
    # (the output [8, 4]: rows split over "batch" in 2 tiles of 4, columns over "model" in 2 of 2)
    "one_tile_of_columns": lambda y: tf.roll(y, 2, axis=1),
    "rows_by_a_tile_and_columns_back": lambda y: tf.roll(y, [4, -2], axis=[0, 1]),
    "three_tiles_is_one": lambda y: tf.roll(y, 6, axis=1),
    "part_of_a_tile": lambda y: tf.roll(y, 1, axis=1),  # gathered, rolled whole
    "repeated_axis": lambda y: tf.roll(y, [1, 3], axis=[0, 0]),
}


def _run(fn, x, w0):
  repl, _, step, ds = _equal_to_one_device(fn, x, w0, (None, "model"), strict=True)
  return repl.explain(step, ds)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_roll_over_split_dimensions_equals_one_device(name):
  rng = np.random.default_rng(3)
  _run(lambda x, w: CASES[name](tf.matmul(x, w)), rng.normal(size=[8, 6]).astype("float32"),
       rng.normal(size=[6, 4]).astype("float32"))


def test_a_roll_by_whole_tiles_sends_each_tile_once_and_gathers_nothing():
  rng = np.random.default_rng(3)
  report = _run(lambda x, w: tf.roll(tf.matmul(x, w), 2, axis=1), rng.normal(size=[8, 6]).astype("float32"),
                rng.normal(size=[6, 4]).astype("float32"))
  rows = report.collective_rows
  assert not [r.why for r in rows if r.kind == "all_gather" and "to return it" not in r.why]
  # The roll and its gradient's (a roll back): each a device's [4, 2] tile of float32, once.
  permutes = [r for r in rows if r.kind == "permute"]
  assert [r.why for r in permutes] == ["Roll by 1 tile along dim 1: each device's tile to the one 1 further"] * 2
  assert all(r.shape == (4, 2) for r in permutes), permutes


def test_a_roll_by_part_of_a_tile_says_why_it_gathers():
  rng = np.random.default_rng(3)
  report = _run(lambda x, w: tf.roll(tf.matmul(x, w), 1, axis=1), rng.normal(size=[8, 6]).astype("float32"),
                rng.normal(size=[6, 4]).astype("float32"))
  assert any("a roll by 1 along dimension 1 of 4 moves part of a tile of 2" in r.why for r in report.collective_rows
             if r.kind == "all_gather"), str(report)
