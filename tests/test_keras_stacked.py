"""``replicator.StackedBlocks``: a Keras layer of stacked identical blocks, a pipeline in Keras's fit (global view)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from residual_block import Residual
from residual_block import as_stacked
from residual_block import given_stacked
from residual_block import two_blocks

import mesh
import replicator

STAGES, WIDTH, FEATURES, ROWS = 2, 8, 6, 32


def _model(stacked: bool, microbatches=4):
  keras.utils.set_random_seed(0)
  model = two_blocks(stacked, features=FEATURES, width=WIDTH, outputs=1, microbatches=microbatches)
  model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
  return model


def _in_a_row(stacked_model):
  """The one-device model of the blocks in a row, with ``stacked_model``'s values."""
  return given_stacked(_model(stacked=False), {w.path: w.numpy() for w in stacked_model.weights}, STAGES)


def _data():
  rng = np.random.default_rng(1)
  return rng.normal(size=(ROWS, FEATURES)).astype("float32"), rng.normal(size=(ROWS, 1)).astype("float32")


def _as_stacked(model, stacked_model):
  """``model``'s (the blocks in a row) weights as ``stacked_model`` holds them, in its order."""
  values = as_stacked(model, STAGES)
  return [tf.Variable(values[w.path], name=f"reference_{k}") for k, w in enumerate(stacked_model.trainable_weights)]


def test_the_stacked_weights_are_the_blocks_each_drawn_as_alone_and_on_one_device_they_run_in_a_row():
  ours = _model(stacked=True)
  paths = [(w.path, tuple(w.shape)) for w in ours.trainable_weights if w.path.startswith("blocks/")]
  assert paths == [("blocks/gamma_0", (2, 8)), ("blocks/beta_1", (2, 8)), ("blocks/kernel_2", (2, 8, 16)),
                   ("blocks/bias_3", (2, 16)), ("blocks/kernel_4", (2, 16, 8)), ("blocks/bias_5", (2, 8))]
  kernels = ours.get_layer("blocks").trainable_weights[2].numpy()
  assert np.abs(kernels[0] - kernels[1]).max() > 0.1  # each stage its own draw
  assert len(ours.weights) == 4 + 6  # the template's own (empty) variables are not the model's
  x, _ = _data()
  np.testing.assert_allclose(ours.predict(x, verbose=0), _in_a_row(ours).predict(x, verbose=0), rtol=0, atol=1e-6)


