"""The cost of all-or-nothing steps: ``Replicator(atomic=True)`` (the default) against ``atomic=False``.

A step that fails writes no variable because every variable it writes is kept
at the start of each call (``replicator/guarantees/_atomic.py``): one read per written
component, and a copy of its buffer at its first in-place update. This
measures what that costs, in one process, the two configurations interleaved
round by round (``_timing.interleaved``), for:

* ``local``: the local view, a 4-layer MLP (width ``--width``) with Keras
  Adam, ``wrap_optimizer``, 4 replicas (mesh batch:4);
* ``global``: the global view on a 2x2 mesh, the same MLP with its kernels
  split over "model" (Megatron style: columns, rows, columns, rows), Keras Adam;

each one step per call and ten steps per call (``steps=10``, one copy per call).
The extra memory is one copy of what the step writes while a call runs
(weights, Adam's two slots, counters), reported per device from the
variables' sizes (``replicator.bytes_per_device``).

Run by hand: ``python -m benchmarks.atomic [--rounds 30] [--width 1024] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402
from benchmarks import _timing  # noqa: E402


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  replicator.virtual_cpus(4)
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel

  x = np.random.RandomState(0).rand(args.batch * 4, args.width).astype(np.float32)
  y = np.random.RandomState(1).rand(args.batch * 4, 1).astype(np.float32)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True).repeat()
  layouts = {"d0/kernel": (None, "model"), "d1/kernel": ("model", None),
             "d2/kernel": (None, "model"), "d3/kernel": ("model", None)}

  def setup(view, atomic):
    m = mesh.Mesh({"batch": 2, "model": 2}) if view == "global" else mesh.Mesh({"batch": 4})
    repl = replicator.Replicator(mesh=m, view=view, atomic=atomic, layouts=layouts if view == "global" else None)
    with repl.context():
      keras.utils.set_random_seed(0)
      model = keras.Sequential([keras.Input([args.width])]
                               + [keras.layers.Dense(args.width, activation="relu", name=f"d{i}") for i in range(3)]
                               + [keras.layers.Dense(1, name="d3")])
      opt = keras.optimizers.Adam(1e-4)
      if view == "local":
        opt = repl.wrap_optimizer(opt)

    def step(batch):
      features, labels = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(features) - labels) ** 2)
      opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
      return loss

    repl.run(step, dataset)  # builds; the slots exist
    written = max(replicator.bytes_per_device(model.variables + opt.variables).values())
    return repl, step, written

  records = []
  for view, steps in (("local", 1), ("local", 10), ("global", 1), ("global", 10)):
    calls, written = {}, 0
    for atomic in (True, False):
      repl, step, written = setup(view, atomic)
      calls[f"atomic={atomic}"] = lambda repl=repl, step=step, steps=steps: repl.run(step, dataset, steps=steps)
    times = _timing.interleaved(calls, rounds=args.rounds, warmup=2, per_call={k: steps for k in calls})
    ratio = _timing.paired_ratio(times["atomic=True"], times["atomic=False"])
    record = dict(view=view, steps_per_call=steps, width=args.width, batch=args.batch,
                  written_bytes_per_device=int(written),
                  step_ms={k: _timing.summary(v)["median"] * 1e3 for k, v in times.items()}, ratio=ratio)
    records.append(record)
    print(f"{view} view, steps={steps}: " + ", ".join(f"{k} {_timing.ms(v / 1e3)}" for k, v in
                                                       record["step_ms"].items())
          + f"; atomic / not {_timing.interval(ratio)}")
  print(_timing.table(["view", "steps per call", "atomic=True", "atomic=False", "ratio [95% CI]",
                       "kept while a call runs"],
                      [[r["view"], r["steps_per_call"], f"{r['step_ms']['atomic=True']:.2f} ms",
                        f"{r['step_ms']['atomic=False']:.2f} ms", _timing.interval(r["ratio"]),
                        f"{r['written_bytes_per_device'] / 2**20:.1f} MiB"] for r in records]))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(dict(records=records), f, indent=1)
  return dict(records=records)


if __name__ == "__main__":
  main()
