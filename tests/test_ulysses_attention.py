"""repl.ulysses_attention: a split sequence's attention by two all-to-alls, against one device's (float64 truth).

Tolerance as in test_ring_attention: twice the one-device reorder floor, each
result's root-mean-square distance from the truth.
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from test_ring_attention import assert_padded_attention_equals_one_device
from test_ring_attention import assert_split_attention_equals_one_device

import mesh
import replicator

B, S, H, D, P = 2, 32, 4, 8, 4


@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_each_device_gets_its_rows_of_one_devices_attention_and_gradients(order, causal, padded):
  rng = np.random.default_rng(1)
  values = [rng.normal(size=(B, S, H, D)).astype(np.float32) for _ in range(4)]
  key_mask = None
  if padded:
    key_mask = np.ones((B, S), bool)
    key_mask[0, -7:] = False

  def attend(repl, q, k, v, mask):
    return repl.ulysses_attention(q, k, v, axis="seq", causal=causal, order=order, key_mask=mask)

  assert_split_attention_equals_one_device(attend, values, order, causal, key_mask)


@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_sliding_windows_and_packed_segments(order):
  rng = np.random.default_rng(2)
  values = [rng.normal(size=(B, S, H, D)).astype(np.float32) for _ in range(4)]
  segments = np.array([[0] * 11 + [1] * 13 + [2] * 8, [0] * 20 + [1] * 12])

  def attend(repl, q, k, v, mask, segment_ids):
    return repl.ulysses_attention(q, k, v, axis="seq", causal=True, order=order, window=6,
                                  segment_ids=segment_ids)

  assert_split_attention_equals_one_device(attend, values, order, True, None, window=6, segments=segments)


@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_a_length_the_devices_do_not_divide_is_padded_and_masked(order):
  # 30 tokens over 4 devices, padded to 32 (replicator.pad_sequence), the padding keys masked: the real tokens' are
  # one device's on the 30 tokens (test_ring_attention's case, with 4 heads for the 4 devices).
  def attend(repl, q, k, v, key_mask):
    return repl.ulysses_attention(q, k, v, axis="seq", causal=True, order=order, key_mask=key_mask)

  assert_padded_attention_equals_one_device(attend, order, H)


def test_heads_the_axis_does_not_divide_are_named():
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": 4}, devices=cpus(4)))
  q = tf.zeros([1, 4, 2, 8])
  with pytest.raises(replicator.ArgumentError, match=r"2 heads cannot be split over the 4 devices of \('seq',\).*"
                     r"Fix: use repl.ring_attention"):
    repl.run(lambda: repl.ulysses_attention(q, q, q, axis="seq"))