SHAPES = {
    "stage_x_batch": ({"stage": 2, "batch": 2}, {r"^blocks/": ("stage",)}),
    "stage_x_batch_x_model": ({"stage": 2, "batch": 2, "model": 2},
                              {r"^blocks/kernel_2$": ("stage", None, "model"), r"^blocks/bias_3$": ("stage", "model"),
                               r"^blocks/kernel_4$": ("stage", "model", None), r"^blocks/(gamma|beta|bias)_[015]$":
                               ("stage",)}),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_keras_fit_with_stacked_blocks_over_a_stage_axis_is_one_device_fit(shape):
  # 2 epochs of 32 rows in batches of 16, 4 microbatches, against fit of the blocks in a row on one device. The
  # same fit of the stacked model on one device (its matmuls on 4 rows at a time) is 8.8e-7 from it: the floor.
  # Measured: 8.8e-7 (stage x batch), 9.8e-7 (stage x batch x model). Bound: 2e-6, twice the floor.
  sizes, layouts = SHAPES[shape]
  x, y = _data()
  reference = _in_a_row(_model(stacked=True))
  reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  repl = replicator.Replicator(mesh=mesh.Mesh(sizes, devices=cpus(int(np.prod(list(sizes.values()))))),
                               layouts=mesh.LayoutMap(layouts, pad=True), batch_axes=("batch",), view="global")
  with repl.context():
    ours = _model(stacked=True)
  ours.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  assert_every_copy(ours.trainable_weights, _as_stacked(reference, ours), atol=2e-6)
  assert int(ours.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 4
  # Each device: its stage's blocks and their two Adam slots, the rest replicated (and Adam's counters).
  stacked = sum(w.numpy().nbytes for w in ours.trainable_weights if w.path.startswith("blocks/"))
  others = sum(w.numpy().nbytes for w in ours.trainable_weights if not w.path.startswith("blocks/"))
  split = 2 if "model" in sizes else 1  # (the kernels, most of the blocks, split over "model" too)
  for device, held in replicator.bytes_per_device(ours.weights + ours.optimizer.variables).items():
    assert 3 * stacked / STAGES / split <= held <= 3 * (stacked / STAGES + others) + 16, (device, held)


def test_keras_fit_with_two_rounds_of_two_stages_is_one_device_fit():
  # 4 blocks as 2 rounds of 2 stages (StackedBlocks(repeats=2), weights [2, 2, ...], the stage their second
  # dimension), fit on {stage: 2, batch: 2} against the 4 blocks in a row on one device. Measured: 2.4e-7; the
  # stacked model's own fit on one device: 6e-7. Bound 2e-6, as above.
  def model(stacked):
    keras.utils.set_random_seed(0)
    made = two_blocks(stacked, features=FEATURES, width=WIDTH, outputs=1, microbatches=4, blocks=4, repeats=2)
    made.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return made

  x, y = _data()
  flat = {w.path: (w.numpy().reshape((4,) + tuple(w.shape[2:])) if w.path.startswith("blocks/") else w.numpy())
          for w in model(stacked=True).weights}
  reference = given_stacked(model(stacked=False), flat, 4)
  reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2, "batch": 2}, devices=cpus(4)),
                               layouts=mesh.LayoutMap({r"^blocks/": (None, "stage")}, pad=True),
                               batch_axes=("batch",), view="global")
  with repl.context():
    ours = model(stacked=True)
  ours.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  expected = as_stacked(reference, 4)
  references = [tf.Variable(np.reshape(expected[w.path], tuple(w.shape)), name=f"reference_{k}")
                for k, w in enumerate(ours.trainable_weights)]
  assert_every_copy(ours.trainable_weights, references, atol=2e-6)
  stacked = sum(w.numpy().nbytes for w in ours.trainable_weights if w.path.startswith("blocks/"))
  for device, held in replicator.bytes_per_device([w for w in ours.weights if w.path.startswith("blocks/")]).items():
    assert held == stacked / 2, (device, held)  # each device: its stage's two blocks


def test_built_layers_stacked_as_rounds_keep_their_values_and_order():
  keras.utils.set_random_seed(2)
  layers = [Residual(WIDTH, name=f"layer{k}") for k in range(4)]
  x = tf.constant(_data()[0] @ np.ones((FEATURES, WIDTH), "float32") / 3)
  expected = x
  for layer in layers:
    expected = layer(expected)
  stacked = replicator.StackedBlocks.from_layers(layers, microbatches=2, repeats=2, name="blocks")
  np.testing.assert_allclose(stacked(x), expected, rtol=0, atol=1e-6)
  kernel = stacked.trainable_weights[2]  # the blocks' first Dense kernels: [2 rounds, 2 stages, width, 2 width]
  assert tuple(kernel.shape) == (2, 2, WIDTH, 2 * WIDTH)
  np.testing.assert_array_equal(kernel.numpy()[1, 0], layers[2].up.kernel.numpy())  # block r * 2 + s at [r, s]
  with pytest.raises(replicator.ArgumentError, match=r"repeats=3\): expected a positive int dividing the 4 layers"):
    replicator.StackedBlocks.from_layers(layers, microbatches=2, repeats=3)


def test_a_block_with_state_or_already_built_is_named():
  with pytest.raises(replicator.UnsupportedError, match=r"holds state besides its trainable weights .*seed_generator"
                                                        r".*Fix: LayerNormalization for BatchNormalization, no Dropout"):
    replicator.StackedBlocks(keras.Sequential([keras.layers.Dense(4), keras.layers.Dropout(0.1)]), stages=2,
                             microbatches=2)(tf.ones([4, 4]))
  built = keras.layers.Dense(4)
  built(tf.ones([1, 4]))
  with pytest.raises(replicator.UnsupportedError, match=r"was built before .*Fix: pass a new block"):
    replicator.StackedBlocks(built, stages=2, microbatches=2)(tf.ones([4, 4]))


