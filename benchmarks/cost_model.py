"""Automatic layouts and the cost model against measured step times: hand-written layouts and ``layouts="auto"``.

One process, 4 logical CPUs, a 2x2 mesh ("batch", "model"; and 4x1, 1x4 for the Keras transformer). For each
model the same unmodified training step (a tape, a cross-entropy, Adam) runs in the global view under every
hand-written layout and under ``layouts="auto"``; for each the estimate of ``repl.explain(...).estimate(machine)``
(``machine = replicator.calibrate()``: compute, executor overhead, communication) is printed beside the measured
step time (interleaved rounds), with how well the estimate ranks the layouts (Spearman's rank correlation, and
whether it picks the fastest), the automatic search's time and choice, and its step against the fastest
hand-written one.

Models (``--models``, all by default):

* ``transformer``: a 2-block Keras 3 transformer (hidden 128, 4 heads, vocabulary 1024, sequence 32, global batch
  16): data-parallel (4x1); on 2x2 variables replicated over "model", Megatron (heads and feed-forward over
  "model"), Megatron with the vocabulary (embedding and output layer) over "model", FSDP (every kernel's first
  dimension over "batch"); Megatron with the vocabulary on 1x4.
* ``llama``, ``qwen``: KerasHub causal LMs that ship a layout map (2 layers, hidden 128, 4 query and 2 key/value
  heads, vocabulary 1024, sequence 32, batch 16, token ids in): replicated over "model", the shipped map
  (``Backbone.get_layout_map``: weights over both axes), Megatron with the vocabulary over "model".
* ``gpt2``, ``mistral``: KerasHub causal LMs that ship none: replicated over "model", Llama's shipped map (their
  paths are Llama's: the map a user would copy), Megatron with the vocabulary over "model".

``--search-blocks N``: also the search alone on an N-block Keras transformer (no timing of steps): its time,
assignments tried and choice (the issue's "seconds for a 12-layer transformer").

Run by hand: ``python -m benchmarks.cost_model [--models transformer,llama] [--rounds 15] [--search-blocks 12]
[--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402
from benchmarks import _timing  # noqa: E402

VOCAB, DIM, HEADS, TIME, BATCH, BLOCKS = 1024, 128, 4, 32, 16, 2

MEGATRON = {r"attn/(query|key|value)/kernel$": (None, "model", None), r"attn/(query|key|value)/bias$": ("model", None),
            r"attn/attention_output/kernel$": ("model", None, None), r"ff_in/kernel$": (None, "model"),
            r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)}
VOCABULARY = {r"embed/embeddings$": ("model", None), r"head/kernel$": (None, "model"), r"head/bias$": ("model",)}
FSDP = {r"kernel$": ("batch",), r"embeddings$": ("batch",)}
AUTO = "2x2 layouts=\"auto\""
LAYOUTS = {  # name -> (mesh, layout map)
    "4x1 data-parallel": ({"batch": 4}, None),
    "2x2 replicated over model": ({"batch": 2, "model": 2}, None),
    "2x2 Megatron": ({"batch": 2, "model": 2}, MEGATRON),
    "2x2 Megatron + vocabulary": ({"batch": 2, "model": 2}, {**MEGATRON, **VOCABULARY}),
    "2x2 FSDP over batch": ({"batch": 2, "model": 2}, FSDP),
    "1x4 Megatron + vocabulary": ({"batch": 1, "model": 4}, {**MEGATRON, **VOCABULARY}),
}


def _transformer(keras):
  keras.utils.set_random_seed(1)
  tokens = keras.Input((TIME,), dtype="int32", batch_size=BATCH)
  x = keras.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
  for b in range(BLOCKS):  # block0_attn/query/kernel, ...: the maps' keys are searched in the paths
    a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name=f"block{b}_attn")(x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization(name=f"block{b}_ln1")(x + a)
    f = keras.layers.Dense(4 * DIM, activation="gelu", name=f"block{b}_ff_in")(x)
    x = keras.layers.LayerNormalization(name=f"block{b}_ln2")(x + keras.layers.Dense(DIM, name=f"block{b}_ff_out")(f))
  return keras.Model(tokens, keras.layers.Dense(VOCAB, name="head")(x))


def _step(tf, keras, model, optimizer):
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss
  return step


def _spearman(a, b) -> float:
  import numpy as np  # pylint: disable=import-outside-toplevel
  ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
  return float(np.corrcoef(ra, rb)[0, 1])


# KerasHub: backbone, task, extra arguments; whether it ships a map (else Llama's, whose paths it shares, is used)
HUB = {
    "llama": ("LlamaBackbone", "LlamaCausalLM", {"num_query_heads": 4, "num_key_value_heads": 2}, True),
    "qwen": ("QwenBackbone", "QwenCausalLM", {"num_query_heads": 4, "num_key_value_heads": 2}, True),
    "gpt2": ("GPT2Backbone", "GPT2CausalLM", {"num_heads": 4, "max_sequence_length": TIME}, False),
    "mistral": ("MistralBackbone", "MistralCausalLM", {"num_query_heads": 4, "num_key_value_heads": 2}, False),
}
HUB_MEGATRON = {r"(query|key|value)/kernel$": (None, "model", None), r"(query|key|value)/bias$": ("model", None),
                r"attention_output/kernel$": ("model", None, None),
                r"feedforward_(intermediate|gate)_dense/kernel$": (None, "model"),
                r"feedforward_(intermediate|gate)_dense/bias$": ("model",),
                r"feedforward_output_dense/kernel$": ("model", None),
                r"token_embedding/embeddings$": ("model", None), r"token_embedding/reverse_embeddings$": (None, "model")}


def _hub(keras, name, blocks=2):
  # (HUB_MEGATRON's bias keys match nothing in the models without biases: Llama, Mistral; the warning says so)
  warnings.filterwarnings("ignore", message=r"The layouts' key '.*bias\$' matches none")
  import keras_hub  # pylint: disable=import-outside-toplevel
  backbone_name, task_name, extra, _ = HUB[name]
  keras.utils.set_random_seed(1)
  backbone = getattr(keras_hub.models, backbone_name)(vocabulary_size=VOCAB, num_layers=blocks, hidden_dim=DIM,
                                                      intermediate_dim=4 * DIM, **extra)
  return getattr(keras_hub.models, task_name)(backbone=backbone, preprocessor=None)


def _layouts(keras, mesh, devices, model_name):
  """Layout name -> (a mesh shape or a Keras mesh, a mesh.LayoutMap's dict, a Keras map, None or "auto")."""
  two = {"batch": 2, "model": 2}
  if model_name == "transformer":
    return {**LAYOUTS, AUTO: (two, "auto")}
  import keras_hub  # pylint: disable=import-outside-toplevel
  device_mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=devices)
  shipped = HUB[model_name][3]
  source = getattr(keras_hub.models, HUB[model_name][0] if shipped else "LlamaBackbone")
  return {"2x2 replicated over model": (two, None),  # (a Keras map with its own Keras mesh, as KerasHub's tests do)
          ("2x2 shipped map" if shipped else "2x2 Llama's map"): (device_mesh, source.get_layout_map(device_mesh)),
          "2x2 Megatron + vocabulary": (two, HUB_MEGATRON), AUTO: (two, "auto")}


