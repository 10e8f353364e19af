"""The training steps the tests, the multi-worker scenarios and their one-device references share.

Importable by a multi-client worker script before its runtime starts: it sets
nothing up (unlike ``multiworker_scenarios``, which makes logical CPUs).
"""

import tensorflow as tf


def mse_step(model, optimizer):
  """``step((x, y))``: mean squared error of ``model``, one update with ``optimizer``; returns the loss."""

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(x) - y) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  return step


def keras_step(model, opt):
  """The single-device Keras training step the global view's tests run unchanged (sparse labels, logits)."""
  import keras  # pylint: disable=import-outside-toplevel
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step_fn
