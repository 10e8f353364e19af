"""The global view with inputs split beyond their batch (``Replicator(input_layouts=)``): a sequence over "seq".

The step is the one-device step; its token batch ``[batch, seq]`` is split over
both axes. A split survives a ``Dense`` layer's reshape of ``[batch, seq, d]``
into rows (a merged dimension, ``rewrite.rules._base.Merged``), attention
gathers keys and values (never the scores), and every result equals one
device. Tolerances: these runs differ from one device by 1e-7 to 6e-7 (the
order of sums of a split contraction); 2e-6 is above that and far below an
error of a step (a piece missing from one device's sum is 1e-3 or more).
"""

import dataclasses
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import keras_step
from test_keras_attention import _mask_layers

import mesh
import replicator
from replicator.views import _global_step

B, S, D, V = 4, 64, 16, 32
ATOL = 2e-6


def _tokens(seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, V, (B, S)).astype(np.int32), rng.integers(0, V, (B, S)).astype(np.int32)


def _transformer(causal=True):
  keras.utils.set_random_seed(1)
  ids = keras.Input((S,), dtype="int32")
  h = keras.layers.Embedding(V, D, name="emb")(ids)
  a = keras.layers.MultiHeadAttention(2, 8, name="mha")(h, h, use_causal_mask=causal)
  h = keras.layers.LayerNormalization(name="ln1")(h + a)
  f = keras.layers.Dense(32, activation="gelu", name="ff1")(h)
  h = keras.layers.LayerNormalization(name="ln2")(h + keras.layers.Dense(D, name="ff2")(f))
  return keras.Model(ids, keras.layers.Dense(V, name="head")(h))



def _sequence_replicator(shape=None, **kwargs):
  shape = shape or {"batch": 2, "seq": 2}
  m = mesh.Mesh(shape, devices=cpus(int(np.prod(list(shape.values())))))
  return replicator.Replicator(mesh=m, view="global", input_layouts=("batch", "seq"), strict=True, **kwargs)