def _measure(args, model_name, machine, devices) -> dict:
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  ids = rng.integers(1, VOCAB, size=(BATCH, TIME + 1)).astype("int32")
  if model_name == "transformer":
    batch = (ids[:, :-1], ids[:, 1:])
  else:
    batch = ({"token_ids": ids[:, :-1], "padding_mask": np.ones((BATCH, TIME), "int32")}, ids[:, 1:])
  data = tf.data.Dataset.from_tensors(batch).repeat()
  calls, records = {}, {}
  candidates = _layouts(keras, mesh, devices, model_name)
  for name, (shape, layouts) in candidates.items():
    if layouts == "auto" or not isinstance(layouts, dict):
      chosen = layouts
    else:
      chosen = mesh.LayoutMap(layouts, pad=True) if layouts else None
    on = mesh.Mesh(shape, devices=devices) if isinstance(shape, dict) else shape
    repl = replicator.Replicator(mesh=on, view="global", layouts=chosen)
    with repl.context():
      model = _transformer(keras) if model_name == "transformer" else _hub(keras, model_name)
      optimizer = keras.optimizers.Adam(1e-3)
    step = _step(tf, keras, model, optimizer)
    start = time.perf_counter()
    repl.run(step, data)  # builds the step and Adam's slots (with "auto": chooses the layouts first)
    first_call = time.perf_counter() - start
    report = repl.explain(step, data)
    estimate = report.estimate(machine)
    records[name] = {"estimate_ms": estimate.seconds * 1e3, "compute_ms": estimate.compute_seconds * 1e3,
                     "overhead_ms": estimate.overhead_seconds * 1e3,
                     "communication_ms": estimate.communication_seconds * 1e3,
                     "collectives": len(report.work.collectives), "ops_per_device": report.work.ops,
                     "bytes_sent_per_device": report.work.bytes_communicated,
                     "peak_tensor_bytes_per_device": report.work.peak_bytes,
                     "weights_bytes_per_device": max(replicator.bytes_per_device(model.weights).values()),
                     "fallbacks": len(report.fallbacks), "first_call_s": first_call}
    if report.layout_search is not None:
      records[name].update(search_s=report.layout_search.search_seconds, tried=len(report.layout_search.tried),
                           chosen={k: list(v) for k, v in repl.layouts.items()} if repl.layouts else {})
    calls[name] = (lambda repl=repl, step=step: float(repl.run(step, data)))
  times = _timing.interleaved(calls, rounds=args.rounds, warmup=2)
  for name, samples in times.items():
    records[name]["measured_ms"] = _timing.summary(samples)["median"] * 1e3
  names = [n for n in candidates if n != AUTO]  # the hand-written ones
  estimated = [records[n]["estimate_ms"] for n in names]
  measured = [records[n]["measured_ms"] for n in names]
  rank = _spearman(estimated, measured)
  picked, fastest = names[int(np.argmin(estimated))], names[int(np.argmin(measured))]
  rows = [[n, f"{records[n]['measured_ms']:.1f} ms", f"{records[n]['estimate_ms']:.1f} ms",
           f"{records[n]['estimate_ms'] / records[n]['measured_ms']:.2f}",
           f"{records[n]['compute_ms']:.1f} / {records[n]['overhead_ms']:.1f} / {records[n]['communication_ms']:.1f}",
           records[n]["collectives"], f"{records[n]['bytes_sent_per_device']:,.0f}",
           f"{records[n]['weights_bytes_per_device']:,}", f"{records[n]['peak_tensor_bytes_per_device']:,.0f}"]
          for n in names + [AUTO]]
  print(f"\n{model_name}:")
  print(_timing.table(["layout", "measured", "estimated", "estimated / measured", "compute / overhead / comm. (ms)",
                       "collectives", "bytes sent/device", "weights/device", "peak tensors/device"], rows))
  auto = records[AUTO]
  auto["over_best_hand_written"] = auto["measured_ms"] / records[fastest]["measured_ms"]
  two_by_two = [n for n in names if n.startswith("2x2")]
  best_2x2 = min(two_by_two, key=lambda n: records[n]["measured_ms"])
  auto["over_best_2x2_hand_written"] = auto["measured_ms"] / records[best_2x2]["measured_ms"]
  print(f"{AUTO}: {auto['measured_ms']:.1f} ms measured ({auto['estimate_ms']:.1f} estimated), "
        f"{auto['over_best_hand_written']:.2f}x the best hand-written layout's ({fastest}), "
        f"{auto['over_best_2x2_hand_written']:.2f}x the best on 2x2 ({best_2x2}); {auto['tried']} assignments tried "
        f"in {auto['search_s']:.1f} s; chosen: {auto['chosen']}")
  print(f"Spearman rank correlation, estimated vs measured: {rank:.2f}; the estimate picks {picked!r}, the fastest "
        f"measured is {fastest!r} ({records[picked]['measured_ms'] / records[fastest]['measured_ms']:.2f}x of it).")
  return {"records": records, "spearman": rank, "picked": picked, "fastest": fastest}


