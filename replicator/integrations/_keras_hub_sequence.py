"""KerasHub's Llama in a local-view step over a split sequence: global positions, ring attention.

In the local view each replica holds its tokens of every sequence
(``replicator.shard_sequence``) and runs the model on them. KerasHub's Llama
computes its rotary positions from 0 and its attention over the tokens it is
given, so on a piece of a sequence both are wrong. Inside
``repl.sequence_parallel(axis, order=...)`` (entered in the step), while the
step is traced:

* ``RotaryEmbedding.call`` without ``positions`` takes the replica's global
  positions (``_sequence.sequence_positions`` for a sequence of ``P`` times
  the tokens it is given, plus its ``start_index``), in either token order;
* ``LlamaAttention._compute_attention(query, key, value, attention_mask)``
  is ``repl.ring_attention`` over the axis: causal by global positions, the
  keys' padding read off the mask's diagonal (KerasHub's mask is the padding
  mask's minimum with the causal one, so a key's own row says whether it is
  padding), the layer's scale. The layer repeats its keys and values to the
  query heads before the call; the repeat's own input is taken back off the
  traced graph (``_keras_hub_attention.unrepeated``), so the ring carries the
  key heads only (``1 / groups`` of the bytes) and repeats each block where
  it computes.

The rest of the model is per token. Every replica then computes its tokens'
part of the loss; the gradients of each replica's tokens (the ring's
backward pass brings each its keys' and values' share from the others)
summed over the axis are the whole sequence's.

Private KerasHub API, in this module only (KerasHub 0.32.0;
tests/test_keras_hub_sequence.py fails if it changes): ``RotaryEmbedding``
and its ``call(inputs, start_index, positions)`` and ``sequence_axis``;
``LlamaAttention._compute_attention``, ``_inv_norm_factor`` and ``num_key_value_groups``. A layer whose
method's parameters differ is a named ``UnsupportedError``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys

import tensorflow as tf

from replicator.core import _context
from replicator.core import _errors
from replicator.core import _sequence
from replicator.integrations import _keras_hub_attention

ROTARY = ("keras_hub.src.layers.modeling.rotary_embedding", "RotaryEmbedding", "call",
          ("self", "inputs", "start_index", "positions"))
LLAMA = ("keras_hub.src.models.llama.llama_attention", "LlamaAttention", "_compute_attention",
         ("self", "query", "key", "value", "attention_mask"))
CHANGED = ("repl.sequence_parallel at {location}: KerasHub's {name}.{method} is not as this library knows it "
           "(expected the parameters {expected}, found {found}; checked on KerasHub 0.32). Fix: install KerasHub "
           "0.32 (the README's command), or split the sequence by hand with repl.ring_attention.")


def _method(spec, location: str):
  """The class and its method of ``spec`` if KerasHub is imported (None otherwise), checked."""
  module, name, method, parameters = spec
  cls = getattr(sys.modules.get(module), name, None)
  if cls is None:
    return None
  found = tuple(inspect.signature(cls.__dict__[method]).parameters)
  if found != parameters:
    raise _errors.UnsupportedError(CHANGED.format(location=location, name=name, method=method, expected=parameters,
                                                  found=found))
  return cls


def _rotary(original, replicator, axes, order):
  def call(self, inputs, start_index=0, positions=None):
    ctx = _context.current_context()
    length = inputs.shape[self.sequence_axis]
    if positions is not None or ctx is None or ctx.replicator is not replicator or length is None:
      return original(self, inputs, start_index=start_index, positions=positions)
    count = replicator.mesh.axis_size(axes)
    mine = _sequence.sequence_positions(length * count, replicator.mesh.axis_index(ctx.replica_id, axes), count,
                                        order)
    positions = tf.constant(mine, tf.float32) + tf.cast(start_index, tf.float32)
    return original(self, inputs, start_index=0, positions=positions)

  return call


def _llama(original, replicator, axes, order):
  def _compute_attention(self, query, key, value, attention_mask=None):
    ctx = _context.current_context()
    query, key, value = (tf.convert_to_tensor(t) for t in (query, key, value))
    if (ctx is None or ctx.replicator is not replicator or query.shape[1] is None
            or query.shape[1] != key.shape[1]):  # (a cached decoding step: the layer's own)
      return original(self, query, key, value, attention_mask)
    keys_mask = None
    if attention_mask is not None:  # (the padding mask's minimum with the causal one: a key's own row)
      keys_mask = tf.cast(tf.linalg.diag_part(tf.cast(attention_mask, tf.float32)), tf.bool)
    groups = self.num_key_value_groups
    if groups > 1 and key.shape[2] == query.shape[2] and query.shape[2] % groups == 0:
      key, value = _keras_hub_attention.unrepeated(key, groups), _keras_hub_attention.unrepeated(value, groups)
    return replicator.ring_attention(query, key, value, axis=axes, causal=True, order=order, key_mask=keys_mask,
                                     scale=float(self._inv_norm_factor))

  return _compute_attention


@contextlib.contextmanager
def split(replicator, axes: tuple[str, ...], order: str, location: str):
  """While entered, KerasHub's Llama computes over this replica's tokens of a split sequence (see the module)."""
  if order not in _sequence.ORDERS:
    raise _errors.ArgumentError(f"repl.sequence_parallel(order={order!r}) at {location}: expected one of "
                                f"{_sequence.ORDERS}.")
  replaced = []
  try:
    for spec, make in ((ROTARY, _rotary), (LLAMA, _llama)):
      cls = _method(spec, location)
      if cls is None:
        continue
      original = cls.__dict__[spec[2]]
      setattr(cls, spec[2], functools.wraps(original)(make(original, replicator, axes, order)))
      replaced.append((cls, spec[2], original))
    yield
  finally:
    for cls, method, original in reversed(replaced):
      setattr(cls, method, original)
