"""A pre-norm residual MLP block (LayerNormalization, two Dense layers): the block the stacked-pipeline tests stack."""

import keras
import numpy as np


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


def given_stacked(plain, values: dict, stages: int):
  """``plain`` (a model whose blocks are layers ``block0``, ``block1``, ...) given a stacked model's values (``{path:
  array}``): each block its stage's slice of the stacked weights, every other weight its namesake's."""
  for path, weights in stacked_paths(plain, stages).items():
    for s, w in enumerate(weights):
      w.assign(values[path][s])
  for w in plain.trainable_weights:
    if not w.path.startswith("block"):
      w.assign(values[w.path])
  return plain


def as_stacked(plain, stages: int) -> dict:
  """``plain``'s values as the stacked model holds them: ``{path: array}`` (the inverse of :func:`given_stacked`)."""
  return {**{path: np.stack([w.numpy() for w in weights]) for path, weights in stacked_paths(plain, stages).items()},
          **{w.path: w.numpy() for w in plain.trainable_weights if not w.path.startswith("block")}}


def two_blocks(stacked: bool, features=5, width=8, outputs=2, microbatches=2, blocks=2, repeats=1):
  """Dense(width) "inp", ``blocks`` Residual blocks (replicator.StackedBlocks "blocks" of ``repeats`` rounds, or
  layers block0, block1, ...), Dense(outputs) "out": the stacked tests' model and its one-device reference."""
  import replicator  # pylint: disable=import-outside-toplevel
  inputs = keras.Input((features,))
  hidden = keras.layers.Dense(width, name="inp")(inputs)
  if stacked:
    hidden = replicator.StackedBlocks(Residual(width), stages=blocks // repeats, microbatches=microbatches,
                                      repeats=repeats, name="blocks")(hidden)
  else:
    for s in range(blocks):
      hidden = Residual(width, name=f"block{s}")(hidden)
  return keras.Model(inputs, keras.layers.Dense(outputs, name="out")(hidden))


def stacked_paths(plain, stages: int) -> dict:
  """``{stacked weight path: [(block layer's weight) a stage]}`` of ``plain``'s blocks ``block0``, ``block1``, ..."""
  blocks = [plain.get_layer(f"block{s}").trainable_weights for s in range(stages)]
  return {f"blocks/{w.path.split('/')[-1]}_{k}": [b[k] for b in blocks] for k, w in enumerate(blocks[0])}
