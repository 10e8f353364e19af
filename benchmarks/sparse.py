"""Sparse gradients: an embedding model's step, one device vs replicator vs MirroredStrategy.

Run by hand: ``python -m benchmarks.sparse --devices 4 [--rounds 30] [--part main|densify|owners] [--json F]``.

The model is ``benchmarks.models``' ``embedding``: ``Embedding(50000, 128)``,
mean-pooled over 32 tokens, then ``Dense(4)``; global batch 64 x 32 tokens
(2,048 looked-up rows a step, uniform over the vocabulary; 1 MB of rows). All
configurations run side by side in one process (``benchmarks.step_time``'s
setups, interleaved rounds); each prints its bytes per step
(``repl.explain``) and its largest parameter difference from one device after
3 steps.

* ``main`` (default), for Keras 3 Adam and SGD: ``single device`` (a
  ``tf.function`` step on CPU:0); ``replicator`` (the library's defaults);
  ``replicator update=replicated`` (every replica applies every update);
  ``replicator dense`` (``densify_above=0``: a dense all-reduce of the table,
  the library before rows were gathered); ``MirroredStrategy``.
* ``densify``: rows gathered against the dense all-reduce, for vocabularies
  of 512 to 50,000 rows (the same 2,048 rows a step), to place
  ``densify_above``.
* ``owners``: SGD on the table read by rows (``tf.gather`` on the variable,
  ``models.gather_bag``) and read whole (Keras ``Embedding``), vocabularies
  of 512 to 50,000: every replica applying the gathered rows against one
  owner that applies them and broadcasts the table (the sharded update's two
  choices for a sparse update; ``_optimizer.rows_everywhere``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402

OPTIMIZERS = ("adam", "sgd")
VOCABULARIES = (512, 1024, 2048, 4096, 8192, 16384, 50_000)
CHECK_STEPS = 3
SINGLE, OURS, MS = "single device", "replicator", "MirroredStrategy"
MAIN = (SINGLE, OURS, "replicator update=replicated", "replicator dense", MS)
ROWS_EVERYWHERE, ONE_OWNER = "replicator, every replica applies the rows", "replicator, one owner broadcasts"


def _optimizer(name: str):
  import keras
  return {"adam": lambda: keras.optimizers.Adam(1e-3), "sgd": lambda: keras.optimizers.SGD(0.1)}[name]


@contextlib.contextmanager
def _rows_everywhere(choice: bool | None):
  """Steps traced inside make this sharded-update choice for sparse updates (None: the library's)."""
  from replicator.state import _optimizer as optimizer_module
  saved = optimizer_module.rows_everywhere
  if choice is not None:
    optimizer_module.rows_everywhere = lambda *args: choice
  try:
    yield
  finally:
    optimizer_module.rows_everywhere = saved


def _setups(spec, weights, x, y, devices, make, configs):
  """Builds each configuration and runs its check steps (the first traces it)."""
  from benchmarks import step_time
  builders = {
      SINGLE: lambda: step_time.single_device(spec, weights, x, y, make_optimizer=make),
      OURS: lambda: step_time.ours(spec, weights, x, y, devices, make_optimizer=make),
      "replicator update=replicated": lambda: step_time.ours(spec, weights, x, y, devices, make_optimizer=make,
                                                             update="replicated"),
      "replicator dense": lambda: step_time.ours(spec, weights, x, y, devices, make_optimizer=make,
                                                 densify_above=0.0),
      MS: lambda: step_time.mirrored(spec, weights, x, y, devices, make_optimizer=make),
      ROWS_EVERYWHERE: lambda: step_time.ours(spec, weights, x, y, devices, make_optimizer=make, update="sharded"),
      ONE_OWNER: lambda: step_time.ours(spec, weights, x, y, devices, make_optimizer=make, update="sharded"),
  }
  choices = {ROWS_EVERYWHERE: True, ONE_OWNER: False}
  setups = {}
  for name in configs:
    with _rows_everywhere(choices.get(name)):
      setups[name] = builders[name]()
      for _ in range(CHECK_STEPS):
        setups[name].call()
  return setups


def measure(optimizer: str, devices, rounds: int, vocab: int = 50_000, configs=MAIN, model: str = "embedding",
            log=print) -> dict:
  """One optimizer's configurations, checked against one device and timed interleaved."""
  import keras
  import numpy as np
  import tensorflow as tf

  from benchmarks import _timing
  from benchmarks import models as models_lib
  from benchmarks import step_time

  build = {"embedding": models_lib.embedding_bag, "gather": models_lib.gather_bag}[model]
  spec = dataclasses.replace(models_lib.by_name("embedding"), vocab=vocab, build=lambda: build(vocab))
  keras.utils.set_random_seed(0)
  with tf.device("/device:CPU:0"):
    weights = spec.build().get_weights()
  x, y = spec.batch()
  setups = _setups(spec, weights, x, y, devices, _optimizer(optimizer), configs)
  params = {name: step_time.replica_params(s.model) for name, s in setups.items()}
  difference = {name: max(float(np.max(np.abs(a - b))) for xs, ys in zip(p, params[SINGLE]) for a in xs for b in ys)
                for name, p in params.items()}
  nbytes = {name: (s.info["repl"].explain(s.info["step_fn"], s.info["dataset"]).bytes_per_step
                   if "repl" in s.info else None) for name, s in setups.items()}
  times = _timing.interleaved({name: s.call for name, s in setups.items()}, rounds, warmup=1)
  stats = {name: _timing.summary(t) for name, t in times.items()}
  ratios = {name: dict(over_single=_timing.paired_ratio(times[name], times[SINGLE]),
                       over_mirrored=_timing.paired_ratio(times[name], times[MS]) if MS in times else None)
            for name in times}
  for name in setups:
    r = ratios[name]
    log(f"  {model} {optimizer:<5} {vocab:>6} {name:<44} median {_timing.ms(stats[name]['median']):>9}  "
        f"/single {_timing.interval(r['over_single'])}"
        + (f"  /MS {_timing.interval(r['over_mirrored'])}" if r["over_mirrored"] else "")
        + (f"  bytes/step {nbytes[name]:,}" if nbytes[name] is not None else "")
        + f"  max|param - single| {difference[name]:.1e}")
  del setups
  gc.collect()
  return dict(model=model, optimizer=optimizer, vocab=vocab, devices=list(devices), stats=stats, ratios=ratios,
              bytes_per_step=nbytes, max_abs_param_diff_vs_single=difference, times_s=times)


def markdown(records: list[dict]) -> str:
  """One row per configuration: median step, per-round ratios, bytes per step, difference from one device."""
  from benchmarks import _timing
  rows = []
  for rec in records:
    for name, s in rec["stats"].items():
      r = rec["ratios"][name]
      rows.append([rec["model"], rec["optimizer"], f"{rec['vocab']:,}", name, _timing.ms(s["median"]),
                   _timing.interval(r["over_single"]), _timing.interval(r["over_mirrored"]) if r["over_mirrored"] else "",
                   "" if rec["bytes_per_step"][name] is None else f"{rec['bytes_per_step'][name]:,}",
                   f"{rec['max_abs_param_diff_vs_single'][name]:.1e}"])
  return _timing.table(["table read", "optimizer", "vocabulary", "configuration", "median step",
                        "/ one device per round", "/ MS per round", "bytes/step (explain)",
                        "max abs param diff vs one device"], rows, "lllrrrrrr")


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--part", choices=("main", "densify", "owners"), default="main")
  parser.add_argument("--json", help="write the records here")
  args = parser.parse_args(argv)
  replicator.virtual_cpus(args.devices)
  devices = [f"/device:CPU:{i}" for i in range(args.devices)]
  records = []
  if args.part == "main":
    for optimizer in OPTIMIZERS:
      records.append(measure(optimizer, devices, args.rounds))
  elif args.part == "densify":
    for optimizer in OPTIMIZERS:
      for vocab in VOCABULARIES:
        records.append(measure(optimizer, devices, args.rounds, vocab, configs=(SINGLE, OURS, "replicator dense")))
  else:
    for model in ("gather", "embedding"):
      for vocab in VOCABULARIES:
        records.append(measure("sgd", devices, args.rounds, vocab, configs=(SINGLE, ROWS_EVERYWHERE, ONE_OWNER),
                               model=model))
  print(markdown(records))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(records, f, indent=1)
  return records


if __name__ == "__main__":
  main()