def test_a_model_with_stacked_blocks_saves_and_loads(tmp_path):
  model = _model(stacked=True)
  path = str(tmp_path / "stacked.keras")
  model.save(path)
  loaded = keras.saving.load_model(path)
  x, _ = _data()
  np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def _llama_parts():
  """A small KerasHub Llama backbone built on one device (outside any Replicator): its layers are the reference."""
  import keras_hub  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(5)
  return keras_hub.models.LlamaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=1,
                                        hidden_dim=16, intermediate_dim=32, max_sequence_length=32)


def _lm(embedding, blocks, norm, length=16):
  """Token ids -> the embedding, the decoder blocks (a list in a row, or a StackedBlocks layer), the norm, logits
  from the embedding reversed (tied): a causal language model of KerasHub's layers, no padding."""
  ids = keras.Input((length,), dtype="int32")
  h = embedding(ids)
  for block in blocks if isinstance(blocks, list) else [blocks]:
    h = block(h)
  model = keras.Model(ids, embedding(norm(h), reverse=True))
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def test_a_keras_hub_decoder_s_layers_stacked_over_two_stages_fit_as_the_layers_in_a_row_on_one_device():
  # KerasHub's Llama decoder layers (grouped-query attention, rotary positions, RMS norms) of a backbone built on one
  # device, stacked with their values (StackedBlocks.from_layers; the first layer the template), the token embedding
  # tied to the output: fit on {"stage": 2, "batch": 2} for 3 steps equals fit of the backbone's own layers in a row
  # on one device (measured: the losses equal, every weight within 3.4e-7; bound 2e-6).
  backbone = _llama_parts()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, size=(24, 17)).astype("int32")
  x, y = tokens[:, :-1], tokens[:, 1:]
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2, "batch": 2}, devices=cpus(4)),
                               layouts=mesh.LayoutMap({r"^blocks/": ("stage",)}, pad=True), batch_axes=("batch",),
                               view="global")
  with repl.context():
    embedding = backbone.token_embedding.__class__.from_config(backbone.token_embedding.get_config())
    norm = backbone.layer_norm.__class__.from_config(backbone.layer_norm.get_config())
    blocks = replicator.StackedBlocks.from_layers(backbone.transformer_layers, microbatches=2, name="blocks")
    ours = _lm(embedding, blocks, norm)
  for mine, theirs in ((embedding, backbone.token_embedding), (norm, backbone.layer_norm)):
    for w, v in zip(mine.weights, theirs.weights):
      w.assign(v.numpy())
  layers = backbone.transformer_layers
  for k, stacked in enumerate(blocks.trainable_weights):  # (their values, as given; a stage's on its devices)
    np.testing.assert_array_equal(stacked.numpy(), np.stack([layer.trainable_weights[k].numpy() for layer in layers]))
    assert stacked.value.sharding.spec[0] == "stage"
  reference = _lm(backbone.token_embedding, list(layers), backbone.layer_norm)
  history = ours.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]
  expected = reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]
  np.testing.assert_allclose(history, expected, rtol=0, atol=1e-5)
  for k, stacked in enumerate(blocks.trainable_weights):
    np.testing.assert_allclose(stacked.numpy(), np.stack([layer.trainable_weights[k].numpy() for layer in layers]),
                               rtol=0, atol=2e-6, err_msg=stacked.path)
  for mine, theirs in ((embedding, backbone.token_embedding), (norm, backbone.layer_norm)):
    for w, v in zip(mine.weights, theirs.weights):
      np.testing.assert_allclose(w.numpy(), v.numpy(), rtol=0, atol=2e-6, err_msg=w.path)
