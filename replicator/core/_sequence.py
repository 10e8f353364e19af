"""Which tokens of a sequence each device holds when a sequence is split over a mesh axis.

A sequence of ``length`` tokens split over ``count`` devices, in one of two
orders:

* ``"contiguous"``: device i holds tokens ``[i * length / count, (i + 1) * length / count)``;
* ``"zigzag"``: the sequence cut into ``2 * count`` chunks, device i holding
  chunks i and ``2 * count - 1 - i`` (Megatron-LM's context parallelism,
  PyTorch's "head-tail", the zigzag ring attention): with a causal mask each
  device then has as many scores to compute as any other, where in the
  contiguous order the last device has ``2 * count - 1`` times the first's.

:func:`sequence_positions` gives a device's tokens' global positions (for
rotary embeddings, position embeddings and masks: a token means on every
device what it means on one); :func:`shard_sequence` takes a device's tokens
from a whole sequence (in an input function, or a step), :func:`unshard_sequence`
puts the devices' pieces back in order; :func:`pad_sequence` pads a sequence
the devices' chunks do not divide, with the mask of its real tokens.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from replicator.core import _errors

ORDERS = ("contiguous", "zigzag")


def sequence_positions(length: int, index: int, count: int, order: str = "contiguous") -> np.ndarray:
  """The global positions (int32, ascending within each chunk) of the tokens device ``index`` of ``count`` holds.

  Examples:
    >>> sequence_positions(8, 1, 2, "zigzag").tolist()  # chunks 1 and 2 of 4
    [2, 3, 4, 5]
    >>> sequence_positions(8, 0, 2, "zigzag").tolist()  # chunks 0 and 3
    [0, 1, 6, 7]
  """
  if order not in ORDERS:
    raise _errors.ArgumentError(f"order={order!r}: expected one of {ORDERS}. Fix: pass order='contiguous' or "
                                "order='zigzag' (balanced causal attention).")
  if not 0 <= index < count:
    raise _errors.ArgumentError(f"index={index} is not a position of {count} devices. Fix: pass 0..{count - 1}.")
  chunks = count if order == "contiguous" else 2 * count
  if length % chunks:
    raise _errors.ArgumentError(
        f"A sequence of {length} tokens cannot be split into {chunks} equal chunks ({count} devices, order="
        f"{order!r}). Fix: pad the sequence to a multiple of {chunks} tokens (and mask the padding).")
  size = length // chunks
  taken = [index] if order == "contiguous" else [index, 2 * count - 1 - index]
  return np.concatenate([np.arange(c * size, (c + 1) * size) for c in taken]).astype(np.int32)


def shard_sequence(x, index: int, count: int, *, dim: int = 1, order: str = "contiguous"):
  """The tokens of ``x`` (its dimension ``dim`` a whole sequence) that device ``index`` of ``count`` holds."""
  x = tf.convert_to_tensor(x)
  length = x.shape[dim]
  if length is None:
    raise _errors.ArgumentError(f"shard: dimension {dim} of x has no static size ({x.shape}). Fix: give the "
                                "sequence a static length (pad it), or pass the dimension that holds it.")
  return tf.gather(x, sequence_positions(length, index, count, order), axis=dim)


def unshard_sequence(pieces, *, dim: int = 1, order: str = "contiguous"):
  """The whole sequence from each device's piece (``pieces[i]``: device i's), in the tokens' order."""
  count = len(pieces)
  whole = tf.concat(list(pieces), axis=dim)
  length = whole.shape[dim]
  held = np.concatenate([sequence_positions(length, i, count, order) for i in range(count)])
  return tf.gather(whole, np.argsort(held), axis=dim)


def pad_sequence(x, count: int, *, dim: int = 1, order: str = "contiguous"):
  """``x`` padded with zeros at the end of dimension ``dim`` to a length ``count`` devices split evenly, and the
  ``[batch, padded length]`` mask of its real tokens (True), for attention's ``key_mask``.

  Examples:
    >>> padded, mask = pad_sequence(np.ones([1, 6]), 2, order="zigzag")   # 4 chunks: 8 tokens
    >>> padded.shape.as_list(), int(mask.numpy().sum())
    ([1, 8], 6)
  """
  x = tf.convert_to_tensor(x)
  length = x.shape[dim]
  if length is None:
    raise _errors.ArgumentError(f"pad_sequence: dimension {dim} of x has no static size ({x.shape}). Fix: pass "
                                "the dimension that holds the sequence, or give it a static length.")
  if order not in ORDERS:
    sequence_positions(length, 0, count, order)  # (its error)
  chunks = count if order == "contiguous" else 2 * count
  padded_length = -(-length // chunks) * chunks
  paddings = [[0, 0]] * x.shape.rank
  paddings[dim] = [0, padded_length - length]
  mask = tf.broadcast_to(tf.range(padded_length) < length, [tf.shape(x)[0], padded_length])
  return tf.pad(x, paddings), mask
