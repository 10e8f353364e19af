"""The measurement suite: step time, build cost and collective throughput, in one process.

Run by hand: ``python -m benchmarks.run --devices 4 --json out.json [--plots DIR] [--quick]``.

The process splits the CPU into 64 logical devices once; the step-time part
uses the first ``--devices`` of them, the build-cost part 2 ... 64 and the
throughput part 4 and 8. Every part compares its configurations in the same
process, interleaved, and reports medians with interquartile ranges.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402

LOGICAL_CPUS = 64
PARTS = ("step_time", "build_cost", "throughput")
QUICK_MODELS = ("mlp_deep", "transformer")  # --quick: one overhead-bound and one compute-heavier model


def _git() -> dict:
  """The commit measured and which library files differed from it (others edit the tree while we run)."""
  import subprocess
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "replicator", "rewrite", "mesh"], capture_output=True,
                           text=True, check=True).stdout.split("\n")
    return dict(commit=head, modified_library_files=[line[3:] for line in dirty if line.strip()])
  except (OSError, subprocess.CalledProcessError):
    return {}


def machine_info() -> dict:
  import keras
  import tensorflow as tf
  cpu_model, physical = "unknown", None
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and cpu_model == "unknown":
          cpu_model = value.strip()
        if key.strip() == "cpu cores" and physical is None:
          physical = int(value)
  except OSError:
    pass
  return dict(cpu_model=cpu_model, logical_cores=os.cpu_count(), physical_cores_per_socket=physical,
              python=platform.python_version(), tensorflow=tf.__version__, keras=keras.__version__,
              numpy=__import__("numpy").__version__, platform=platform.platform(),
              date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              logical_cpu_devices=len(tf.config.list_logical_devices("CPU")), load_average_at_start=os.getloadavg(),
              git=_git())


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4, help="logical CPUs for the step-time part")
  parser.add_argument("--json", default=None, help="write every raw timing and summary here")
  parser.add_argument("--plots", default=os.path.join("benchmarks", "results"), help="directory for PNG plots")
  parser.add_argument("--quick", action="store_true",
                      help=f"~3 min: models {QUICK_MODELS}, 10 rounds, build cost at 2 and 8 replicas, "
                           "throughput on 4 devices at 5 sizes")
  parser.add_argument("--mirrored-max-replicas", type=int, default=32,
                      help="build cost: largest replica count MirroredStrategy is built at (64 adds ~2.5 min)")
  parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
  parser.add_argument("--models", default=None, help="comma-separated step-time models (default: all)")
  args = parser.parse_args(argv)
  parts = [p for p in args.parts.split(",") if p]
  unknown = set(parts) - set(PARTS)
  if unknown:
    parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")

  devices = replicator.virtual_cpus(max(LOGICAL_CPUS, args.devices))
  from benchmarks import build_cost  # noqa: E402  (after the devices are configured)
  from benchmarks import plots
  from benchmarks import step_time
  from benchmarks import throughput

  def log(message):
    print(message, flush=True)

  info = machine_info()
  log(f"{info['cpu_model']}, {info['logical_cores']} cores, TensorFlow {info['tensorflow']}, "
      f"Keras {info['keras']}, {info['logical_cpu_devices']} logical CPU devices, {info['date']}")
  results = dict(machine=info, args=vars(args), run_time_s={})
  tables = []
  start = time.perf_counter()
  if "step_time" in parts:
    t0 = time.perf_counter()
    models = args.models.split(",") if args.models else QUICK_MODELS if args.quick else None
    results["step_time"] = step_time.run(devices[:args.devices], models, rounds=10 if args.quick else 60,
                                         budget_seconds=20 if args.quick else 90, log=log)
    results["run_time_s"]["step_time"] = time.perf_counter() - t0
    tables.append(("Step time", step_time.markdown(results["step_time"])))
  if "build_cost" in parts:
    t0 = time.perf_counter()
    counts = (2, 8) if args.quick else (2, 4, 8, 16, 32, 64)
    results["build_cost"] = build_cost.run(devices, counts, quick=args.quick,
                                           mirrored_max_replicas=args.mirrored_max_replicas, log=log)
    results["run_time_s"]["build_cost"] = time.perf_counter() - t0
    tables.append(("Build cost", build_cost.markdown(results["build_cost"])))
  if "throughput" in parts:
    t0 = time.perf_counter()
    results["throughput"] = throughput.run(devices, (4,) if args.quick else (4, 8), quick=args.quick, log=log)
    results["run_time_s"]["throughput"] = time.perf_counter() - t0
    tables.append(("Collective throughput", throughput.markdown(results["throughput"])))
  results["run_time_s"]["total"] = time.perf_counter() - start
  info["load_average_at_end"] = os.getloadavg()  # other processes on the machine skew absolute times

  for title, table in tables:
    log(f"\n## {title}\n\n{table}")
  log("\nrun time: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["run_time_s"].items()))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
    log(f"wrote {args.json}")
  if args.plots:
    for path in plots.save_all(results, args.plots):
      log(f"wrote {path}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
