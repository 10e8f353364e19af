"""Pipelines' builds against the plain step's build of the same model (issue 57: at most 2x; the stacked form's
build not growing with the microbatches).

Each build is the first ``repl.run`` of a training step (trace, partition or per-replica tracing, import,
TensorFlow's first call) in a fresh process on 4 logical CPUs, the variants alternated round by round (a
machine's speed drifts; the ratio of neighbours does not). The model: ``BLOCKS`` residual MLP blocks of width
``WIDTH`` between an input and an output layer, Adam.

- ``local_pipeline``: the local view, ``repl.pipeline`` over ``{"stage": 4}``, one block a stage of its layers
  (Keras ``Sequential`` s), 1F1B, 8 microbatches (the schedule unrolled: 64 passes and their sends);
- ``local_plain``: the same model's data-parallel step on ``{"batch": 4}`` (the local view);
- ``stacked_m2`` / ``stacked_m8``: the global view, the blocks stacked over ``{"stage": 4}``
  (``replicator.StackedBlocks``, 2 or 8 microbatches);
- ``global_plain``: the global view, the blocks in a row, data parallel on ``{"batch": 4}``.

Run by hand: ``python -m benchmarks.pipeline_build [--rounds 3] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import _timing

VARIANTS = ("local_pipeline", "local_plain", "stacked_m2", "stacked_m8", "global_plain")
BLOCKS, WIDTH, FEATURES, ROWS = 4, 128, 32, 64


def _residual():
  import keras  # pylint: disable=import-outside-toplevel

  class Residual(keras.layers.Layer):
    def __init__(self, width, **kwargs):
      super().__init__(**kwargs)
      self.norm = keras.layers.LayerNormalization()
      self.up = keras.layers.Dense(2 * width, activation="tanh")
      self.down = keras.layers.Dense(width)

    def call(self, x):
      return x + self.down(self.up(self.norm(x)))

  return Residual


def _child(variant: str) -> dict:
  import mesh  # pylint: disable=import-outside-toplevel
  mesh.virtual_cpus(4)
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import replicator  # pylint: disable=import-outside-toplevel
  residual = _residual()
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
  y = rng.normal(size=(ROWS, 1)).astype("float32")
  data = tf.data.Dataset.from_tensors((x, y)).repeat()
  if variant.startswith("local"):
    pipelined = variant == "local_pipeline"
    repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 4} if pipelined else {"batch": 4}),
                                 batch_axes=() if pipelined else ("batch",))
    with repl.context():
      stages = [keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(WIDTH), residual(WIDTH)])]
      stages += [keras.Sequential([keras.Input((WIDTH,)), residual(WIDTH)]) for _ in range(BLOCKS - 2)]
      stages += [keras.Sequential([keras.Input((WIDTH,)), residual(WIDTH), keras.layers.Dense(1)])]
      optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
    variables = replicator.pipeline_variables(stages)

    def step(batch):
      inputs, targets = batch
      if variant == "local_pipeline":
        loss, grads = repl.pipeline(stages, inputs, targets, keras.losses.mean_squared_error, microbatches=8)
      else:
        with tf.GradientTape() as tape:
          h = inputs
          for stage in stages:
            h = stage(h)
          loss = tf.reduce_mean(keras.losses.mean_squared_error(targets, h))
        grads = tape.gradient(loss, variables)
      optimizer.apply_gradients(zip(grads, variables))
      return loss

    def run():
      return float(repl.reduce("mean", repl.run(step, data)))
  else:
    shape = {"batch": 4} if variant == "global_plain" else {"stage": 4}
    repl = replicator.Replicator(mesh=mesh.Mesh(shape), view="global",
                                 layouts=mesh.LayoutMap({r"^blocks/": ("stage",)}, pad=True),
                                 batch_axes=("batch",) if variant == "global_plain" else ())
    with repl.context():
      inputs = keras.Input((FEATURES,))
      h = keras.layers.Dense(WIDTH)(inputs)
      if variant == "global_plain":
        for _ in range(BLOCKS):
          h = residual(WIDTH)(h)
      else:
        h = replicator.StackedBlocks(residual(WIDTH), stages=BLOCKS, microbatches=int(variant[-1]), name="blocks")(h)
      model = keras.Model(inputs, keras.layers.Dense(1)(h))
      optimizer = keras.optimizers.Adam(1e-3)

    def step(batch):
      inputs, targets = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(targets, model(inputs)))
      optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
      return loss

    def run():
      return float(repl.run(step, data))
  start, cpu = time.perf_counter(), time.process_time()
  loss = run()
  return {"build_s": time.perf_counter() - start, "build_cpu_s": time.process_time() - cpu, "loss": loss}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--json", default=None)
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(_child(args.child)))
    return {}
  builds = _timing.fresh_builds("benchmarks.pipeline_build", {v: [v] for v in VARIANTS}, args.rounds)

  def ratios(a, b):
    found = _timing.round_ratios(builds[a], builds[b])
    return {"per_round": found, "median": found[len(found) // 2]}

  results = {"builds_s": builds, "local_pipeline / local_plain": ratios("local_pipeline", "local_plain"),
             "stacked_m8 / stacked_m2": ratios("stacked_m8", "stacked_m2"),
             "stacked_m8 / global_plain": ratios("stacked_m8", "global_plain")}
  for variant in VARIANTS:
    print(f"{variant:16s} {', '.join(f'{s:.2f}' for s in builds[variant])} s")
  for name in ("local_pipeline / local_plain", "stacked_m8 / stacked_m2", "stacked_m8 / global_plain"):
    print(f"{name}: per round {', '.join(f'{x:.2f}' for x in results[name]['per_round'])} "
          f"(median {results[name]['median']:.2f})")
  _timing.save_json(results, args.json)
  return results


if __name__ == "__main__":
  main()
