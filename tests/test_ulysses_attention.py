"""repl.ulysses_attention: a split sequence's attention by two all-to-alls, against one device's (float64 truth).

Tolerance as in test_ring_attention: twice the one-device float32 floor.
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from test_ring_attention import _one_device

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
  truth = _one_device(values, causal, key_mask, np.float64)
  floor = [np.max(np.abs(a - b)) for a, b in zip(_one_device(values, causal, key_mask, np.float32), truth)]
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": P}, devices=cpus(P)))

  def step():
    index = int(tf.get_static_value(repl.axis_index("seq")))
    q, k, v, w = (replicator.shard_sequence(x, index, P, order=order) for x in values)
    mask = None if key_mask is None else replicator.shard_sequence(key_mask, index, P, order=order)
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      out = repl.ulysses_attention(q, k, v, axis="seq", causal=causal, order=order, key_mask=mask)
      loss = tf.reduce_sum(out * w)
    return [out, *tape.gradient(loss, [q, k, v])]

  for which, (per_device, expected, noise) in enumerate(zip(repl.run(step), truth, floor)):
    whole = replicator.unshard_sequence([t.numpy() for t in per_device], order=order).numpy()
    assert np.max(np.abs(whole - expected)) <= 2 * noise + 1e-6, (which, np.max(np.abs(whole - expected)), noise)


def test_heads_the_axis_does_not_divide_are_named():
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": 4}, devices=cpus(4)))
  q = tf.zeros([1, 4, 2, 8])
  with pytest.raises(replicator.ArgumentError, match=r"2 heads cannot be split over the 4 devices of \('seq',\).*"
                     r"Fix: use repl.ring_attention"):
    repl.run(lambda: repl.ulysses_attention(q, q, q, axis="seq"))
