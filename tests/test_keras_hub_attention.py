"""KerasHub's attention layers through Keras's attention (``replicator/integrations/_keras_hub_attention.py``).

The private KerasHub API the module relies on, pinned (a KerasHub release
that changes it fails here first); each routed layer against its own
attention in float64 (outputs and every gradient), its keys and values handed
over unrepeated; the layers it leaves as they are.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from replicator.core import _blockwise_attention
from replicator.integrations import _keras_hub_attention

keras_hub = pytest.importorskip("keras_hub", reason="KerasHub is a test dependency: see the README's test command")
from keras_hub.src.models.gemma import gemma_attention  # noqa: E402  pylint: disable=wrong-import-position
from keras_hub.src.models.llama import llama_attention  # noqa: E402  pylint: disable=wrong-import-position

B, S, HIDDEN = 2, 12, 16


def test_the_private_keras_hub_api_is_as_the_module_expects():
  # KerasHub 0.32: the classes, their methods' parameters, Llama's repeat before its attention, the attributes read.
  assert keras_hub.__version__.startswith("0.32."), keras_hub.__version__
  assert (llama_attention.__name__, "LlamaAttention") == _keras_hub_attention.LLAMA
  assert (gemma_attention.__name__, "CachedGemmaAttention") == _keras_hub_attention.GEMMA
  llama, gemma = llama_attention.LlamaAttention, gemma_attention.CachedGemmaAttention
  assert tuple(inspect.signature(llama._compute_attention).parameters) == _keras_hub_attention.LLAMA_PARAMETERS
  assert tuple(inspect.signature(gemma._compute_attention).parameters) == _keras_hub_attention.GEMMA_PARAMETERS
  call = inspect.getsource(llama.call)
  repeat, attend = call.index(_keras_hub_attention.LLAMA_REPEAT), call.index("self._compute_attention(")
  assert repeat < attend and "value = ops.repeat(value, repeats=self.num_key_value_groups, axis=2)" in call
  layer = _llama_layer()
  assert isinstance(layer._inv_norm_factor, float) and layer.num_key_value_groups == 2  # pylint: disable=protected-access
  layer = _gemma_layer()
  for name in ("logit_soft_cap", "dropout", "head_dim", "query_head_dim_normalize", "hidden_dim", "num_query_heads",
               "num_key_value_groups", "use_sliding_window_attention", "_mask_sliding_window"):
    assert hasattr(layer, name), name
  assert [cls for cls, _ in _keras_hub_attention._layers()] == [llama, gemma]  # pylint: disable=protected-access


def _in_float64(layer):
  """``layer`` built, every sublayer in float64 (their softmax layers compute in float32 whatever the dtype)."""
  layer.build((None, S, HIDDEN))
  for sublayer in layer._flatten_layers():  # pylint: disable=protected-access
    sublayer.dtype_policy = "float64"
  return layer


def _llama_layer():
  keras.utils.set_random_seed(0)
  return _in_float64(llama_attention.LlamaAttention(num_query_heads=4, num_key_value_heads=2, dtype="float64"))


def _gemma_layer(**kwargs):
  keras.utils.set_random_seed(0)
  return _in_float64(gemma_attention.CachedGemmaAttention(head_dim=8, num_query_heads=4, num_key_value_heads=2,
                                                          dtype="float64", **kwargs))


def _blockwise(calls):
  def attention(query, key, value, mask=None, scale=None, is_causal=False):  # Keras attention's, as in the trace
    calls.append((tuple(query.shape), tuple(key.shape)))
    return _blockwise_attention.attention(query, key, value, mask=mask, scale=scale, is_causal=is_causal, blocks=3,
                                          groups=query.shape[2] // key.shape[2])
  return attention


def _outputs_and_gradients(layer, x, mask, routed_to=None):
  with tf.GradientTape() as tape:
    tape.watch(x)
    if routed_to is None:
      y = layer(x, attention_mask=mask)
    else:
      with _keras_hub_attention.routed(routed_to):
        y = layer(x, attention_mask=mask)
    loss = tf.reduce_sum(y * tf.cast(tf.range(y.shape[-1]), y.dtype))
  return [y] + tape.gradient(loss, [x] + layer.trainable_weights)


def _inputs():
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(B, S, HIDDEN)))
  causal = np.tril(np.ones((S, S), bool))
  padding = np.ones((B, S), bool)
  padding[1, -3:] = False
  return x, tf.constant(causal[None] & padding[:, None, :])


@pytest.mark.parametrize("make", [_llama_layer, _gemma_layer, lambda: _gemma_layer(use_sliding_window_attention=True,
                                                                                    sliding_window_size=4)],
                         ids=["llama", "gemma", "gemma_sliding_window"])
def test_a_routed_layer_is_its_own_attention_with_its_keys_unrepeated(make):
  # float64, outputs and every gradient: 8.5e-14 at most (measured; the same function summed in another order), so
  # 5e-13; a head given another head's keys, a scale or a mask lost, is 1e-2 off or more.
  layer, (x, mask), calls = make(), _inputs(), []
  expected = _outputs_and_gradients(layer, x, mask)
  got = _outputs_and_gradients(layer, x, mask, routed_to=_blockwise(calls))
  assert len(calls) == 1 and calls[0][0][:3] == (B, S, 4) and calls[0][1][:3] == (B, S, 2), calls  # 2 key heads
  for ours, theirs in zip(got, expected):
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=5e-13)
  original = layer.__class__.__dict__["_compute_attention"]
  assert original.__module__ == layer.__class__.__module__  # (put back)


def test_gemma_with_a_soft_cap_or_dropout_keeps_its_own_attention():
  x, mask = _inputs()
  for layer in (_gemma_layer(logit_soft_cap=5.0), _gemma_layer(dropout=0.1)):
    calls = []
    expected = _outputs_and_gradients(layer, x, mask)
    got = _outputs_and_gradients(layer, x, mask, routed_to=_blockwise(calls))
    assert not calls
    for ours, theirs in zip(got, expected):
      np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_the_keys_before_their_repeat_are_the_repeats_own_input_in_a_trace():
  # Traced, the repeat's input itself (nothing of the repeat computed, nor its gradient); eager (no graph to read),
  # the first head of each group: the same values.
  keys = tf.constant(np.random.default_rng(1).normal(size=(B, S, 2, 4)))

  @tf.function
  def traced(x):
    repeated = keras.ops.repeat(x, repeats=3, axis=2)
    found = _keras_hub_attention.unrepeated(repeated, 3)
    assert found is x, found
    return found

  np.testing.assert_array_equal(traced(keys).numpy(), keys.numpy())
  eager = _keras_hub_attention.unrepeated(keras.ops.repeat(keys, repeats=3, axis=2), 3)
  np.testing.assert_array_equal(eager.numpy(), keys.numpy())
