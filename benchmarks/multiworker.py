"""The cost of the network path: 2 workers x 2 devices against 1 worker x 4 devices.

Run by hand: ``python -m benchmarks.multiworker [--repeats 30] [--json out.json]``.
One client process, interleaved rounds, medians. Three placements of the same
4-replica training step (Keras MLP, Adam, mean all-reduce of the gradients):

* ``local 4``: a plain Replicator over 4 logical CPUs of this process;
* ``1 worker x 4``: a MultiWorkerReplicator over one worker process with 4
  devices (the gRPC path to launch the step and fetch results, no collective
  across processes);
* ``2 workers x 2``: two worker processes with 2 devices each (plus one
  cross-worker collective per gradient, "hierarchical").

All processes share this machine's cores, so the comparison is of overheads,
not of network bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import replicator  # noqa: E402
from replicator import testing  # noqa: E402

MODELS = {  # name: (layer widths, global batch)
    "mlp_deep (16x128, batch 64)": ([128] * 16, 64),
    "mlp_wide (256-4096-256, batch 512)": ([4096, 256], 512),
}


def _setup(repl, widths, batch, tf, keras, bucket_bytes=None):
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((widths[-1],))] + [keras.layers.Dense(w, activation="relu") for w in widths])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3), bucket_bytes=bucket_bytes)
  x = np.random.RandomState(0).randn(batch, widths[-1]).astype(np.float32)

  def input_fn(ctx):
    b = batch // ctx.num_replicas
    return tf.data.Dataset.from_tensors(x[ctx.replica_id * b:(ctx.replica_id + 1) * b]).repeat()

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x)))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  return lambda: float(repl.run(step, input_fn).values[0])


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--json", default=None)
  parser.add_argument("--bucket-bytes", type=int, default=None, help="wrap_optimizer(bucket_bytes=...)")
  args = parser.parse_args(argv)
  replicator.virtual_cpus(4)
  import keras
  import tensorflow as tf

  rows = []
  with testing.local_cluster(2, devices_per_worker=2) as two, testing.local_cluster(1, devices_per_worker=4) as one:
    # One client process connects to one cluster: all three workers, in subsets.
    cluster = {"worker": list(two.addresses) + list(one.addresses)}
    placements = {"local 4": replicator.Replicator(devices=[f"/device:CPU:{i}" for i in range(4)]),
                  "2 workers x 2": replicator.MultiWorkerReplicator(cluster, devices_per_worker=2, tasks=[0, 1]),
                  "1 worker x 4": replicator.MultiWorkerReplicator(cluster, devices_per_worker=4, tasks=[2])}
    for name, (widths, batch) in MODELS.items():
      runs = {p: _setup(r, widths, batch, tf, keras, args.bucket_bytes) for p, r in placements.items()}
      for run in runs.values():
        run()
        run()
      times = {p: [] for p in runs}
      for _ in range(args.repeats):
        for p, run in runs.items():
          start = time.perf_counter()
          run()
          times[p].append(time.perf_counter() - start)
      medians = {p: statistics.median(t) * 1e3 for p, t in times.items()}
      implementations = sorted({c.implementation for c in placements["2 workers x 2"].explain(
          *_explain_args(placements["2 workers x 2"], widths, batch, tf, keras)).collectives})
      row = dict(model=name, medians_ms=medians, two_over_one=medians["2 workers x 2"] / medians["1 worker x 4"],
                 one_over_local=medians["1 worker x 4"] / medians["local 4"], cross_worker=implementations)
      rows.append(row)
      print(f"{name}: " + ", ".join(f"{p} {m:.2f} ms" for p, m in medians.items())
            + f"; 2x2 / 1x4 = {row['two_over_one']:.2f}, 1x4 / local = {row['one_over_local']:.2f} ({implementations})",
            flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)
  os._exit(0)  # skip TensorFlow's teardown of remote contexts


def _explain_args(repl, widths, batch, tf, keras):
  with repl.context():
    model = keras.Sequential([keras.Input((widths[-1],))] + [keras.layers.Dense(w) for w in widths[:1]])
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD())

  def step():
    x = tf.ones([2, widths[-1]])
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(x))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  return (step,)


if __name__ == "__main__":
  main()