@pytest.mark.parametrize("causal", [True, False])
def test_a_transformer_with_its_sequence_split_trains_as_on_one_device(causal):
  data = tf.data.Dataset.from_tensors(_tokens()).repeat()
  one, one_opt = _transformer(causal), keras.optimizers.Adam(1e-2)
  one_step = tf.function(keras_step(one, one_opt))
  batches = iter(data)
  expected = [float(one_step(next(batches))) for _ in range(3)]
  repl = _sequence_replicator()
  with repl.context():
    model, opt = _transformer(causal), keras.optimizers.Adam(1e-2)
  step = keras_step(model, opt)
  np.testing.assert_allclose([float(repl.run(step, data)) for _ in range(3)], expected, atol=ATOL)
  assert_every_copy(model.weights, one.weights, atol=ATOL)
  assert_every_copy(opt.variables, one_opt.variables, atol=ATOL)

  report = repl.explain(step, data)
  assert [row.layout for row in report.inputs] == [(("batch",), ("seq",))] * 2
  # The tokens stay split through every layer: the only activations gathered are the keys and values.
  gathered = {row.tensor for row in report.relayouts if row.gathered and "adam" not in row.op_name
              and "UnsortedSegmentSum" != row.op_type}
  assert gathered and all("/key" in t or "/value" in t for t in gathered), gathered
  scores = (B // 2) * 2 * (S // 2) * S * 4  # a device's [batch, heads, its queries, keys] in float32
  for row in report.collective_rows:  # no collective of the score matrix's size
    assert row.bytes_per_device < scores, row
  kv = [row for row in report.collective_rows if row.kind == "all_gather" and "seq" in row.axes
        and re.search(r"/(key|value)", row.why)]
  # Keys and values gathered over "seq" (each device sends its [batch/2, seq/2, heads, head size] of each) for
  # Keras's attention, blockwise (integrations._keras_attention), and gathered again for its backward pass (not
  # held from the forward pass); their gradients reduce-scattered, one each.
  assert len(kv) == 4 and all(row.bytes_per_device == (B // 2) * (S // 2) * 2 * 8 * 4 for row in kv), kv
  assert sum(row.op_name.startswith("gradients/") for row in kv) == 2, kv
  scattered = [row for row in report.collective_rows if row.kind == "reduce_scatter" and row.op_type == "ConcatV2"]
  assert len(scattered) == 2 and all(row.axes == ("seq",) and row.shape == (B // 2, S, 2, 8) for row in scattered)
  # A projection's kernel gradient ([batch, in, out] of partial sums over the sequence, then summed over the batch)
  # is one all-reduce over both axes, of the kernel's size (rewrite.rules._base.Pending): none of the batch's.
  assert not [row for row in report.collective_rows if row.op_type in ("BatchMatMulV2", "Einsum")
              and row.kind == "all_reduce"], report
  kernels = [row for row in report.collective_rows if row.op_type == "Sum" and re.search(r"mha.*/MatMul/Sum", row.op_name)]
  assert len(kernels) == 4 and all(row.axes == ("batch", "seq") and row.shape == (D, D) for row in kernels), kernels


def test_attention_saves_a_pth_of_one_devices_bytes_for_the_backward_pass():
  data = tf.data.Dataset.from_tensors(_tokens()).repeat()
  saved = {}
  for shape in ({"batch": 1, "seq": 1}, {"batch": 1, "seq": 4}):
    repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(int(np.prod(list(shape.values()))))),
                                 view="global", input_layouts=("batch", "seq"), strict=True)
    with repl.context():
      model, opt = _transformer(), keras.optimizers.Adam(1e-2)
    report = repl.memory(keras_step(model, opt), data)
    device = report.devices[0].device
    saved[len(report.devices)] = sum(t.bytes or 0 for t in report.saved if t.device == device and "/mha" in t.tensor
                                     and t.kind != "variable read")
  assert saved[4] <= saved[1] / 4 * 1.05, saved


def test_rows_merged_from_a_split_sequence_are_gathered_and_sliced_in_their_order():
  # The rows of [batch, seq, d] with both split are not a block of [batch * seq, d]: a running sum over them (no
  # rule may take them split) gathers them in the global order, and a whole [batch * seq, 1] is sliced to match.
  x = np.random.default_rng(2).standard_normal((B, S, D)).astype(np.float32)
  kernel = np.random.default_rng(3).standard_normal((D, 5)).astype(np.float32)

  def fn(x, w):
    rows = tf.matmul(tf.reshape(x, [B * S, D]), w)
    weighted = rows * tf.reshape(tf.range(B * S, dtype=tf.float32) / (B * S), [B * S, 1])
    return tf.reshape(tf.cumsum(weighted, axis=0), [B, S, 5]) + tf.reshape(rows, [B, S, 5])

  def loss_and_grads(x, w):
    with tf.GradientTape() as tape:
      y = fn(x, w)
      loss = tf.reduce_sum(y * y)
    return y, loss, tape.gradient(loss, w)

  w0 = tf.Variable(kernel)
  expected = tf.function(loss_and_grads)(tf.constant(x), w0)
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "seq": 2}, devices=cpus(4)), view="global",
                               input_layouts=("batch", "seq", None))
  with repl.context():
    w = tf.Variable(kernel)
  got = repl.run(lambda x: loss_and_grads(x, w), tf.data.Dataset.from_tensors(x))
  for a, b in zip(got, expected):  # (rows out of order would differ by their own size)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_input_layouts_by_function_and_by_rank():
  x, y = _tokens()
  picked = []

  def layouts(index, spec):
    picked.append((index, tuple(spec.shape)))
    return ("batch", "seq") if index == 0 else None  # the labels: the batch split alone

  repl = _sequence_replicator()
  repl = replicator.Replicator(mesh=repl.mesh, view="global", input_layouts=layouts)
  with repl.context():
    model, opt = _transformer(), keras.optimizers.Adam(1e-2)
  report = repl.explain(keras_step(model, opt), tf.data.Dataset.from_tensors((x, y)))
  assert picked == [(0, (B, S)), (1, (B, S))]
  assert [row.layout for row in report.inputs] == [(("batch",), ("seq",)), (("batch",), ())]


