"""Keras ``model.fit`` on N logical CPUs: one device, the Replicator, MirroredStrategy.

One process, the three configurations interleaved epoch by epoch (each timed
call is one epoch of ``fit`` over the same data, after a warm-up epoch that
builds the functions), so the ratios compare like with like on a noisy
machine. The model is the README's: ``Dense(1024, relu) -> Dense(10)`` on 64
features, Adam, global batch 256, ``steps_per_execution=1`` for the three
(MirroredStrategy's fit fails with ``steps_per_execution > 1`` on TF 2.21 and
Keras 3.15: "You must feed a value for placeholder tensor ... while/cond"),
and the Replicator again with ``steps_per_execution=8``.

``--sharded`` measures instead a model with sharded variables in the global
view on a 2x2 mesh (the first kernel split over "model" by columns, the
second by rows, batch over "batch"): Keras's ``fit`` of it against
``repl.run`` of the same training step written by hand over the same global
batches, both 8 steps per call, so the ratio is what Keras's trainer adds
around the partitioned step; and the same pair on one device (``fit`` against
a ``tf.function`` of 8 steps), what Keras's trainer adds there.

Run by hand: ``python -m benchmarks.keras_fit --devices 4 [--sharded] [--rounds 8] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402
from benchmarks import _timing  # noqa: E402


def _model(keras, features: int, steps_per_execution: int = 1, prefix: str = ""):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((features,)),
                            keras.layers.Dense(1024, activation="relu", name=f"{prefix}hidden"),
                            keras.layers.Dense(10, name=f"{prefix}out")])
  model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"], steps_per_execution=steps_per_execution)
  return model


def _measure(calls: dict, rounds: int, steps: int, ratios: dict, **fields) -> dict:
  """Times ``calls`` (one epoch of ``steps`` steps each) interleaved; prints and returns per-step medians and ratios.

  ``ratios``: record key -> (numerator call, denominator call), paired round by round.
  """
  times = _timing.interleaved(calls, rounds=rounds, warmup=1, per_call={k: steps for k in calls})
  record = dict(fields, steps_per_epoch=steps,
                step_ms={k: _timing.summary(v)["median"] * 1e3 for k, v in times.items()})
  for key, (a, b) in ratios.items():
    record[key] = _timing.paired_ratio(times[a], times[b])
  print(_timing.table(["per step", "median"], [[k, _timing.ms(_timing.summary(v)["median"])] for k, v in times.items()]))
  print(", ".join(f"{a} / {b} {_timing.interval(record[key])}" for key, (a, b) in ratios.items()))
  return record


def sharded(keras, tf, x, y, args) -> dict:
  """Global view, 2x2: ``fit`` against ``repl.run`` of the same step (8 steps per call each)."""
  import mesh  # pylint: disable=import-outside-toplevel
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=[f"/device:CPU:{i}" for i in range(4)])
  layouts = mesh.LayoutMap({r"hidden/kernel$": (None, "model"), r"hidden/bias$": ("model",),
                            r"out/kernel$": ("model", None)})
  repl = replicator.Replicator(mesh=m, layouts=layouts, batch_axes=("batch",), view="global")
  with repl.context():
    fitted = _model(keras, 64, steps_per_execution=8, prefix="fitted_")
    custom = _model(keras, 64, prefix="custom_")
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size, drop_remainder=True)
  steps = args.rows // args.batch_size
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def train_step(model):
    def step_fn(batch):  # what Keras's train_step does, less its metrics
      features, labels = batch
      with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(features, training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return step_fn

  step_fn = train_step(custom)
  repeated = data.repeat()  # repl.run keeps its iterator across calls

  def run_epoch():
    for _ in range(steps // 8):
      repl.run(step_fn, repeated, steps=8)

  # The same pair on one device: what Keras's trainer adds around a step without the Replicator.
  one_fitted = _model(keras, 64, steps_per_execution=8, prefix="one_fitted_")
  one_step = train_step(_model(keras, 64, prefix="one_"))

  @tf.function
  def one_device_steps(iterator):
    for _ in tf.range(8):
      one_step(next(iterator))

  one_iterator = iter(repeated)

  def one_epoch():
    for _ in range(steps // 8):
      one_device_steps(one_iterator)

  calls = {"fit, global view": lambda: fitted.fit(data, epochs=1, verbose=0), "repl.run, global view": run_epoch,
           "fit, one device": lambda: one_fitted.fit(data, epochs=1, verbose=0), "tf.function, one device": one_epoch}
  return _measure(calls, args.rounds, steps, mesh="2x2", rows=args.rows, batch_size=args.batch_size,
                  ratios={"fit_over_run": ("fit, global view", "repl.run, global view"),
                          "one_device_fit_over_loop": ("fit, one device", "tf.function, one device")})


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--rows", type=int, default=8192)
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--sharded", action="store_true", help="global view, 2x2: fit against repl.run")
  parser.add_argument("--json", help="write the record here")
  args = parser.parse_args(argv)
  replicator.virtual_cpus(args.devices)
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  x = rng.standard_normal((args.rows, 64)).astype(np.float32)
  y = rng.integers(0, 10, args.rows)
  record = sharded(keras, tf, x, y, args) if args.sharded else data_parallel(keras, tf, x, y, args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(record, f, indent=1)
  return record


def data_parallel(keras, tf, x, y, args) -> dict:
  """One device, the Replicator (1 and 8 steps per call) and MirroredStrategy, each fitting the same model."""
  devices = [f"/device:CPU:{i}" for i in range(args.devices)]

  one = _model(keras, 64)
  repl = replicator.Replicator(devices)
  with repl.context():
    ours = _model(keras, 64)
    ours8 = _model(keras, 64, steps_per_execution=8)
  mirrored = tf.distribute.MirroredStrategy(devices)
  with mirrored.scope():
    ms = _model(keras, 64)

  def epoch(model):
    return lambda: model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0)

  steps = -(-args.rows // args.batch_size)
  calls = {"one device": epoch(one), "replicator": epoch(ours), "MirroredStrategy": epoch(ms),
           "replicator, steps_per_execution=8": epoch(ours8)}
  return _measure(calls, args.rounds, steps, devices=args.devices, rows=args.rows, batch_size=args.batch_size,
                  ratios={"ours_over_one_device": ("replicator", "one device"),
                          "ours_over_mirrored": ("replicator", "MirroredStrategy"),
                          "ours8_over_one_device": ("replicator, steps_per_execution=8", "one device")})


if __name__ == "__main__":
  main()
