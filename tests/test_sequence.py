"""Which tokens each device holds (replicator.sequence_positions, shard_sequence, unshard_sequence)."""

import numpy as np
import pytest

import replicator


def test_contiguous_and_zigzag_positions():
  assert replicator.sequence_positions(8, 1, 4).tolist() == [2, 3]
  assert [replicator.sequence_positions(16, i, 4, "zigzag").tolist()[::2] for i in range(4)] == [
      [0, 14], [2, 12], [4, 10], [6, 8]]  # chunks i and 7 - i of 8, two tokens each
  every = np.concatenate([replicator.sequence_positions(24, i, 3, "zigzag") for i in range(3)])
  assert sorted(every.tolist()) == list(range(24))


def test_shard_and_unshard_are_inverse():
  x = np.arange(2 * 12 * 3).reshape(2, 12, 3)
  for order in ("contiguous", "zigzag"):
    pieces = [replicator.shard_sequence(x, i, 3, order=order) for i in range(3)]
    assert pieces[0].shape == (2, 4, 3)
    np.testing.assert_array_equal(replicator.unshard_sequence(pieces, order=order), x)


def test_a_length_the_chunks_do_not_divide_is_named():
  with pytest.raises(replicator.ArgumentError, match=r"A sequence of 10 tokens cannot be split into 8 equal chunks "
                     r"\(4 devices, order='zigzag'\)\. Fix: pad the sequence to a multiple of 8 tokens"):
    replicator.sequence_positions(10, 0, 4, "zigzag")
  with pytest.raises(replicator.ArgumentError, match=r"order='striped': expected one of"):
    replicator.sequence_positions(8, 0, 4, "striped")
