"""A pre-norm residual MLP block (LayerNormalization, two Dense layers): the block the stacked-pipeline tests stack."""

import keras


@keras.saving.register_keras_serializable("tests")
class Residual(keras.layers.Layer):
  """``x + down(tanh(up(norm(x))))``: keeps its input's shape."""

  def __init__(self, width, **kwargs):
    super().__init__(**kwargs)
    self.width = width
    self.norm = keras.layers.LayerNormalization()
    self.up = keras.layers.Dense(2 * width, activation="tanh")
    self.down = keras.layers.Dense(width)

  def call(self, x):
    return x + self.down(self.up(self.norm(x)))

  def get_config(self):
    return {**super().get_config(), "width": self.width}


def in_a_row(stacked_model, make_plain, stages: int, layer="blocks"):
  """``make_plain()`` (a model whose blocks are layers ``block0``, ``block1``, ...) given ``stacked_model``'s values:
  each block the stacked weights' slice of its stage, every other layer its namesake's."""
  model = make_plain()
  stacked = stacked_model.get_layer(layer).trainable_weights
  for s in range(stages):
    for k, w in enumerate(model.get_layer(f"block{s}").trainable_weights):
      w.assign(stacked[k].numpy()[s])
  for own in model.layers:
    if not own.name.startswith("block") and own.weights:
      for w, v in zip(own.weights, stacked_model.get_layer(own.name).weights):
        w.assign(v.numpy())
  return model


def two_blocks(stacked: bool, features=5, width=8, outputs=2, microbatches=2):
  """Dense(width) "inp", two Residual blocks (replicator.StackedBlocks "blocks", or layers block0 and block1), Dense
  (outputs) "out": the multi-client scenario's model and its one-device reference."""
  import replicator  # pylint: disable=import-outside-toplevel
  inputs = keras.Input((features,))
  hidden = keras.layers.Dense(width, name="inp")(inputs)
  if stacked:
    hidden = replicator.StackedBlocks(Residual(width), stages=2, microbatches=microbatches, name="blocks")(hidden)
  else:
    for s in range(2):
      hidden = Residual(width, name=f"block{s}")(hidden)
  return keras.Model(inputs, keras.layers.Dense(outputs, name="out")(hidden))


def stacked_paths(plain, stages: int) -> dict:
  """``{stacked weight path: [(block layer's weight) a stage]}`` of ``plain``'s blocks ``block0``, ``block1``, ..."""
  blocks = [plain.get_layer(f"block{s}").trainable_weights for s in range(stages)]
  return {f"blocks/{w.path.split('/')[-1]}_{k}": [b[k] for b in blocks] for k, w in enumerate(blocks[0])}
