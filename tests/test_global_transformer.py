"""The global view on a Keras 3 transformer: layouts do not change results, only communication.

The same single-device model and step run on meshes 1x4, 2x2, 4x1 and 2x4
under several layout rule sets (batch only; attention heads and feed-forward
over "model"; vocabulary over "model"; embedding dimension over "model"), and
end with every variable (Adam slots and counters included) within 1e-5 of one
device, with equal losses step by step. CI runs representative cases; the
whole grid runs with ``--full-grid``.
"""

import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import global_step_of
from conftest import keras_step
from conftest import mesh_sweep

import mesh
import replicator

VOCAB, DIM, HEADS, TIME, BATCH, STEPS = 32, 16, 4, 8, 8, 3

HEADS_AND_FF = {r"attn/(query|key|value)/kernel$": (None, "model", None), r"attn/(query|key|value)/bias$": ("model", None),
                r"attn/attention_output/kernel$": ("model", None, None), r"ff_in/kernel$": (None, "model"),
                r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)}
LAYOUTS = {
    "batch": {},
    "heads_and_ff": HEADS_AND_FF,
    "vocabulary": {r"embed/embeddings$": ("model", None), r"head/kernel$": (None, "model"), r"head/bias$": ("model",)},
    "embedding_dim": {r"embed/embeddings$": (None, "model")},
}
REPRESENTATIVE = {((2, 2), "batch"), ((2, 2), "heads_and_ff"), ((2, 2), "vocabulary"), ((2, 2), "embedding_dim"),
                  ((1, 4), "vocabulary"), ((4, 1), "batch")} | {((2, 4), layout) for layout in LAYOUTS}  # 8 devices: 5 s each


class TiedOutput(keras.layers.Layer):
  """The output projection by the embedding table, transposed (tied weights)."""

  def __init__(self, embedding, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding

  def call(self, x):
    return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


def make_transformer(tied=False):
  """A one-block Keras 3 transformer, as one would write it for one device."""
  keras.utils.set_random_seed(1)
  tokens = keras.Input((TIME,), dtype="int32")
  embed = keras.layers.Embedding(VOCAB, DIM, name="embed")
  x = embed(tokens)
  a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name="attn")(x, x, use_causal_mask=True)
  x = keras.layers.LayerNormalization(name="ln1")(x + keras.layers.Dropout(0.2, seed=5)(a))
  f = keras.layers.Dense(4 * DIM, activation="gelu", name="ff_in")(x)
  f = keras.layers.Dense(DIM, name="ff_out")(f)
  x = keras.layers.LayerNormalization(name="ln2")(x + f)
  logits = TiedOutput(embed, name="tied")(x) if tied else keras.layers.Dense(VOCAB, name="head")(x)
  return keras.Model(tokens, logits)


def dataset():
  rng = np.random.default_rng(0)
  x = rng.integers(0, VOCAB, size=(BATCH * STEPS, TIME)).astype("int32")
  y = rng.integers(0, VOCAB, size=(BATCH * STEPS, TIME)).astype("int32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def train(repl, tied=False):
  """STEPS Adam steps: under ``repl`` in the global view, or on one device if ``repl`` is None."""
  with repl.context() if repl else contextlib.nullcontext():
    model = make_transformer(tied)
    opt = keras.optimizers.Adam(1e-2)
  step_fn = keras_step(model, opt)  # the single-device step, unchanged in every case
  if repl is None:
    step = tf.function(step_fn)
    losses = [float(step(batch)) for batch in dataset()]
  else:
    data = dataset()
    losses = [float(repl.run(step_fn, data)) for _ in range(STEPS)]
  return model, opt, losses, step_fn


def global_repl(shape, layouts):
  m = mesh.Mesh({"batch": shape[0], "model": shape[1]}, devices=cpus(shape[0] * shape[1]))
  return replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(layouts) if layouts else None,
                               batch_axes=("batch",), view="global")


def assert_equal_to_one_device(ours, reference):
  (model, opt, losses, _), (one_model, one_opt, one_losses, _) = ours, reference
  np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-5)
  mine, theirs = model.variables + opt.variables, one_model.variables + one_opt.variables
  assert [re.sub(r"_\d+", "", v.path) for v in mine] == [re.sub(r"_\d+", "", v.path) for v in theirs]
  assert len(mine) > 40  # weights, Adam moments, the iteration counter and the seed generator's state
  assert_every_copy(mine, theirs)


