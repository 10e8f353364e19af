"""A multi-client step whose input is preprocessing-bound: every process reading every batch, or its own files.

Run by hand: ``python -m benchmarks.input_shards [--workers 2] [--rounds 3]``.
8 TFRecord files of 1,024 rows (66 floats); the pipeline parses each row and
runs 40 small matmuls on it (the preprocessing), batches by 128 and repeats;
a data-parallel MLP step. Each round launches the job twice, alternately, with
the dataset's ``auto_shard_policy`` ``AUTO`` (every process reads every global
batch and keeps its rows) and ``FILE`` (each process reads its own files:
``replicator/input/_process_shards.py``); worker 0 reports the median of 30
steps after 3 untimed ones, and its process CPU time a step.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time

ROWS, FILES, BATCH, STEPS = 1024, 8, 128, 30


def _write_files(directory: str) -> None:
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(0)
  for f in range(FILES):
    with tf.io.TFRecordWriter(os.path.join(directory, f"part-{f}.tfrecord")) as writer:
      for _ in range(ROWS):
        writer.write(tf.io.serialize_tensor(tf.constant(rng.randn(66).astype(np.float32))).numpy())


def worker(policy: str, directory: str) -> None:
  """One process of the job (``python -m replicator.launch ... benchmarks/input_shards.py --worker POLICY DIR``)."""
  import replicator  # pylint: disable=import-outside-toplevel
  repl = replicator.MultiWorkerReplicator.from_tf_config()
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  def preprocess(row):
    m = tf.reshape(row[:64], [8, 8])
    for _ in range(40):
      m = tf.tanh(m @ m)
    return tf.concat([tf.reshape(m, [64]), row[64:]], 0)

  files = sorted(os.path.join(directory, f) for f in os.listdir(directory))
  rows = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset, cycle_length=1)
  rows = rows.map(lambda s: tf.ensure_shape(tf.io.parse_tensor(s, tf.float32), [66])).map(preprocess)
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy, policy)
  dataset = rows.batch(BATCH, drop_remainder=True).repeat().with_options(options)
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(2)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))

  def step(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(batch[:, :64]) - batch[:, 64:]) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  for _ in range(3):
    repl.run(step, dataset)
  times, cpu = [], time.process_time()
  for _ in range(STEPS):
    start = time.perf_counter()
    repl.run(step, dataset)
    times.append(time.perf_counter() - start)
  cpu = (time.process_time() - cpu) / STEPS
  if repl.task == 0:
    print(f"RESULT {policy} {statistics.median(times) * 1e3:.2f} {cpu * 1e3:.2f}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  from replicator import launch  # pylint: disable=import-outside-toplevel
  results: dict = {"AUTO": [], "FILE": []}
  with tempfile.TemporaryDirectory() as directory:
    _write_files(directory)
    for _ in range(args.rounds):
      for policy in results:
        out = io.TextIOWrapper(io.BytesIO(), write_through=True)
        code = launch.launch([os.path.abspath(__file__), "--worker", policy, directory], args.workers, 1,
                             timeout=600, out=out)
        lines = [line for line in out.buffer.getvalue().decode().splitlines() if "RESULT" in line]
        if code != 0 or not lines:
          sys.exit(f"the {policy} job failed (exit {code})")
        _, _, step, cpu = lines[0].split("RESULT")[-1].split(" ")
        results[policy].append((float(step), float(cpu)))
  print(f"| {args.workers} workers | step (ms), each round | median | CPU a step (ms), worker 0 |")
  print("|:---|:---|---:|---:|")
  for policy, found in results.items():
    steps = ", ".join(f"{s:.1f}" for s, _ in found)
    print(f"| {policy} | {steps} | {statistics.median(s for s, _ in found):.1f} | "
          f"{statistics.median(c for _, c in found):.1f} |")


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(sys.argv[2], sys.argv[3])
  else:
    main()
