"""A hand-written top-k mixture-of-experts layer (GShard's dispatch) in the global view, against one device.

The layer routes each token to its top 2 of 4 experts, with a capacity of
``CAPACITY`` tokens per expert and group (a group is one row of the batch:
positions come from a running sum of the routing masks along the group's
tokens, and tokens past the capacity are dropped, as on one device). Its
experts' stacked kernels ``[experts, ...]`` are split over the axis the
groups are split over ("batch", expert parallelism on the data axis) or over
"model". Split over "batch", the dispatched tokens are sent to the devices
holding their experts with an ``all_to_all`` and brought back with another,
instead of every device gathering every expert (GShard); the experts' kernels
and their gradients never leave their device.

Tolerance: the same measurement as the KerasHub tests (float32's noise under
Adam is 1e-7 to 1e-6 here); routing is the same on every layout because the
router's logits are computed from the same numbers in the same order.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import mse_step

import mesh
import replicator

EXPERTS, TOP_K, CAPACITY = 4, 2, 3
GROUPS, TOKENS, HIDDEN, FFN = 8, 4, 16, 64


class TopKMoE(keras.layers.Layer):
  """Top-k routing with a capacity per expert and group; expert kernels stacked ``[experts, ...]``."""

  def build(self, input_shape):
    self.router = self.add_weight(name="router", shape=(HIDDEN, EXPERTS))
    self.w_in = self.add_weight(name="experts_in", shape=(EXPERTS, HIDDEN, FFN))
    self.w_out = self.add_weight(name="experts_out", shape=(EXPERTS, FFN, HIDDEN))

  def call(self, x):  # [groups, tokens, hidden]
    probs = tf.nn.softmax(tf.einsum("gsh,he->gse", x, self.router))
    top_p, top_i = tf.math.top_k(probs, k=TOP_K)  # [g, s, k]
    mask = tf.reshape(tf.one_hot(top_i, EXPERTS), [GROUPS, TOKENS * TOP_K, EXPERTS])
    position = tf.cumsum(mask, axis=1) * mask - mask  # each routed token's place in its expert's buffer
    kept = mask * tf.cast(position < CAPACITY, mask.dtype)  # past the capacity: dropped
    dispatch = tf.one_hot(tf.cast(position, tf.int32), CAPACITY) * kept[..., None]  # [g, s*k, e, c]
    dispatch = tf.reshape(dispatch, [GROUPS, TOKENS, TOP_K, EXPERTS, CAPACITY])
    combine = tf.reduce_sum(dispatch * top_p[..., None, None], axis=2)  # [g, s, e, c]
    dispatch = tf.reduce_sum(dispatch, axis=2)
    expert_in = tf.einsum("gsec,gsh->gech", dispatch, x)
    hidden = tf.nn.relu(tf.einsum("gech,ehf->gecf", expert_in, self.w_in))
    expert_out = tf.einsum("gecf,efh->gech", hidden, self.w_out)
    return tf.einsum("gsec,gech->gsh", combine, expert_out)


class BatchCapacityMoE(TopKMoE):
  """The capacity counted over the whole batch (no groups): the running sum runs along the split batch."""

  CAPACITY = 12  # of 16 routed tokens an expert on average: some are dropped

  def call(self, x):
    n = GROUPS * TOKENS
    probs = tf.nn.softmax(tf.einsum("gsh,he->gse", x, self.router))
    top_p, top_i = tf.math.top_k(probs, k=TOP_K)
    mask = tf.reshape(tf.one_hot(top_i, EXPERTS), [n * TOP_K, EXPERTS])
    position = tf.cumsum(mask, axis=0) * mask - mask  # over every token of the batch, in order
    kept = mask * tf.cast(position < self.CAPACITY, mask.dtype)
    dispatch = tf.one_hot(tf.cast(position, tf.int32), self.CAPACITY) * kept[..., None]  # [n*k, e, c]
    dispatch = tf.reshape(dispatch, [n, TOP_K, EXPERTS, self.CAPACITY])
    combine = tf.reduce_sum(dispatch * tf.reshape(top_p, [n, TOP_K])[..., None, None], axis=1)  # [n, e, c]
    expert_in = tf.einsum("nec,nh->ech", tf.reduce_sum(dispatch, axis=1), tf.reshape(x, [n, HIDDEN]))
    hidden = tf.nn.relu(tf.einsum("ech,ehf->ecf", expert_in, self.w_in))
    expert_out = tf.einsum("ecf,efh->ech", hidden, self.w_out)
    return tf.reshape(tf.einsum("nec,ech->nh", combine, expert_out), [GROUPS, TOKENS, HIDDEN])


def _model(layer=TopKMoE):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((TOKENS, HIDDEN), batch_size=GROUPS)
  return keras.Model(inputs, layer(name="moe")(inputs))


def _data(steps=3):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(steps * GROUPS, TOKENS, HIDDEN)).astype(np.float32)
  y = rng.normal(size=(steps * GROUPS, TOKENS, HIDDEN)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(GROUPS, drop_remainder=True)


MESHES = {
    "experts over the batch axis": ({"batch": 4}, "batch"),
    "experts over model, 2x2": ({"batch": 2, "model": 2}, "model"),
    "experts over model, 1x4": ({"batch": 1, "model": 4}, "model"),
}


@pytest.mark.parametrize("case", sorted(MESHES))
def test_a_top_k_mixture_of_experts_trains_as_on_one_device(case):
  axes, experts_axis = MESHES[case]
  one, one_opt = _model(), keras.optimizers.Adam(1e-2)
  one_step = tf.function(mse_step(one, one_opt))
  expected = [float(one_step(batch)) for batch in _data()]
  repl = replicator.Replicator(mesh=mesh.Mesh(axes, devices=cpus(4)), view="global", strict=True,
                               layouts=mesh.LayoutMap({r"experts_": (experts_axis,)}, pad=True))
  with repl.context():
    model, optimizer = _model(), keras.optimizers.Adam(1e-2)
  step, data = mse_step(model, optimizer), _data()
  losses = [float(repl.run(step, data)) for _ in range(3)]
  np.testing.assert_allclose(losses, expected, atol=2e-6)
  assert_every_copy(model.weights, one.weights, atol=2e-6)
  assert_every_copy(optimizer.variables, one_opt.variables, atol=2e-6)
  for w in model.weights:  # the experts' kernels: 1/k of their bytes a device
    if "experts_" in w.path:
      assert max(replicator.bytes_per_device([w]).values()) * axes[experts_axis] == w.numpy().nbytes


def test_experts_split_over_the_batch_axis_receive_their_tokens_by_all_to_all():
  # Every device gathered every expert's kernels (for the forward and the backward pass) and all-reduced their
  # gradients (64 KB and 16 KB kernels). Now the tokens move: all-to-alls of the dispatched tokens (to the experts
  # and back, forward and backward), a few KB each. No kernel is gathered or all-reduced: the first kernel's
  # gradient is computed where the kernel is; the second's is reduce-scattered into its pieces (the backward
  # pass's contraction takes the groups' split first there: a data-data choice, by operand order).
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 4}, devices=cpus(4)), view="global", strict=True,
                               layouts=mesh.LayoutMap({r"experts_": ("batch",)}, pad=True))
  with repl.context():
    model, optimizer = _model(), keras.optimizers.Adam(1e-2)
  report = repl.explain(mse_step(model, optimizer), _data())
  rows = [c for c in report.collective_rows if "to return it" not in c.why]
  kernel_shapes = ((EXPERTS, HIDDEN, FFN), (EXPERTS, FFN, HIDDEN))
  kernels = [(c.kind, c.shape) for c in rows if c.shape in kernel_shapes or (
      c.kind == "all_gather" and c.shape in ((1, HIDDEN, FFN), (1, FFN, HIDDEN)))]
  assert kernels == [("reduce_scatter", (EXPERTS, FFN, HIDDEN))], kernels
  moves = [c for c in rows if c.kind == "all_to_all"]
  assert len(moves) >= 4 and all("move" in c.why for c in moves), [(c.kind, c.shape, c.why) for c in rows]
  kernel_bytes = 2 * EXPERTS * HIDDEN * FFN * 4  # both kernels, whole
  moved = sum(c.bytes_per_device for c in moves)
  print(f"moved {moved} bytes a device a step; gathering the kernels once: {kernel_bytes * 3 // 4}")
  assert moved < kernel_bytes * 3 // 4  # less than one gather of the kernels (each device lacks 3/4 of them)
  assert "all_to_all dim 0 -> 1 over batch" in str(report)


@pytest.mark.parametrize("case", ["experts over the batch axis", "experts over model, 2x2"])
def test_a_capacity_counted_over_the_whole_split_batch_drops_the_tokens_one_device_drops(case):
  # A capacity per expert over the whole batch (no groups): each token's place in its expert's buffer is a running
  # sum of the routing masks along the batch, which is split over devices. The running sum along a split
  # dimension fell back (the masks gathered); it is a scan across devices now, and the same tokens are dropped.
  axes, experts_axis = MESHES[case]
  one, one_opt = _model(BatchCapacityMoE), keras.optimizers.Adam(1e-2)
  x = next(iter(_data()))[0]
  probs = tf.nn.softmax(tf.einsum("gsh,he->gse", x, one.get_layer("moe").router))
  routed = tf.reshape(tf.one_hot(tf.math.top_k(probs, k=TOP_K).indices, EXPERTS), [-1, EXPERTS])
  assert np.max(np.sum(routed.numpy(), axis=0)) > BatchCapacityMoE.CAPACITY  # an expert overflows: tokens dropped
  one_step = tf.function(mse_step(one, one_opt))
  expected = [float(one_step(batch)) for batch in _data()]
  repl = replicator.Replicator(mesh=mesh.Mesh(axes, devices=cpus(4)), view="global", strict=True,
                               layouts=mesh.LayoutMap({r"experts_": (experts_axis,)}, pad=True))
  with repl.context():
    model, optimizer = _model(BatchCapacityMoE), keras.optimizers.Adam(1e-2)
  step, data = mse_step(model, optimizer), _data()
  losses = [float(repl.run(step, data)) for _ in range(3)]
  np.testing.assert_allclose(losses, expected, atol=2e-6)
  assert_every_copy(model.weights, one.weights, atol=2e-6)
  assert_every_copy(optimizer.variables, one_opt.variables, atol=2e-6)
  scans = [c for c in repl.explain(step, data).collective_rows if "Cumsum along a split dimension" in c.why]
  assert scans and all(c.shape[0] == 1 for c in scans)  # one total a device, not the masks
