"""Batch normalization with statistics over the global batch of all replicas."""

from __future__ import annotations

import keras
import tensorflow as tf

from replicator.core import _context


@keras.saving.register_keras_serializable(package="replicator")
class CrossReplicaBatchNorm(keras.layers.BatchNormalization):
  """``keras.layers.BatchNormalization`` whose batch statistics span every replica.

  In a training step of ``repl.run``, the mean and variance are computed over
  the global batch (all replicas' rows) with the replicator's collectives, so
  the layer behaves exactly like ``BatchNormalization`` on one device over the
  full batch: same outputs, same gradients (the collectives are
  differentiable), and moving statistics that stay identical on every replica.
  Outside a replicated step (inference, or no Replicator) it is plain batch
  normalization. Its weights have the same names as ``BatchNormalization``'s,
  so checkpoints move between the two.

  Each training call costs two all-reduces of ``2 * channels + 1`` floats.
  Usable from ``tf.Module`` code too (it is a Keras layer).
  """

  def _moments(self, inputs, mask):
    repl = _context.current()
    if repl is None:
      return super()._moments(inputs, mask)
    return moments(repl, inputs, mask, list(self._reduction_axes), None)


def moments(repl, inputs, mask, reduction_axes, axis):
  """BatchNormalization's ``(mean, variance)`` over ``reduction_axes`` of every replica's ``inputs`` along mesh
  ``axis`` (None: every replica), the rows a ``mask`` hides left out: two all-reduces, differentiable."""
  if mask is None:
    weights = tf.ones_like(inputs)
  else:
    weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
  local_sum = tf.reduce_sum(inputs * weights, axis=reduction_axes)
  local_count = tf.reduce_sum(weights, axis=reduction_axes)
  total, count = repl.all_sum((local_sum, local_count), axis=axis)
  count = tf.maximum(count, 1.0)
  mean = total / count
  # Two passes, like tf.nn.moments: the variance of the deviations from the global mean.
  deviations = tf.square(inputs - tf.stop_gradient(mean)) * weights
  variance = repl.all_sum(tf.reduce_sum(deviations, axis=reduction_axes), axis=axis) / count
  return mean, variance