def test_input_layouts_errors_say_what_to_do():
  m = mesh.Mesh({"batch": 2, "seq": 2}, devices=cpus(4))
  with pytest.raises(replicator.ArgumentError, match=r"input_layouts.*global view.*shard_sequence.*view='global'"):
    replicator.Replicator(mesh=m, input_layouts=("batch", "seq"))
  with pytest.raises(mesh.LayoutError, match=r"names mesh axis 'sequence'.*Fix"):
    replicator.Replicator(mesh=m, view="global", input_layouts=("batch", "sequence"))
  repl = replicator.Replicator(mesh=m, view="global", input_layouts=("batch", "seq"))
  odd = tf.data.Dataset.from_tensors(np.zeros((B, 7), np.float32))
  with pytest.raises(mesh.LayoutError, match=r"input 0 of the step.*dimension 1 has size 7.*divisible by 2"):
    repl.run(lambda x: tf.reduce_sum(x), odd)


@pytest.mark.parametrize("scheme", ["all_gather", "ring", "ulysses"])
def test_a_length_the_axis_does_not_divide_is_refused_and_its_padded_tokens_train_as_on_one_device(scheme):
  # 63 tokens over "seq" of 2: refused, the fix named. Padded to 64 (replicator.pad_sequence), the padding key
  # masked and its loss weighted out, the loss and every gradient are one device's on the 63 tokens: 1.3e-8 apart at
  # most with each scheme (measured), so 1e-6 (above the loss's float32 ulp, 2.4e-7); the padding key left
  # unmasked: the loss 1.4e-6 off, a gradient 4.2e-4.
  length = S - 1
  rng = np.random.default_rng(5)
  ids, labels = (rng.integers(1, V, (B, length)).astype(np.int32) for _ in range(2))  # (id 0: the padding)

  def step_of(layers):
    emb, mha, head = layers

    def step(batch):
      ids, labels, real = batch  # real: 1 a token, 0 the padding
      keys = tf.tile(tf.cast(real, tf.bool)[:, None, :], [1, tf.shape(ids)[1], 1])
      with tf.GradientTape() as tape:
        h = emb(ids)
        out = head(h + mha(h, h, attention_mask=keys))
        per_token = keras.losses.sparse_categorical_crossentropy(labels, out, from_logits=True)
        loss = tf.reduce_sum(per_token * real) / tf.reduce_sum(real)
      variables = emb.trainable_variables + mha.trainable_variables + head.trainable_variables
      return [loss] + [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]

    return step

  expected = tf.function(step_of(_mask_layers()))((ids, labels, np.ones((B, length), np.float32)))
  repl = _sequence_replicator(context_parallel=scheme)
  with repl.context():
    layers = _mask_layers()
  odd = tf.data.Dataset.from_tensors((ids, labels, np.ones((B, length), np.float32)))
  with pytest.raises(mesh.LayoutError, match=r"dimension 1 has size 63.*Fix: make dimension 1 a multiple of 2"):
    repl.run(step_of(layers), odd)
  (ids, real), (labels, _) = (replicator.pad_sequence(x, 2) for x in (ids, labels))
  got = repl.run(step_of(layers), tf.data.Dataset.from_tensors((ids, labels, tf.cast(real, tf.float32))))
  for ours, theirs in zip(got, expected):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-6)


