"""Every rule family of the global view, forward and gradient, against the same graph on one device.

Each case is a small function of a batch-split input ``x`` and a variable ``w``
under a layout; ``repl.run`` in the global view (2x2 mesh) returns the loss and
the gradients with respect to ``w`` and ``x``, which must equal TensorFlow's
on one device. No case may fall back (warnings are errors in the tests).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import loss_and_grads

import mesh
import replicator
from rewrite.rules import _base

M = ("model",)


def _case(x_shape, w_shape, layout, fn):
  return (x_shape, w_shape, layout, fn)


def _sixteenths(x, w):
  """``x @ w`` rounded to a multiple of 1/16 (exact in float32, whatever order the kernel summed in)."""
  return tf.round(tf.matmul(x, w) * 16) / 16


def _cond(pred, m, then_fn, else_fn):
  """A tf.cond of elementwise branches on a split value (their gradient is a tf.cond too)."""
  return tf.cond(pred, lambda: then_fn(m), lambda: else_fn(m))


CASES = {
    # contractions
    "matmul_columns": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.matmul(x, w)),
    "matmul_rows": _case([8, 6], [6, 4], ("model", None), lambda x, w: tf.matmul(x, w)),
    "matmul_transposed": _case([8, 6], [4, 6], ("model", None), lambda x, w: tf.matmul(x, w, transpose_b=True)),
    "batch_matmul_broadcast": _case([8, 3, 6], [6, 4], (None, "model"), lambda x, w: tf.matmul(x, w)),
    "batch_matmul_both": _case([8, 3, 6], [6, 4], ("model", None),
                               lambda x, w: tf.matmul(tf.matmul(x, w), tf.matmul(x, w), transpose_b=True)),
    "einsum_heads": _case([8, 3, 6], [6, 2, 4], (None, "model", None), lambda x, w: tf.einsum("btd,dhe->bthe", x, w)),
    "einsum_heads_back": _case([8, 3, 6], [6, 2, 4], (None, "model", None),
                               lambda x, w: tf.einsum("bthe,dhe->btd", tf.einsum("btd,dhe->bthe", x, w), w)),
    "einsum_ellipsis": _case([8, 3, 6], [6, 4], (None, "model"), lambda x, w: tf.einsum("...d,de->...e", x, w)),
    # elementwise
    "gelu_erf": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.nn.gelu(tf.matmul(x, w), approximate=False)),
    "unary_mix": _case([8, 6], [6, 4], (None, "model"),
                       lambda x, w: tf.nn.softplus(tf.matmul(x, w)) * tf.tanh(tf.matmul(x, w)) + tf.sigmoid(x[:, :4])),
    "select_clip": _case([8, 6], [6, 4], (None, "model"),
                         lambda x, w: tf.where(tf.matmul(x, w) > 0, tf.clip_by_value(tf.matmul(x, w), -0.5, 0.5),
                                               tf.maximum(tf.matmul(x, w), -1.0))),
    # blocks of partial sums joined (the keys' gradient of blockwise attention): summed once; blocks summed over
    # different axes (the batch's, the kernel's columns'): each all-reduced over its own, then joined
    "concat_of_partial_sums": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.matmul(tf.concat(
        [tf.matmul(x[:, :3], x, transpose_a=True), tf.matmul(x[:, 3:], x, transpose_a=True)], 0), w)),
    "concat_of_mixed_partial_sums": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.concat(
        [tf.matmul(x, x, transpose_a=True), tf.matmul(w, w, transpose_b=True)], 1)),
    "add_n": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.add_n([tf.matmul(x, w)] * 3)),
    # reductions
    "sparse_cross_entropy_split_classes": _case(  # vocabulary-parallel: the loss and its backprop on pieces
        [8, 6], [6, 4], (None, "model"),
        lambda x, w: tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.cast(tf.abs(x[:, 0]) * 3, tf.int32) % 4, tf.matmul(x, w))),
    "dense_cross_entropy_split_classes": _case(
        [8, 6], [6, 4], (None, "model"),
        lambda x, w: tf.nn.softmax_cross_entropy_with_logits(tf.nn.softmax(x[:, :4] * 3.0), tf.matmul(x, w))),
    "softmax_split_classes": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.nn.softmax(tf.matmul(x, w))),
    "log_softmax": _case([8, 3, 6], [6, 2, 4], (None, "model", None),
                         lambda x, w: tf.nn.log_softmax(tf.einsum("btd,dhe->bhte", x, w))),
    "max_over_split": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.reduce_max(tf.matmul(x, w), axis=1)),
    "mean_and_moments": _case([8, 6], [6, 4], (None, "model"),
                              lambda x, w: tf.nn.batch_normalization(tf.matmul(x, w),
                                                                     *tf.nn.moments(tf.matmul(x, w), [1], keepdims=True),
                                                                     None, None, 1e-3)),
    "argmax": _case([8, 6], [6, 4], (None, "model"),
                    lambda x, w: tf.cast(tf.argmax(tf.matmul(x, w), axis=1), tf.float32)[:, None] * tf.matmul(x, w)),
    "all_any_over_split": _case([8, 6], [6, 4], (None, "model"),  # pieces disagree: a bool all-reduce
                                lambda x, w: tf.where(tf.reduce_all(tf.matmul(x, w) > -1.0, axis=1, keepdims=True)
                                                      | tf.reduce_any(tf.matmul(x, w) > 2.5, axis=1, keepdims=True),
                                                      tf.matmul(x, w), -tf.matmul(x, w))),
    # control flow: branches on each device's pieces, forward and gradient
    "cond_on_pieces": _case([8, 6], [6, 4], (None, "model"),
                            lambda x, w: _cond(tf.reduce_sum(x) > 0.0, tf.matmul(x, w),
                                               lambda m: tf.nn.relu(m) * 2.0, tf.tanh)),
    "cond_on_pieces_else": _case([8, 6], [6, 4], (None, "model"),
                                 lambda x, w: _cond(tf.reduce_sum(x) > 1e9, tf.matmul(x, w), tf.nn.relu,
                                                    lambda m: tf.tanh(m) * m)),
    # shape changes
    "reshape_split_dim": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.reshape(tf.matmul(x, w), [8, 2, 2])),
    "reshape_merge_batch": _case([8, 3, 6], [6, 4], (None, "model"),
                                 lambda x, w: tf.reshape(tf.matmul(x, w), [24, 4]) * tf.range(24.0)[:, None]),
    "reshape_across_split": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.reshape(tf.matmul(x, w), [16, 2])),
    "transpose": _case([8, 3, 6], [6, 2, 4], (None, "model", None),
                       lambda x, w: tf.transpose(tf.einsum("btd,dhe->bthe", x, w), [2, 0, 3, 1])),
    "concat_split_axis": _case([8, 6], [6, 4], (None, "model"),
                               lambda x, w: tf.concat([tf.matmul(x, w), x], axis=1)),
    "concat_other_axis": _case([8, 6], [6, 4], (None, "model"),
                               lambda x, w: tf.concat([tf.matmul(x, w), 2.0 * tf.matmul(x, w)], axis=0)),
    "stack_unstack_split": _case([8, 6], [6, 4], (None, "model"),
                                 lambda x, w: tf.stack(tf.unstack(tf.matmul(x, w), axis=1)[::-1], axis=0)),
    "split": _case([8, 6], [6, 4], (None, "model"),
                   lambda x, w: tf.split(tf.matmul(x, w), 2, axis=1)[1][:3] * tf.split(tf.matmul(x, w), [3, 5], axis=0)[0][:, 2:]),
    "slice_and_strided": _case([8, 6], [6, 4], (None, "model"),
                               lambda x, w: tf.matmul(x, w)[2:6, ::2] + tf.slice(tf.matmul(x, w), [0, 0], [4, -1])[:, 1:3]),
    "strided_keeps_split": _case([8, 3, 6], [6, 4], (None, "model"),
                                 lambda x, w: tf.matmul(x, w)[:, -1, :] + tf.matmul(x, w)[..., 0, tf.newaxis, :][:, 0]),
    "pad": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.pad(tf.matmul(x, w), [[1, 2], [0, 0]])),
    "tile_broadcast_fill": _case([8, 6], [6, 4], (None, "model"),
                                 lambda x, w: tf.tile(tf.matmul(x, w), [2, 1]) + tf.broadcast_to(w[0], [16, 4])
                                 + tf.fill([16, 4], 0.5)),
    # gathers
    "gather_vocabulary_split": _case([8, 6], [10, 4], ("model", None),
                                     lambda x, w: tf.gather(w, tf.cast(tf.abs(x) * 3, tf.int32) % 10)),
    "gather_dim_split": _case([8, 6], [10, 4], (None, "model"),
                              lambda x, w: tf.gather(w, tf.cast(tf.abs(x) * 3, tf.int32) % 10)),
    "gather_read_value": _case([8, 6], [10, 4], ("model", None),
                               lambda x, w: tf.gather(tf.convert_to_tensor(w), tf.cast(tf.abs(x) * 3, tf.int32) % 10)
                               * x[..., None]),
    "gather_columns_over_the_batch_axis": _case(  # the rows wanted split over "batch", which splits the columns
        [8, 6], [10, 4], (None, "batch"),
        lambda x, w: tf.gather(w, tf.cast(tf.abs(x) * 3, tf.int32) % 10) * x[..., None]),
    "gather_axis1": _case([8, 6], [6, 4], (None, "model"), lambda x, w: tf.gather(tf.matmul(x, w), [3, 0, 0], axis=1)),
    "segment_sum": _case([8, 6], [6, 4], (None, "model"),
                         lambda x, w: tf.math.unsorted_segment_sum(tf.matmul(x, w), [0, 1, 0, 2, 2, 1, 0, 0], 3)),
    # segment reductions of batch rows (pooling by graph or by expert): each device's rows' partial segments combined
    "unsorted_segment_max_min_prod": _case(
        [8, 6], [6, 4], (None, "model"),
        lambda x, w: tf.math.unsorted_segment_max(tf.matmul(x, w), (7 - tf.range(8)) % 3, 3)
        + tf.math.unsorted_segment_min(tf.matmul(x, w) * x[:, :1], (7 - tf.range(8)) % 3, 3)
        + tf.math.unsorted_segment_prod(1.0 + 0.1 * tf.tanh(tf.matmul(x, w)), (7 - tf.range(8)) % 3, 3)),
    "sorted_segment_reductions": _case(  # ids sorted; segment 3 has no rows (zero in each, one in the product)
        [8, 6], [6, 4], (None, "model"),
        lambda x, w: tf.math.segment_sum(tf.matmul(x, w), [0, 0, 0, 1, 1, 2, 2, 4])
        + tf.math.segment_mean(tf.matmul(x, w), [0, 0, 0, 1, 1, 2, 2, 4])
        + tf.math.segment_max(tf.matmul(x, w) * x[:, :1], [0, 0, 0, 1, 1, 2, 2, 4])
        + tf.math.segment_min(tf.matmul(x, w), [0, 0, 0, 1, 1, 2, 2, 4])
        + tf.math.segment_prod(1.0 + 0.1 * tf.tanh(tf.matmul(x, w)), [0, 0, 0, 1, 1, 2, 2, 4])),
    "segment_max_of_whole_rows": _case(  # the ids of whole rows: a gathered batch's segments, the columns split
        [8, 6], [6, 4], (None, "model"),
        lambda x, w: tf.math.segment_max(tf.transpose(tf.matmul(x, w)), [0, 1, 1, 3])),
    # random draws: each device draws its piece of the global draw
    "stateless_uniform": _case([8, 6], [6, 4], (None, "model"),
                               lambda x, w: tf.random.stateless_uniform([8, 4], seed=[1, 2]) * tf.matmul(x, w)),
    "stateless_normal_3d": _case([8, 3, 6], [6, 4], (None, "model"),
                                 lambda x, w: tf.random.stateless_normal([8, 3, 4], seed=[3, 4]) * tf.matmul(x, w)),
    # convolutions and pooling (NHWC)
    "conv_output_channels": _case([4, 6, 6, 3], [3, 3, 3, 4], (None, None, None, "model"),
                                  lambda x, w: tf.nn.conv2d(x, w, 1, "SAME")),
    "conv_input_channels": _case([4, 6, 6, 3], [3, 3, 4, 2], (None, None, "model", None),
                                 lambda x, w: tf.nn.conv2d(tf.concat([x, x[..., :1]], -1), w, 2, "VALID")),
    "depthwise_channels": _case([4, 6, 6, 4], [3, 3, 4, 2], (None, None, "model", None),
                                lambda x, w: tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME")),
    "pools": _case([4, 6, 6, 3], [3, 3, 3, 4], (None, None, None, "model"),
                   lambda x, w: tf.nn.max_pool2d(tf.nn.conv2d(x, w, 1, "SAME"), 2, 2, "VALID")
                   + tf.nn.avg_pool2d(tf.nn.conv2d(x, w, 1, "SAME"), 2, 2, "VALID")),
    # a Keras metric's bitcast; [8, 4(, 4)]. Of the product rounded to 1/16: its bits do not depend on the order in
    # which the matmul's kernel summed (a split matmul's last bit differs from one device's on some CPUs).
    "bitcast_bytes_and_back": _case([8, 6], [6, 4], (None, "model"),
                                    lambda x, w: tf.matmul(x, w) * tf.bitcast(tf.bitcast(_sixteenths(x, w), tf.uint8),
                                                                              tf.float32)
                                    + tf.cast(tf.bitcast(_sixteenths(x, w), tf.int32) // 2**20 % 2, tf.float32)),
    "one_hot_of_split_ids": _case([8, 6], [6, 4], (None, "model"),  # the ids split over "batch"
                                  lambda x, w: tf.matmul(x, w) * tf.reduce_sum(
                                      tf.one_hot(tf.cast(tf.abs(x[:, :2]) * 3, tf.int32) % 4, 4), axis=1)),
    # running sums along a whole dimension (Falcon's position ids: a cumsum of the mask along the sequence)
    "cumsum_along_whole_dim": _case([8, 3, 6], [6, 4], (None, "model"),
                                    lambda x, w: tf.cumsum(tf.matmul(x, w), axis=1, reverse=True)
                                    + tf.math.cumprod(tf.tanh(tf.matmul(x, w)), axis=-2, exclusive=True)),
    # the index of a row's best entry along a split dimension (an accuracy metric on vocabulary-parallel logits)
    # running sums along a split dimension: a scan across devices (a capacity counted over the whole batch)
    "cumsum_along_split_dims": _case([8, 6], [6, 4], (None, "model"),
                                     lambda x, w: tf.cumsum(tf.matmul(x, w), axis=0)
                                     + tf.cumsum(tf.matmul(x, w), axis=1, exclusive=True, reverse=True)),
    "cumprod_and_logcumsumexp_along_split_dims": _case(
        [8, 6], [6, 4], (None, "model"),
        lambda x, w: tf.math.cumprod(1.0 + 0.1 * tf.tanh(tf.matmul(x, w)), axis=0, reverse=True)
        + tf.math.cumulative_logsumexp(tf.matmul(x, w), axis=1, reverse=True)),
    "argmax_along_split_dim": _case([8, 6], [6, 4], (None, "model"),
                                    lambda x, w: tf.matmul(x, w) * tf.cast(
                                        tf.argmax(tf.matmul(x, w), axis=1) - tf.argmin(tf.matmul(x, w), axis=-1),
                                        tf.float32)[:, None]),
    # grouped-query attention's repeat of key heads, the heads split over "model" after it (Tile by 1 there)
    "repeat_of_heads": _case([8, 3, 6], [6, 4], ("model", None),
                             lambda x, w: tf.einsum("bthe,hef->bthf", tf.repeat(
                                 tf.reshape(tf.matmul(x, w), [8, 3, 2, 2]), 2, axis=2),
                                 tf.reshape(tf.tile(w, [2, 1]), [4, 2, 6])[:, :, :3])),
    # a router's choice: the top k of rows split over the batch (its gradient scatters into the rows: ScatterNd)
    "top_k_of_batch_rows": _case([8, 6], [6, 4], ("model", None),
                                 lambda x, w: tf.math.top_k(tf.matmul(x, w), k=2).values * tf.cast(
                                     1 + tf.math.top_k(tf.matmul(x, w), k=2).indices, tf.float32)),
    "top_k_along_split_dim": _case([8, 6], [6, 4], (None, "model"),
                                   lambda x, w: tf.math.top_k(tf.matmul(x, w), k=3).values),
    # updates of batch rows scattered into a new tensor at indices from the data (duplicates summed)
    "scatter_nd_of_batch_rows": _case([8, 6], [6, 4], (None, "model"),
                                      lambda x, w: tf.scatter_nd(tf.cast(tf.abs(x[:, :1]) * 3, tf.int32) % 5,
                                                                 tf.matmul(x, w), [5, 4]) * 2.0),
    "scatter_nd_into_rows_wanted_split": _case([8, 6], [6, 4], (None, "model"),
                                               lambda x, w: tf.matmul(x, w) * tf.reshape(tf.scatter_nd(
                                                   tf.reshape(tf.range(8) * 4 + tf.cast(tf.abs(x[:, 0]) * 3, tf.int32) % 4,
                                                              [8, 1]), tf.reduce_sum(x, 1), [32]), [8, 4])),
    # updates of batch rows written into a given tensor (TensorScatter*: a KV cache, a routing table)
    "tensor_scatter_add_sub_of_batch_rows": _case(
        [8, 6], [6, 4], (None, "model"),
        lambda x, w: tf.tensor_scatter_nd_add(w[:5] * 2.0, tf.cast(tf.abs(x[:, :1]) * 3, tf.int32) % 5, tf.matmul(x, w))
        + tf.tensor_scatter_nd_sub(w[1:], (tf.range(8) % 5)[:, None], tf.tanh(tf.matmul(x, w)))),
    "tensor_scatter_max_min_update": _case(
        [8, 6], [6, 4], (None, "model"),
        lambda x, w: tf.tensor_scatter_nd_max(w[:5], (tf.range(8) % 5)[:, None], tf.matmul(x, w))
        + tf.tensor_scatter_nd_min(w[1:], ((7 - tf.range(8)) % 3)[:, None], tf.matmul(x, w))
        + tf.tensor_scatter_nd_update(tf.tile(w, [2, 1]), (tf.range(8) * 5 % 12)[:, None], tf.matmul(x, w))[:5]),
    # masks by position
    "band_part": _case([8, 3, 6], [6, 2, 4], (None, "model", None),
                       lambda x, w: tf.linalg.band_part(tf.einsum("btd,dhe,bsd->bhts", x, w[..., :1] * 0 + 1, x), -1, 0)),
}


def _equal_to_one_device(fn, x, w0, layout, strict=False):
  """Runs ``loss_and_grads(fn)`` in the global view (``w`` laid out by ``layout``) and on one device; asserts equal.

  Returns ``(repl, w, step, dataset)`` (for ``repl.explain``).
  """
  expected = tf.function(lambda x, w: loss_and_grads(fn, x, w))(tf.constant(x), tf.Variable(w0))
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap({r"^w$": layout}), batch_axes=("batch",), view="global",
                               strict=strict)
  with repl.context():
    w = tf.Variable(w0, name="w")
  ds = tf.data.Dataset.from_tensors(x)

  def step(batch):
    return loss_and_grads(fn, batch, w)

  got = repl.run(step, ds)
  for what, a, b in zip(("output", "loss", "d/dw", "d/dx"), got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=what)
  return repl, w, step, ds


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_family_equals_one_device(name):
  x_shape, w_shape, layout, fn = CASES[name]
  rng = np.random.default_rng(7)
  x = rng.normal(size=x_shape).astype("float32")
  w0 = rng.normal(size=w_shape).astype("float32")
  _, w, _, _ = _equal_to_one_device(fn, x, w0, layout)
  assert w.components[0].shape.num_elements() == w0.size // 2  # the layout splits it


def test_the_keras_transformer_step_is_covered():
  for op_type in ("Einsum", "BatchMatMulV2", "Transpose", "Reshape", "StridedSlice", "StridedSliceGrad", "ConcatV2",
                  "Softmax", "GatherV2", "ResourceGather", "UnsortedSegmentSum", "MatrixBandPart", "Erfc", "AddN",
                  "Fill", "Pack", "Mean", "SquaredDifference", "Rsqrt", "RsqrtGrad"):
    assert op_type in _base.covered(), op_type


def test_keras_layer_normalization_over_a_split_feature_dimension():
  # LayerNormalization's moments over a feature dimension split over "model": partial means, all-reduced.
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap({r"w$": (None, "model")}), batch_axes=("batch",),
                               view="global")
  rng = np.random.default_rng(3)
  x, w0 = rng.normal(size=[8, 6]).astype("float32"), rng.normal(size=[6, 4]).astype("float32")
  norm = keras.layers.LayerNormalization()
  expected = norm(x @ w0).numpy()
  with repl.context():
    w = tf.Variable(w0, name="w")
    ours = keras.layers.LayerNormalization()
    ours.build([8, 4])
  out = repl.run(lambda batch: ours(tf.matmul(batch, w)), tf.data.Dataset.from_tensors(x))
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_a_batch_split_random_draw_draws_only_the_local_piece():
  from rewrite import _partition  # pylint: disable=import-outside-toplevel

  def fn(x):
    return tf.random.stateless_uniform([8, 4], seed=[1, 2]) * x

  graph = tf.function(fn, autograph=False).get_concrete_function(tf.TensorSpec([8, 4])).graph
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  part = _partition.propagate(graph, m, {graph.inputs[0].name: (("batch",), ())})
  (draw,) = [d for n, d in part.decisions.items() if graph.get_operation_by_name(n).type == "StatelessRandomUniformV2"]
  assert draw.outputs == [(("batch",), ())] and draw.lower is not None


@pytest.mark.parametrize("draw", [
    lambda: tf.random.uniform([8, 4]),
    lambda: tf.random.normal([8, 4]),
    lambda: tf.cast(tf.random.uniform([8, 4], maxval=10, dtype=tf.int32), tf.float32),
    lambda: tf.nn.dropout(tf.ones([8, 4]), rate=0.5)], ids=["uniform", "normal", "uniform_int", "dropout"])
def test_an_unseeded_stateful_draw_is_one_draw_on_every_device(draw):
  # Each device's copy of an unseeded stateful op seeded itself: the pieces of a split product were multiplied
  # by different numbers than the ones returned (a sum over the pieces was 106.0 instead of 74.6).
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap({r"^w$": (None, "model")}), batch_axes=("batch",),
                               view="global")
  with repl.context():
    w = tf.Variable(np.random.default_rng(3).normal(size=(6, 4)).astype("float32"), name="w")
  x = np.random.default_rng(4).normal(size=(8, 6)).astype("float32")

  def step_fn(batch):
    noise = draw()
    return tf.reduce_sum(tf.matmul(batch, w) * noise, axis=1), noise  # rows: a sum of each device's pieces

  for _ in range(2):  # the second step's numbers are new, and one draw again
    rows, noise = repl.run(step_fn, tf.data.Dataset.from_tensors(x))
    np.testing.assert_allclose(rows.numpy(), np.sum((x @ w.numpy()) * noise.numpy(), axis=1), rtol=1e-5, atol=1e-5)


def test_a_branch_draws_the_same_numbers_in_every_trace_given_one_salt():
  # Processes of a multi-client job trace the step each and agree on its salt; a tf.cond branch's draw took a salt
  # drawn per body (its function's name differs between traces), so the processes drew different numbers there.
  import rewrite  # pylint: disable=import-outside-toplevel
  from rewrite import _expansion  # pylint: disable=import-outside-toplevel
  from rewrite import _partition  # pylint: disable=import-outside-toplevel

  m = mesh.Mesh({"batch": 2}, devices=cpus(2))
  x = np.ones([8, 4], np.float32)

  def fn(x):
    draw = lambda: tf.raw_ops.RandomUniform(shape=[8, 4], dtype=tf.float32, seed=0, seed2=0)  # noqa: E731 (unseeded)
    return tf.cond(tf.reduce_sum(x) > 0.0, lambda: x * draw(), lambda: x)

  def drawn(salt):  # a new trace, propagated with `salt`, expanded for both devices and run
    graph = tf.function(fn, autograph=False).get_concrete_function(tf.TensorSpec([8, 4])).graph
    given = {graph.inputs[0].name: (("batch",), ())}
    part = _partition.propagate(graph, m, given, random_salt=salt)
    with tf.Graph().as_default():
      placeholder = tf.raw_ops.Placeholder(dtype=tf.float32, shape=[8, 4], name="x")
      local = {graph.inputs[0].name: [_expansion.local_piece(placeholder, given[graph.inputs[0].name], m, r)
                                      for r in range(2)]}
      expansion = _expansion.expand(graph, m, part, local, graph.outputs)
    rewritten = rewrite.apply(expansion.graph_def, rewrite.plan(expansion.records, m, lambda c: "one_device"), {})
    run = tf.function(lambda v: tf.graph_util.import_graph_def(
        rewritten.graph_def, input_map={placeholder.name: v},
        return_elements=[rewritten.output_name(name) for name in expansion.outputs[0]]), autograph=False)
    return [out.numpy() for out in run(tf.constant(x))]

  first, again, other = drawn(7), drawn(7), drawn(8)
  np.testing.assert_array_equal(first[0], first[1])  # one draw on both devices
  np.testing.assert_array_equal(first[0], again[0])  # one salt, one draw, whatever the trace
  assert not np.array_equal(first[0], other[0])


def test_vocabulary_parallel_cross_entropy_communicates_rows_not_logits():
  # Class-split logits were gathered ([rows, classes] per device); now the row max, the sum of exponentials
  # and the label's logit are all-reduced over "model": three [rows] vectors.
  rows, classes = 8, 64
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap({r"^w$": (None, "model")}), batch_axes=("batch",),
                               view="global", strict=True)
  with repl.context():
    w = tf.Variable(np.random.default_rng(3).normal(size=(6, classes)).astype("float32"), name="w")
  x = np.random.default_rng(4).normal(size=(rows, 6)).astype("float32")
  labels = np.arange(rows, dtype=np.int32) * 9 % classes  # in both halves of the classes

  def step_fn(batch):
    x, y = batch
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.matmul(x, w)))

  dataset = tf.data.Dataset.from_tensors((x, labels))
  want = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, x @ w.numpy()))
  np.testing.assert_allclose(float(repl.run(step_fn, dataset)), float(want), rtol=1e-6)
  plan = repl.explain(step_fn, dataset)
  model_axis = [(c.kind, c.describe(), c.shape.as_list()) for c in plan.collectives if c.axes == ("model",)]
  assert model_axis == [("all_reduce", "all_reduce(op='max')", [rows // 2]),
                        ("all_reduce", "all_reduce(op='sum')", [rows // 2]),
                        ("all_reduce", "all_reduce(op='sum')", [rows // 2])]
  assert not [c for c in plan.collectives if c.kind == "all_gather"]
  assert "vocabulary-parallel cross-entropy: row max" in str(plan)


FSDP = {  # a weight split over "batch" on another dimension than the data's: rules' operand order gathered the batch
    "contraction_weight_first": ([6, 4], ("batch", None),
                                 lambda x, w: tf.transpose(tf.matmul(w, x, transpose_a=True, transpose_b=True))),
    "lookup_table_split_both": ([10, 4], ("model", "batch"),  # KerasHub's embedding maps; Keras gathers a read
                                lambda x, w: tf.gather(tf.convert_to_tensor(w), tf.cast(tf.abs(x) * 3, tf.int32) % 10)),
}


@pytest.mark.parametrize("name", sorted(FSDP))
def test_a_weight_split_over_the_batch_axis_is_gathered_not_the_batch(name):
  # As fully sharded data parallelism does: the batch stays split, the weight is gathered for its use. Before, a
  # contraction whose first operand was the weight (and a lookup, whose table wins) gathered the batch instead,
  # and every op after it ran on the whole batch (a KerasHub Qwen step on 2x2: 145 collectives, 43 MB a step).
  w_shape, layout, fn = FSDP[name]
  rng = np.random.default_rng(7)
  x = rng.normal(size=[8, 6]).astype("float32")
  repl, _, step, ds = _equal_to_one_device(fn, x, rng.normal(size=w_shape).astype("float32"), layout, strict=True)
  gathered = [c.why for c in repl.explain(step, ds).collective_rows
              if c.kind == "all_gather" and c.axes == ("batch",) and "to return it" not in c.why]
  assert gathered and all("ReadVariableOp" in why for why in gathered), gathered  # the weight's read only


def test_a_table_split_by_rows_over_the_batch_axis_stays_split_and_the_ids_move():
  # A table split by rows over the batch axis (an embedding table larger than a device, as a parameter server
  # splits one over its servers): the ids are gathered (4 bytes a row looked up), each device looks up its own
  # rows, and the rows looked up are reduce-scattered back onto the batch. The table is never gathered (it was:
  # 2 KB here, a whole table a step in general).
  rng = np.random.default_rng(7)
  x = rng.normal(size=[8, 6]).astype("float32")

  def fn(x, w):
    return tf.gather(tf.convert_to_tensor(w), tf.cast(tf.abs(x) * 40, tf.int32) % 256)

  repl, _, step, ds = _equal_to_one_device(fn, x, rng.normal(size=[256, 2]).astype("float32"), ("batch", None),
                                           strict=True)
  rows = repl.explain(step, ds).collective_rows
  assert not [c for c in rows if "ReadVariableOp" in c.why], rows  # the table's read is never gathered
  lookups = [c for c in rows if c.op_type == "GatherV2"]
  assert [(c.kind, c.axes) for c in lookups] == [("all_gather", ("batch",)), ("reduce_scatter", ("batch",))]
  assert lookups[0].dtype == "int32" and lookups[0].shape == (4, 6)  # a device's ids


def test_arg_max_over_a_split_dimension_all_reduces_rows_and_keeps_the_first_of_ties():
  # The input was gathered over "model" ([rows, classes] a device: 4 MB a step of KerasHub Qwen's accuracy
  # metric); now the best value and the first index holding it are all-reduced ([rows] each).
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap({r"^w$": (None, "model")}), batch_axes=("batch",),
                               view="global", strict=True)
  w0 = np.random.default_rng(3).normal(size=(6, 8)).astype("float32")
  w0[:, 4:] = w0[:, :4]  # every row's best entry twice: in device 0's columns and in device 1's
  with repl.context():
    w = tf.Variable(w0, name="w")
  x = np.random.default_rng(4).normal(size=(8, 6)).astype("float32")

  def step_fn(batch):
    logits = tf.matmul(batch, w)
    worst = tf.argmin(logits, axis=1, output_type=tf.int32)  # returned as the all-reduce's result: used by an op
    return tf.argmax(logits, axis=1), worst * 1

  dataset = tf.data.Dataset.from_tensors(x)
  best, worst = repl.run(step_fn, dataset)
  logits = x @ w0
  np.testing.assert_array_equal(best.numpy(), np.argmax(logits, axis=1))  # numpy: the first of ties
  np.testing.assert_array_equal(worst.numpy(), np.argmin(logits, axis=1))
  assert best.dtype == tf.int64 and worst.dtype == tf.int32
  assert np.all(best.numpy() < 4) and np.all(worst.numpy() < 4)
  plan = repl.explain(step_fn, dataset)
  assert not [c for c in plan.collective_rows if c.kind == "all_gather" and "to return it" not in c.why]
  assert "arg max over a split dimension: first index holding it" in str(plan)


def test_partial_sums_a_consumer_takes_split_are_reduce_scattered():
  # A contraction over a split dimension (a row-parallel projection, as KerasHub's maps split the query kernel's
  # input over "model") left partial sums, all-reduced: every device then had the whole result and ran the ops
  # after it (a Qwen step's attention) whole. Where the next contraction takes that result split over the same
  # axis (the output projection's kernel is split there), the partials are reduce-scattered instead; a gradient
  # summed over the batch for a weight split over "batch" is reduce-scattered too.
  rng = np.random.default_rng(5)
  x = rng.normal(size=[8, 3, 6]).astype("float32")

  def fn(x, w):
    return tf.matmul(tf.tanh(tf.matmul(x, w)), w)  # both contract over w's first dimension, split over "model"

  repl, _, step, ds = _equal_to_one_device(fn, x, rng.normal(size=[6, 6]).astype("float32"), ("model", None),
                                           strict=True)
  rows = repl.explain(step, ds).collective_rows
  scattered = [(c.axes, c.shape, c.why) for c in rows if c.kind == "reduce_scatter"]
  assert ((("model",), (4, 3, 6), "partial sum, scattered along dim 2")) in scattered, scattered
  assert not [c for c in rows if c.kind == "all_reduce" and c.axes == ("model",) and c.shape == (4, 3, 6)
              and c.op_name.endswith("MatMul") and "gradient" not in c.op_name]  # the first product's


def test_a_running_sum_over_the_split_batch_is_a_scan_across_devices():
  # Cumsum along a split dimension fell back (the input gathered, the sum run whole on every device). Now each
  # device runs it on its piece and adds the totals of the pieces before its own: one all-gather of [1, 4]
  # totals, strict (no fallback), and the numbers of one device.
  rng = np.random.default_rng(6)
  x = rng.normal(size=[8, 6]).astype("float32")

  def fn(x, w):
    return tf.cumsum(tf.matmul(x, w), axis=0) + tf.cumsum(x[:, :4], axis=0, exclusive=True, reverse=True)

  repl, _, step, ds = _equal_to_one_device(fn, x, rng.normal(size=[6, 4]).astype("float32"), (None, "model"),
                                           strict=True)
  rows = repl.explain(step, ds).collective_rows
  scans = [(c.axes, c.shape) for c in rows if "along a split dimension: the pieces' totals" in c.why]
  assert (("batch",), (1, 2)) in scans and len(scans) >= 3, scans  # the sums forward, and their gradients
  assert not [c for c in rows if c.kind == "all_gather" and c.axes == ("batch",) and c.shape[0] == 4
              and "to return it" not in c.why]  # no piece of the batch gathered


def test_scatters_and_segments_of_batch_rows_combine_pieces_not_rows():
  # TensorScatterAdd, a segment max and an unsorted segment product of rows split over "batch": each device
  # combines its own rows, and only [segments, columns] pieces cross the batch axis (no row is gathered).
  rng = np.random.default_rng(8)
  x = rng.normal(size=[8, 6]).astype("float32")
  ids = (7 - tf.range(8)) % 3

  def fn(x, w):
    rows = tf.matmul(x, w)
    return (tf.tensor_scatter_nd_add(w[:3], ids[:, None], rows) + tf.math.unsorted_segment_prod(1.0 + 0.1 * rows, ids, 3)
            + tf.reduce_sum(tf.math.segment_max(rows, [0, 0, 1, 1, 1, 2, 2, 2])))  # [segments (unknown), 4]

  repl, _, step, ds = _equal_to_one_device(fn, x, rng.normal(size=[6, 4]).astype("float32"), (None, "model"),
                                           strict=True)
  rows = [c for c in repl.explain(step, ds).collective_rows if c.axes == ("batch",)]
  whys = {c.why for c in rows}
  assert {"TensorScatterAdd of split pairs: their sum", "segment product of split rows: the partial products",
          "SegmentMax of split rows: the partial segments"} <= whys, whys
  assert not [c for c in rows if c.kind == "all_gather" and c.shape[0] == 4 and "to return it" not in c.why], rows