def _search_only(blocks, devices) -> dict:
  """The automatic search alone on a ``blocks``-block transformer: its time and choice."""
  global BLOCKS  # pylint: disable=global-statement
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel
  BLOCKS, before = blocks, BLOCKS
  try:
    repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=devices), view="global",
                                 layouts="auto")
    with repl.context():
      model, optimizer = _transformer(keras), keras.optimizers.Adam(1e-3)
  finally:
    BLOCKS = before
  ids = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, TIME + 1)).astype("int32")
  step = _step(tf, keras, model, optimizer)
  report = repl.explain(step, tf.data.Dataset.from_tensors((ids[:, :-1], ids[:, 1:])).repeat())
  found = report.layout_search
  print(f"\nThe search alone on a {blocks}-block transformer ({len(model.weights)} variables): "
        f"{found.search_seconds:.1f} s, {len(found.tried)} assignments tried, estimated {found.seconds * 1e3:.1f} ms "
        f"a step; chosen: {dict(repl.layouts.items()) if repl.layouts else {}}")
  return {"blocks": blocks, "search_s": found.search_seconds, "tried": len(found.tried),
          "estimate_ms": found.seconds * 1e3}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="transformer,llama,qwen,gpt2,mistral")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--search-blocks", type=int, default=0)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  replicator.virtual_cpus(4)
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:4]]
  start = time.perf_counter()
  machine = replicator.calibrate(devices)
  print(f"Calibration: {time.perf_counter() - start:.1f} s (cached after the first run).")
  result = {"config": {"vocab": VOCAB, "dim": DIM, "heads": HEADS, "time": TIME, "batch": BATCH, "blocks": BLOCKS,
                       "rounds": args.rounds}, "machine": machine.__dict__, "models": {}}
  for model_name in args.models.split(","):
    result["models"][model_name] = _measure(args, model_name, machine, devices)
  if args.search_blocks:
    result["search_only"] = _search_only(args.search_blocks, devices)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
