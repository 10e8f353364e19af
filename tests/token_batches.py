"""Token batches for the language-model tests: ids, a padding mask (some rows padded at the end) and next-token
labels, batched (shared by the KerasHub tests of both views)."""

import numpy as np
import tensorflow as tf


def padded(vocabulary: int, batch: int, length: int, steps: int) -> tf.data.Dataset:
  """``steps`` batches of ``batch`` rows of ``length`` tokens; every third row's last 5 tokens padding."""
  ids = np.random.RandomState(0).randint(1, vocabulary, size=(steps * batch, length + 1)).astype(np.int32)
  padding = np.ones((steps * batch, length), np.int32)
  padding[::3, -5:] = 0
  return tf.data.Dataset.from_tensor_slices({"token_ids": ids[:, :-1], "padding_mask": padding,
                                             "labels": ids[:, 1:]}).batch(batch, drop_remainder=True)
