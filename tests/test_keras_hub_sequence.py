"""``repl.sequence_parallel`` (``replicator/integrations/_keras_hub_sequence.py``): KerasHub's Llama in a local-view
step over a split sequence, against one device running the whole sequence."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import token_batches
from conftest import assert_every_copy
from conftest import cpus

import mesh
import replicator
from replicator.integrations import _keras_hub_sequence

keras_hub = pytest.importorskip("keras_hub", reason="KerasHub is a test dependency: see the README's test command")

VOCABULARY, BATCH, LENGTH, STEPS = 64, 4, 16, 3


def _backbone():
  keras.utils.set_random_seed(0)
  return keras_hub.models.LlamaBackbone(vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=4,
                                        num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)


def _data():
  return token_batches.padded(VOCABULARY, BATCH, LENGTH, STEPS)


def _loss(backbone, batch):
  hidden = backbone({"token_ids": batch["token_ids"], "padding_mask": batch["padding_mask"]})
  logits = backbone.token_embedding(hidden, reverse=True)
  return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["labels"], logits, from_logits=True))


@pytest.mark.parametrize("shape,order", [
    ({"seq": 2}, "zigzag"), ({"batch": 2, "seq": 2}, "contiguous"),
    pytest.param({"seq": 4}, "zigzag", marks=pytest.mark.full_grid),
    pytest.param({"seq": 2}, "contiguous", marks=pytest.mark.full_grid)])
def test_a_llama_with_its_sequence_split_in_the_local_view_trains_as_on_one_device(shape, order):
  # Each replica runs the backbone on its tokens of every sequence (rotary positions, grouped-query attention, a
  # causal and a padding mask), attention by the ring over "seq"; the gradients' mean over "seq" (and the batch
  # replicas': wrap_optimizer's, the embedding's sparse rows kept sparse as one device's Adam has them) is one
  # device's. 3 Adam steps: every weight and slot on every device within 2e-6 (measured: weights 1.5e-7 contiguous,
  # 4.7e-7 zigzag, slots 3e-8; the global view's sequence split of a Llama, 2.4e-7). Without the context: positions from 0 on every
  # replica and attention over its own tokens, the loss 1e-1 off.
  one, one_opt = _backbone(), keras.optimizers.Adam(1e-3)

  @tf.function
  def one_step(batch):
    with tf.GradientTape() as tape:
      loss = _loss(one, batch)
    one_opt.apply_gradients(zip(tape.gradient(loss, one.trainable_variables), one.trainable_variables))
    return loss

  expected = [float(one_step(batch)) for batch in _data()]
  batch_axes = ("batch",) if "batch" in shape else ()
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(int(np.prod(list(shape.values()))))),
                               batch_axes=batch_axes)
  with repl.context():
    backbone, optimizer = _backbone(), repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
  count = shape["seq"]

  def step(batch):
    index = int(tf.get_static_value(repl.axis_index("seq")))
    mine = {k: replicator.shard_sequence(v, index, count, order=order) for k, v in batch.items()}
    with tf.GradientTape() as tape:
      with repl.sequence_parallel("seq", order=order):
        loss = _loss(backbone, mine)
    variables = backbone.trainable_variables  # (wrap_optimizer: the gradients' mean over every axis)
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return repl.all_reduce(loss, "mean", axis=tuple(shape))

  data = _data()  # (repl.run keeps reading one dataset: a batch a step)
  losses = [float(repl.run(step, data)[0]) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, expected, atol=2e-6)
  # The keys and values go around with their 2 key heads, not repeated to the 4 query heads.
  sent = [c for c in repl.explain(step, data).collectives if c.kind == "permute" and c.shape.rank == 4]
  assert sent and {c.shape[2] for c in sent} == {2}, [c.shape for c in sent]
  assert_every_copy(backbone.weights, one.weights, atol=2e-6)
  assert_every_copy(optimizer.variables, one_opt.variables, atol=2e-6)


def test_without_the_context_each_replica_computes_its_own_piece_only():
  # The check above can fail: the same split without repl.sequence_parallel is another model.
  batch = next(iter(_data()))
  expected = float(_loss(_backbone(), batch))
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": 2}, devices=cpus(2)))
  with repl.context():
    backbone = _backbone()

  def step(split):
    index = int(tf.get_static_value(repl.axis_index("seq")))
    mine = {k: replicator.shard_sequence(v, index, 2) for k, v in batch.items()}
    if split:
      with repl.sequence_parallel("seq"):
        return repl.all_reduce(_loss(backbone, mine), "mean", axis="seq")
    return repl.all_reduce(_loss(backbone, mine), "mean", axis="seq")

  assert abs(float(repl.run(lambda: step(True))[0]) - expected) < 1e-6
  assert abs(float(repl.run(lambda: step(False))[0]) - expected) > 1e-3


def test_mistakes_are_named(monkeypatch):
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": 2}, devices=cpus(2)))
  with pytest.raises(replicator.ReplicatorError, match=r"sequence_parallel\(\) was called outside a replica context"):
    with repl.sequence_parallel("seq"):
      pass

  def enter(order):
    with repl.sequence_parallel("seq", order=order):
      return tf.constant(0.0)

  with pytest.raises(replicator.ArgumentError, match=r"sequence_parallel\(order='striped'\).*expected one of"):
    repl.run(lambda: enter("striped"))
  monkeypatch.setattr(_keras_hub_sequence, "LLAMA", _keras_hub_sequence.LLAMA[:3] + (("self", "q", "k", "v"),))
  with pytest.raises(replicator.UnsupportedError, match=r"KerasHub's LlamaAttention._compute_attention is not as this "
                                                          r"library knows it.*Fix: install KerasHub 0.32"):
    repl.run(lambda: enter("contiguous"))