def test_a_multi_client_job_refuses_inputs_split_beyond_their_batch():
  # Each process of a multi-client job reads its own shard of the batch: a split of the tokens over "seq" is refused
  # by name. Unit level: this process's configuration says it runs replicas 0 and 1 of the 4 (as one worker of two).
  repl = _sequence_replicator()
  config = dataclasses.replace(repl._config, replicas=(0, 1))  # pylint: disable=protected-access
  assert config.multi_client and not repl._config.multi_client  # pylint: disable=protected-access
  tokens = tf.TensorSpec((B, S), tf.int32)
  with pytest.raises(replicator.UnsupportedError, match=r"splits input 0 \(shape \(4, 64\)\) over \(\('batch',\), "
                     r"\('seq',\)\) beyond its batch.*multi-client job.*Fix: split only the batch dimension"):
    _global_step.input_layout(config, repl.mesh, 0, tokens, ("batch",))
  # The batch alone is read so; and in one process, the tokens split.
  alone = dataclasses.replace(config, input_layouts=("batch", None))
  assert _global_step.input_layout(alone, repl.mesh, 0, tokens, ("batch",)) == (("batch",), ())
  assert _global_step.input_layout(repl._config, repl.mesh, 0, tokens, ("batch",)) == (  # pylint: disable=protected-access
      ("batch",), ("seq",))


def _megatron_block_model(width=128, hidden=512):
  keras.utils.set_random_seed(3)
  ids = keras.Input((16,), dtype="int32")
  h = keras.layers.Embedding(V, width, name="emb")(ids)
  for i in range(2):
    x = keras.layers.LayerNormalization(name=f"ln{i}")(h)
    x = keras.layers.Dense(hidden, activation="gelu", name=f"up{i}")(x)
    x = keras.layers.Dense(width, name=f"down{i}")(x)
    h = h + keras.layers.Dropout(0.1, seed=i)(x)
  return keras.Model(ids, keras.layers.Dense(V, name="head")(h))


MEGATRON = mesh.LayoutMap({r"up\d/kernel": (None, "model"), r"up\d/bias": ("model",), r"down\d/kernel": ("model", None)})


def test_megatron_sequence_parallelism_reduce_scatters_and_gathers_instead_of_all_reducing():
  # Tokens split over the tensor-parallel axis between blocks: each block gathers them before its column-parallel
  # layer (the kernels stay split) and reduce-scatters its row-parallel layer's partial sums back onto the sequence;
  # norms, dropout and the residual run on sequence shards. Where the tokens' bytes exceed the kernels' the
  # partitioner gathers the kernels instead (rewrite._propagation._activations_gathered): here they do not.
  rng = np.random.default_rng(4)
  tokens = (rng.integers(0, V, (2, 16)).astype(np.int32), rng.integers(0, V, (2, 16)).astype(np.int32))
  data = tf.data.Dataset.from_tensors(tokens).repeat()
  one, one_opt = _megatron_block_model(), keras.optimizers.Adam(1e-3)
  one_step = tf.function(keras_step(one, one_opt))
  batches = iter(data)
  expected = [float(one_step(next(batches))) for _ in range(3)]
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)), view="global",
                               layouts=MEGATRON, input_layouts=("batch", "model"), strict=True)
  with repl.context():
    model, opt = _megatron_block_model(), keras.optimizers.Adam(1e-3)
  step = keras_step(model, opt)
  np.testing.assert_allclose([float(repl.run(step, data)) for _ in range(3)], expected, atol=ATOL)
  assert_every_copy(model.weights, one.weights, atol=ATOL)
  assert_every_copy(opt.variables, one_opt.variables, atol=ATOL)
  report = repl.explain(step, data)
  forward = [row for row in report.collective_rows if "gradient_tape" not in row.op_name and "adam" not in row.op_name
             and "model" in row.axes and re.search(r"/(up|down)\d", row.op_name)]
  kinds = sorted({(row.kind, re.search(r"/(up|down)\d", row.op_name).group(1)) for row in forward})
  assert kinds == [("all_gather", "up"), ("reduce_scatter", "down")], kinds
  ln = [row for row in report.relayouts if re.search(r"/ln\d", row.op_name) and "gradient_tape" not in row.op_name]
  assert not [row for row in ln if row.gathered], ln  # the norms run on the sequence's shards
