"""Collective implementations side by side: step time of all_reduce by size.

Run by hand: ``python -m benchmarks.collectives --devices 4 --json out.json``.
Each size and implementation runs in the same process, interleaved, and the
table reports medians and the ratio collective_ops / one_device. Used to choose
``Replicator(implementation="auto")``'s default on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402

IMPLEMENTATIONS = ("one_device", "collective_ops")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--sizes", default="4096,65536,1048576,16777216,67108864", help="bytes per replica")
  parser.add_argument("--ops-per-step", type=int, default=8, help="all_reduces per step (each on its own tensor)")
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  replicator.virtual_cpus(args.devices)
  import tensorflow as tf

  rows = []
  for size in [int(s) for s in args.sizes.split(",")]:
    elements = max(1, size // 4 // args.ops_per_step)
    timings = {}
    steps = {}
    for impl in IMPLEMENTATIONS:
      repl = replicator.Replicator(implementation=impl)
      with repl.context():
        xs = [tf.Variable(tf.ones([elements])) for _ in range(args.ops_per_step)]

      def step_fn(repl=repl, xs=xs):
        reduced = repl.all_reduce([x.read_value() for x in xs], op="mean")
        return tf.add_n([tf.reduce_sum(r[:1]) for r in reduced])

      repl.run(step_fn)  # build + warm up
      repl.run(step_fn)
      steps[impl] = (repl, step_fn)
      timings[impl] = []
    for _ in range(args.repeats):
      for impl in IMPLEMENTATIONS:  # interleaved
        repl, step_fn = steps[impl]
        start = time.perf_counter()
        float(repl.run(step_fn)[0])
        timings[impl].append(time.perf_counter() - start)
    medians = {impl: statistics.median(t) for impl, t in timings.items()}
    payload = elements * 4 * args.ops_per_step
    row = dict(bytes_per_replica=payload, devices=args.devices,
               **{f"{impl}_ms": medians[impl] * 1e3 for impl in IMPLEMENTATIONS},
               ratio_collective_ops_over_one_device=medians["collective_ops"] / medians["one_device"])
    rows.append(row)
    print(f"{payload:>12,d} B  one_device {row['one_device_ms']:8.3f} ms  collective_ops "
          f"{row['collective_ops_ms']:8.3f} ms  ratio {row['ratio_collective_ops_over_one_device']:.2f}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
