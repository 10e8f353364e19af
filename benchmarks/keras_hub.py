"""KerasHub models on the layout maps they ship: the split step's time over one device's, ours and Keras-on-JAX's.

For each model (a tiny-but-not-trivial KerasHub causal LM: 2 layers, hidden
``--hidden``, sequence ``--length``, batch ``--batch``, token ids in,
``preprocessor=None``), in one process per backend:

* TensorFlow, this library: ``model.train_on_batch`` on one device, and under
  ``keras.distribution.ModelParallel(layout_map=Backbone.get_layout_map(mesh))``
  on a 2x2 mesh of logical CPUs after ``replicator.enable_keras_distribution()``
  (the global view), the two interleaved round by round (``_timing``);
* Keras on JAX (``--jax``, if ``jax`` is installed), the same script with
  ``KERAS_BACKEND=jax`` and 4 host devices in a child process: one device and
  the same ``ModelParallel``;
* TensorFlow without oneDNN (``--no-onednn``): the first item again in a child
  process with ``TF_ENABLE_ONEDNN_OPTS=0``. oneDNN's kernels (TensorFlow's
  default on x86) are much faster than Eigen's on one device's whole matrices
  and gain less on each device's quarter of them, so the ratio depends on the
  kernel library as well as on the partitioning;
* TensorFlow's default threads (``--default-threads``): the first item again
  in a child process with ``virtual_cpus(4, intra_op_threads=0)`` (a kernel
  may use every core, as TensorFlow's default; ``virtual_cpus(4)`` gives it
  ``cores // 4``). Its one-device step is the fair baseline where one kernel
  on every core is faster: the table gives our split step over it too.

The figure of merit is the ratio of the split step to its own one-device step
(the partitioning overhead; absolute times differ between backends, whose CPU
kernels differ). Also reported: the split step's collectives and relayouts
(``repl.explain``), and each device's share of the weights.

Run by hand: ``python -m benchmarks.keras_hub [--models llama,qwen] [--rounds 20] [--jax] [--no-onednn]
[--default-threads] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODELS = {
    "llama": ("LlamaBackbone", "LlamaCausalLM", {"num_query_heads": 4, "num_key_value_heads": 2}),
    "qwen": ("QwenBackbone", "QwenCausalLM", {"num_query_heads": 4, "num_key_value_heads": 2}),
    "gemma": ("GemmaBackbone", "GemmaCausalLM", {"num_query_heads": 4, "num_key_value_heads": 2, "head_dim": 32}),
}


def _arguments(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="llama,qwen")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--vocabulary", type=int, default=1024)
  parser.add_argument("--jax", action="store_true", help="also time Keras on JAX in a child process")
  parser.add_argument("--no-onednn", action="store_true", help="also time TensorFlow with oneDNN off, in a child process")
  parser.add_argument("--default-threads", action="store_true",
                      help="also time TensorFlow with its default intra-op threads, in a child process")
  parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)  # virtual_cpus' intra_op_threads
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the JAX side, in its own process
  parser.add_argument("--tf-child", action="store_true", help=argparse.SUPPRESS)  # ours again: oneDNN off, or default threads
  parser.add_argument("--json", default=None)
  return parser.parse_args(argv)


def _task(args, name):
  import keras  # pylint: disable=import-outside-toplevel
  import keras_hub  # pylint: disable=import-outside-toplevel
  backbone_name, task_name, extra = MODELS[name]
  keras.utils.set_random_seed(0)
  backbone = getattr(keras_hub.models, backbone_name)(
      vocabulary_size=args.vocabulary, num_layers=2, hidden_dim=args.hidden, intermediate_dim=4 * args.hidden,
      **extra)
  task = getattr(keras_hub.models, task_name)(backbone=backbone, preprocessor=None)
  task.compile(optimizer=keras.optimizers.Adam(1e-3),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return task


def _batch(args):
  import numpy as np  # pylint: disable=import-outside-toplevel
  ids = np.random.RandomState(0).randint(1, args.vocabulary, size=(args.batch, args.length + 1)).astype(np.int32)
  return {"token_ids": ids[:, :-1], "padding_mask": np.ones((args.batch, args.length), np.int32)}, ids[:, 1:]


def _time(args, name, distribute) -> dict:
  """Times one device against the shipped map on 2x2 (``distribute(mesh, map)`` -> a context to build in)."""
  import keras  # pylint: disable=import-outside-toplevel
  import keras_hub  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from benchmarks import _timing  # pylint: disable=import-outside-toplevel
  x, y = _batch(args)
  one = _task(args, name)
  device_mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=keras.distribution.list_devices()[:4])
  layout_map = getattr(keras_hub.models, MODELS[name][0]).get_layout_map(device_mesh)
  distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
  with distribution.scope():  # made under it (its strategy is recorded); both trained outside it
    split = _task(args, name)
  times = _timing.interleaved({"one device": lambda: one.train_on_batch(x, y),
                               "2x2 shipped map": lambda: split.train_on_batch(x, y)}, rounds=args.rounds)
  medians = {k: float(np.median(v)) for k, v in times.items()}
  ratios = [s / o for s, o in zip(times["2x2 shipped map"], times["one device"])]
  return {"one_device_ms": 1e3 * medians["one device"], "split_ms": 1e3 * medians["2x2 shipped map"],
          "ratio": float(np.median(ratios)), "split_model": split}


def _child(args) -> None:
  """A child process (Keras on JAX, or TensorFlow without oneDNN, as the parent set): one JSON line per model."""
  import keras  # pylint: disable=import-outside-toplevel
  for name in args.models.split(","):
    found = _time(args, name, None)
    found.pop("split_model")
    print(json.dumps({"model": name, **found}), flush=True)
    keras.backend.clear_session()


def _in_child(args, flags: list[str], **env) -> dict:
  """This benchmark in a child process with ``flags`` and ``env`` set: per model, the row it prints."""
  command = [sys.executable, "-m", "benchmarks.keras_hub", *flags, "--models", args.models,
             "--rounds", str(args.rounds), "--hidden", str(args.hidden), "--length", str(args.length),
             "--batch", str(args.batch), "--vocabulary", str(args.vocabulary)]
  out = subprocess.run(command, env=dict(os.environ, **env), capture_output=True, text=True, check=True).stdout
  return {row["model"]: row for row in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}


def _jax(args) -> dict:
  return _in_child(args, ["--child"], KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=4")


def main(argv=None) -> dict:
  args = _arguments(argv)
  if args.child:
    _child(args)
    return {}
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import replicator  # pylint: disable=import-outside-toplevel
  replicator.virtual_cpus(4, intra_op_threads=args.threads)
  import keras  # pylint: disable=import-outside-toplevel
  replicator.enable_keras_distribution()
  if args.tf_child:  # TensorFlow without oneDNN or with its default threads (set by the parent)
    _child(args)
    return {}
  results = {"config": {k: getattr(args, k) for k in ("hidden", "length", "batch", "vocabulary", "rounds")},
             "models": {}}
  for name in args.models.split(","):
    found = _time(args, name, None)
    split = found.pop("split_model")
    weights = replicator.bytes_per_device(split.weights)
    whole = sum(w.numpy().nbytes for w in split.weights)
    found["weights_per_device"] = max(weights.values()) / whole
    results["models"][name] = found
    keras.backend.clear_session()
  if args.jax:
    for name, row in _jax(args).items():
      results["models"][name]["jax"] = row
  if args.no_onednn:
    for name, row in _in_child(args, ["--tf-child"], TF_ENABLE_ONEDNN_OPTS="0").items():
      results["models"][name]["no_onednn"] = row
  if args.default_threads:
    for name, row in _in_child(args, ["--tf-child", "--threads", "0"]).items():
      row["ours_split_over_this_one_device"] = results["models"][name]["split_ms"] / row["one_device_ms"]
      results["models"][name]["default_threads"] = row
  print(f"{'model':8s} {'one device':>12s} {'2x2 map':>10s} {'ratio':>7s} {'weights/dev':>12s} {'JAX ratio':>10s} "
        f"{'no oneDNN: one / 2x2 / ratio':>30s} {'default threads: one / 2x2 / ratio / ours over its one':>56s}")

  def child_row(row, extra=""):
    if not row:
      return "-"
    return f"{row['one_device_ms']:.1f}ms / {row['split_ms']:.1f}ms / {row['ratio']:.2f}" + extra

  for name, row in results["models"].items():
    jax_ratio = f"{row['jax']['ratio']:.2f}" if "jax" in row else "-"
    default = row.get("default_threads")
    default = child_row(default, f" / {default['ours_split_over_this_one_device']:.2f}" if default else "")
    print(f"{name:8s} {row['one_device_ms']:10.1f}ms {row['split_ms']:8.1f}ms {row['ratio']:7.2f} "
          f"{row['weights_per_device']:12.2f} {jax_ratio:>10s} {child_row(row.get('no_onednn')):>30s} {default:>56s}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
