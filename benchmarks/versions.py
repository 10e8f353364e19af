"""Two versions of the library side by side: step time and first-call build time, in alternating processes.

Run by hand: ``python -m benchmarks.versions --base <commit> [--repeats 4]``.

A library version cannot be imported twice into one process, so the
comparison alternates fresh processes, base and current in turn (``--repeats``
times each), each timing the same thing:

* ``step``: the deep MLP (16 Dense(128), batch 64) with Keras Adam on 4
  logical CPUs through ``repl.run(step_fn, dataset)``, median of 300 steps
  after 20 warm-up steps; and through ``repl.run(step_fn, input_fn)`` (one
  dataset per replica), the same;
* ``build``: the first call (trace, rewrite, first run) of that step on 8
  replicas.

The base is checked out with ``git worktree`` into a temporary directory.
Reports each version's medians over its processes and current / base.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

PROBE = r'''
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import replicator
replicator.virtual_cpus(8)
import keras, numpy as np, tensorflow as tf

def setup(n):
  repl = replicator.Replicator([f"/device:CPU:{i}" for i in range(n)])
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((128,))] + [keras.layers.Dense(128, activation="relu") for _ in range(15)]
                             + [keras.layers.Dense(128)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(x) - y) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss
  return repl, step_fn

x = np.random.RandomState(0).randn(64, 128).astype(np.float32)
dataset = tf.data.Dataset.from_tensors((x, x)).repeat()
def input_fn(ctx):
  return tf.data.Dataset.from_tensors((x[:16], x[:16])).repeat()
out = {}
for name, source in (("step_dataset", dataset), ("step_input_fn", input_fn)):
  repl, step_fn = setup(4)
  for _ in range(20):
    [t.numpy() for t in repl.run(step_fn, source)]
  times = []
  for _ in range(300):
    t0 = time.perf_counter()
    [t.numpy() for t in repl.run(step_fn, source)]
    times.append(time.perf_counter() - t0)
  out[name] = float(np.median(times))
repl, step_fn = setup(8)
t0 = time.perf_counter()
[t.numpy() for t in repl.run(step_fn, dataset)]
out["build_8"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
'''


def _run(path: str) -> dict:
  env = dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="2")
  process = subprocess.run([sys.executable, "-c", PROBE], cwd=path, env=env, capture_output=True, text=True,
                           timeout=900)
  lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
  if not lines:
    raise RuntimeError(f"probe failed in {path}:\n{process.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", required=True, help="the commit to compare with")
  parser.add_argument("--repeats", type=int, default=4)
  args = parser.parse_args(argv)
  root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
  with tempfile.TemporaryDirectory() as tmp:
    base = os.path.join(tmp, "base")
    subprocess.run(["git", "worktree", "add", "--detach", base, args.base], cwd=root, check=True, capture_output=True)
    try:
      runs: dict[str, list[dict]] = {"base": [], "current": []}
      for i in range(args.repeats):
        for name, path in (("base", base), ("current", root)) if i % 2 == 0 else (("current", root), ("base", base)):
          runs[name].append(_run(path))
          print(name, runs[name][-1], flush=True)
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", base], cwd=root, capture_output=True)
  summary = {}
  for key in runs["base"][0]:
    b = float(np.median([r[key] for r in runs["base"]]))
    c = float(np.median([r[key] for r in runs["current"]]))
    summary[key] = dict(base=b, current=c, ratio=c / b)
    print(f"{key:<14} base {b * 1e3:8.2f} ms  current {c * 1e3:8.2f} ms  current/base {c / b:.3f}")
  return summary


if __name__ == "__main__":
  main()
