"""A layer adding the losses a pipeline's stage adds (tests of ``repl.pipeline`` and ``PipelineModel``)."""

import keras


class AddsLosses(keras.layers.Layer):
  """Adds 0.1 mean(x^2) (a mean over its rows) and 0.01 sum(scale^2) (of its weight alone) in its call."""

  def build(self, input_shape):
    self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

  def call(self, x):
    self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
    self.add_loss(0.01 * keras.ops.sum(keras.ops.square(self.scale)))
    return x * self.scale
