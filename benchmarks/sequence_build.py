"""The sequence-split transformer's build against the data-parallel build of the same step (issue 56: at most 1.3x).

Each build is the first ``repl.run`` of a global-view training step (trace,
partition, expand, import, TensorFlow's first call) in a fresh process, on 4
logical CPUs: ``{"batch": 2, "seq": 2}`` with ``input_layouts=("batch", "seq")``
against ``{"batch": 4}``, alternated round by round (a machine's speed drifts;
the ratio of neighbours does not). Models: a Keras decoder (``keras``: 2 blocks
of ``MultiHeadAttention`` + MLP, so attention runs blockwise over the split
sequence) and KerasHub's Llama (``llama``: 2 layers, grouped-query attention,
rotary positions; its attention routed to the same blockwise attention,
``replicator/integrations/_keras_hub_attention.py``).

Run by hand: ``python -m benchmarks.sequence_build [--models keras,llama] [--rounds 3] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import _timing

SPLITS = {"seq": ({"batch": 2, "seq": 2}, ("batch", "seq")), "data": ({"batch": 4}, None)}
LENGTH, BATCH, HIDDEN, VOCABULARY = 128, 8, 64, 256


def _model(name):
  import keras  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(0)
  if name == "llama":
    import keras_hub  # pylint: disable=import-outside-toplevel
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=VOCABULARY, num_layers=2, hidden_dim=HIDDEN,
                                              intermediate_dim=4 * HIDDEN, num_query_heads=4, num_key_value_heads=2)
    ids = keras.Input((LENGTH,), dtype="int32")
    h = backbone({"token_ids": ids, "padding_mask": keras.ops.ones_like(ids)})
    return keras.Model(ids, keras.layers.Dense(VOCABULARY)(h))
  ids = keras.Input((LENGTH,), dtype="int32")
  h = keras.layers.Embedding(VOCABULARY, HIDDEN)(ids)
  for _ in range(2):
    a = keras.layers.MultiHeadAttention(4, HIDDEN // 4)(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(4 * HIDDEN, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(HIDDEN)(f))
  return keras.Model(ids, keras.layers.Dense(VOCABULARY)(h))


def _child(model: str, split: str) -> dict:
  import mesh  # pylint: disable=import-outside-toplevel
  mesh.virtual_cpus(4)
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import replicator  # pylint: disable=import-outside-toplevel
  shape, input_layouts = SPLITS[split]
  repl = replicator.Replicator(mesh=mesh.Mesh(shape), view="global", input_layouts=input_layouts)
  with repl.context():
    net, optimizer = _model(model), keras.optimizers.Adam(1e-3)

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, net(x), from_logits=True))
    grads = tape.gradient(loss, net.trainable_variables)
    optimizer.apply_gradients(zip(grads, net.trainable_variables))
    return loss

  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCABULARY, (BATCH, LENGTH + 1)).astype(np.int32)
  data = tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()
  start, cpu = time.perf_counter(), time.process_time()
  loss = float(repl.run(step, data))
  return {"build_s": time.perf_counter() - start, "build_cpu_s": time.process_time() - cpu, "loss": loss}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="keras,llama")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--json", default=None)
  parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(_child(*args.child)))
    return {}
  results = {}
  for model in args.models.split(","):
    builds = _timing.fresh_builds("benchmarks.sequence_build", {"seq": [model, "seq"], "data": [model, "data"]},
                                  args.rounds)
    ratios = _timing.round_ratios(builds["seq"], builds["data"])
    results[model] = {"seq_s": builds["seq"], "data_s": builds["data"], "ratios": ratios,
                      "median_ratio": ratios[len(ratios) // 2]}
    print(f"{model}: sequence split {', '.join(f'{s:.1f}' for s in builds['seq'])} s; data parallel "
          f"{', '.join(f'{s:.1f}' for s in builds['data'])} s; ratio per round "
          f"{', '.join(f'{x:.2f}' for x in ratios)} (median {results[model]['median_ratio']:.2f}; target <= 1.3)")
  _timing.save_json(results, args.json)
  return results


if __name__ == "__main__":
  main()