@pytest.fixture(scope="module")
def one_device():
  return {tied: train(None, tied) for tied in (False, True)}


@pytest.mark.parametrize("shape,layout", list(mesh_sweep(LAYOUTS, REPRESENTATIVE)))
def test_transformer_equals_one_device(shape, layout, one_device):
  repl = global_repl(shape, LAYOUTS[layout])
  ours = train(repl)  # a fallback would warn, and warnings are errors in the tests
  assert_equal_to_one_device(ours, one_device[False])
  assert repl.trace_count == 1


@pytest.mark.parametrize("layout", ["vocabulary", "embedding_dim"])
def test_tied_output_projection_equals_one_device(layout, one_device):
  layouts = {r"embed/embeddings$": LAYOUTS[layout][r"embed/embeddings$"]}
  assert_equal_to_one_device(train(global_repl((2, 2), layouts), tied=True), one_device[True])


def test_heads_and_ff_communicate_like_megatron():
  repl = global_repl((2, 2), HEADS_AND_FF)
  model, _, _, step_fn = train(repl)  # the step is kept while its step_fn lives
  step = global_step_of(repl)
  assert not step.partition.fallbacks
  # No gathers (no relayouts); besides all-reduces, only the sharded Adam update's broadcasts of new values,
  # one per trainable variable (every one is replicated over "batch"), written by each device of the group.
  others = [c for c in step.plan.collectives if c.kind != "all_reduce"]
  assert {(c.kind, c.axes, c.members[0].call.split()[0]) for c in others} == {
      ("broadcast", ("batch",), "AssignSubVariableOp")}
  assert len(others) == len(model.trainable_variables)
  forward = [(c.members[0].call.split()[0], c.shape.as_list()) for c in step.plan.collectives
             if c.axes == ("model",) and "gradient_tape" not in c.members[0].call]
  # Two partial sums in the forward pass, as in Megatron: the attention output and the second feed-forward kernel.
  assert forward == [("BatchMatMulV2", [BATCH // 2, TIME, DIM]), ("MatMul", [BATCH // 2 * TIME, DIM])]
  # The dropout mask is drawn per device, its piece of the global draw only.
  (draw,) = [d for n, d in step.partition.decisions.items() if n.endswith("/StatelessRandomUniformV2")]
  assert draw.outputs == [(("batch",), (), ())] and draw.lower is not None


def test_sharded_kernels_and_adam_slots_hold_their_piece():
  repl = global_repl((2, 2), HEADS_AND_FF)
  model, opt, _, _ = train(repl)
  sharded = [v for v in model.variables + opt.variables if re.search(r"(query|key|value|ff_in)_?/?kernel", v.path)]
  assert len(sharded) == 4 * 3  # each kernel and its two Adam moments
  for v in sharded:
    whole = np.asarray(v).nbytes
    pieces = {c.device: c.shape.num_elements() * 4 for c in v.value.components}
    assert set(pieces.values()) == {whole // 2}, v.path


def test_model_fit_of_the_sharded_transformer_equals_one_device():
  # Keras's own train_step (fit), test_step (evaluate) and predict_step, each partitioned like the custom step.
  def fitted(repl):
    with repl.context() if repl else contextlib.nullcontext():
      model = make_transformer()
      model.compile(keras.optimizers.Adam(1e-2),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(dataset(), epochs=2, verbose=0)
    return model, history.history, model.evaluate(dataset(), verbose=0), model.predict(dataset(), verbose=0)

  model, history, evaluated, predicted = fitted(global_repl((2, 2), HEADS_AND_FF))
  one_model, one_history, one_evaluated, one_predicted = fitted(None)
  assert history.keys() == one_history.keys() == {"loss", "accuracy"}
  for key, want in one_history.items():
    np.testing.assert_allclose(history[key], want, rtol=0, atol=1e-5, err_msg=key)
  np.testing.assert_allclose(evaluated, one_evaluated, rtol=0, atol=1e-5)
  np.testing.assert_allclose(predicted, one_predicted, rtol=0, atol=1e-5)
  mine = model.variables + model.optimizer.variables
  theirs = one_model.variables + one_model.optimizer.variables
  assert len(mine) == len(theirs) > 40
  assert_every_copy(mine, theirs)
