"""The global view's cost model against measured step times: hand-written layouts of a Keras transformer.

One process, 4 logical CPUs. A 2-block Keras 3 transformer (hidden 128, 4 heads, vocabulary 1024, sequence 32,
global batch 16, Adam) in the global view under several layouts, the same step unchanged: data-parallel (4x1), and
on 2x2 variables replicated over "model", Megatron (heads and feed-forward over "model"), Megatron with the
vocabulary (embedding and output layer) over "model", and FSDP (every kernel's first dimension over "batch"); and
Megatron with the vocabulary on 1x4; and ``layouts="auto"`` on 2x2 (its search's time and choice, and its step
against the fastest hand-written one). For each it prints the estimate of ``repl.explain(...).estimate(machine)``
(``machine = replicator.calibrate()``: compute, executor overhead, communication) beside the measured step time
(interleaved rounds), and how well the estimate ranks the layouts (Spearman's rank correlation, and whether it
picks the fastest).

Run by hand: ``python -m benchmarks.cost_model [--rounds 15] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

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


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  replicator.virtual_cpus(4)
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel

  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:4]]
  start = time.perf_counter()
  machine = replicator.calibrate(devices)
  calibration_s = time.perf_counter() - start
  rng = np.random.default_rng(0)
  batch = (rng.integers(0, VOCAB, size=(BATCH, TIME)).astype("int32"),
           rng.integers(0, VOCAB, size=(BATCH, TIME)).astype("int32"))
  data = tf.data.Dataset.from_tensors(batch).repeat()
  calls, records = {}, {}
  for name, (shape, layouts) in {**LAYOUTS, AUTO: ({"batch": 2, "model": 2}, "auto")}.items():
    if layouts == "auto":
      repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=devices), view="global", layouts="auto")
    else:
      repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=devices), view="global",
                                   layouts=mesh.LayoutMap(layouts, pad=True) if layouts else None)
    with repl.context():
      model, optimizer = _transformer(keras), keras.optimizers.Adam(1e-3)
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
                     "weights_bytes_per_device": max(replicator.bytes_per_device(model.weights).values()),
                     "first_call_s": first_call}
    if report.layout_search is not None:
      records[name].update(search_s=report.layout_search.search_seconds, tried=len(report.layout_search.tried),
                           chosen={k: list(v) for k, v in repl.layouts.items()} if repl.layouts else {})
    calls[name] = (lambda repl=repl, step=step: float(repl.run(step, data)))
  times = _timing.interleaved(calls, rounds=args.rounds, warmup=2)
  for name, samples in times.items():
    records[name]["measured_ms"] = _timing.summary(samples)["median"] * 1e3
  names = list(LAYOUTS)  # the hand-written ones
  estimated = [records[n]["estimate_ms"] for n in names]
  measured = [records[n]["measured_ms"] for n in names]
  rank = _spearman(estimated, measured)
  picked, fastest = names[int(np.argmin(estimated))], names[int(np.argmin(measured))]
  rows = [[n, f"{records[n]['measured_ms']:.1f} ms", f"{records[n]['estimate_ms']:.1f} ms",
           f"{records[n]['estimate_ms'] / records[n]['measured_ms']:.2f}",
           f"{records[n]['compute_ms']:.1f} / {records[n]['overhead_ms']:.1f} / {records[n]['communication_ms']:.1f}",
           records[n]["collectives"], f"{records[n]['bytes_sent_per_device']:,.0f}",
           f"{records[n]['weights_bytes_per_device']:,}"] for n in names + [AUTO]]
  print(_timing.table(["layout", "measured", "estimated", "estimated / measured", "compute / overhead / comm. (ms)",
                       "collectives", "bytes sent/device", "weights/device"], rows))
  auto = records[AUTO]
  auto["over_best_hand_written"] = auto["measured_ms"] / records[fastest]["measured_ms"]
  print(f"\n{AUTO}: {auto['measured_ms']:.1f} ms measured ({auto['estimate_ms']:.1f} estimated), "
        f"{auto['over_best_hand_written']:.2f}x the best hand-written layout's; {auto['tried']} assignments tried "
        f"in {auto['search_s']:.1f} s; chosen: {auto['chosen']}")
  print(f"\nSpearman rank correlation, estimated vs measured: {rank:.2f}; the estimate picks {picked!r}, "
        f"the fastest measured is {fastest!r} ({records[picked]['measured_ms'] / records[fastest]['measured_ms']:.2f}x "
        f"of it). Calibration: {calibration_s:.1f} s (cached after the first run).")
  result = {"config": {"vocab": VOCAB, "dim": DIM, "heads": HEADS, "time": TIME, "batch": BATCH, "blocks": BLOCKS,
                       "rounds": args.rounds},
            "machine": machine.__dict__, "records": records, "spearman": rank, "picked": picked, "fastest": fastest}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
