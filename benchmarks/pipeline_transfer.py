"""Between worker processes: a permute as point-to-point pairs against the all-gather it replaced.

A multi-client job (every worker runs this script, started by ``python -m replicator.launch``), one device a
worker, the stage axis over the workers. Two lowerings of the same ``permute`` (``rewrite.CollectiveOps``):

* ``pairs`` (the default): each (source, destination) pair is a two-member group, ``CollectiveBcastSendV2`` on
  the source and ``CollectiveBcastRecvV2`` on the destination: a value crosses once;
* ``gather`` (before): a ``CollectiveGatherV2`` of every member's value over the whole axis, each destination
  taking its source's: with ``w`` workers each value crosses ``w - 1`` times.

Two steps in each job, timed in turn (interleaved rounds, medians of worker 0):

* ``shift``: ``repl.permute`` of a ``[rows, width]`` float32 value from each worker to the next (``w - 1`` pairs:
  a pipeline's activations going forward), nothing else;
* ``pipeline``: ``repl.pipeline`` with a stage a worker (``Dense(width, tanh)`` x ``depth`` each, the last with a
  ``Dense(1)`` head), ``m`` microbatches, 1F1B, its gradients applied by SGD: ``2 m`` permutes a step.

Each lowering runs in fresh processes (a run per lowering per round, alternated). The workers share this
machine's cores, so this compares the bytes moved and the collective runtime's work, not a network's bandwidth.

Run by hand: ``python -m benchmarks.pipeline_transfer [--workers 2,4] [--rounds 3] [--steps 20] [--rows 512]
[--width 512] [--json F]``. The ``gather`` lowering is selected by a subclass of ``MultiWorkerReplicator`` here
(its lowerings' hook): a comparison only, not an option users need.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402


def _replicator(permute: str):
  """The job's Replicator from TF_CONFIG, its collective_ops lowering's permute ``permute``."""
  import dataclasses

  import rewrite

  class Compared(replicator.MultiWorkerReplicator):

    def _configured(self, config):
      config = super()._configured(config)
      ops = config.lowerings["collective_ops"]
      lowerings = dict(config.lowerings, collective_ops=rewrite.CollectiveOps(
          ops.timeout_seconds, agreed_keys=True, permute=permute))
      return dataclasses.replace(config, lowerings=lowerings)

  return Compared.from_tf_config(batch_axes=())


def _child(permute: str, rows: int, width: int, depth: int, microbatches: int, steps: int) -> None:
  """One worker: both steps built, then ``steps`` timed calls of each in turn; worker 0 prints JSON."""
  repl = _replicator(permute)  # before any other TensorFlow op
  import keras
  import tensorflow as tf
  workers = repl.num_replicas
  keras.utils.set_random_seed(0)
  with repl.context():
    stages = [keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="tanh")
                                                          for _ in range(depth)]) for _ in range(workers)]
    stages[-1].add(keras.layers.Dense(1))
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(1e-3))
  variables = replicator.pipeline_variables(stages)
  shift = [(s, s + 1) for s in range(workers - 1)]
  x = tf.ones([rows, width])
  y = tf.zeros([rows, 1])

  def shift_step():
    return tf.reduce_sum(repl.permute(x, axis="worker", perm=shift)[:1, :1])

  def pipeline_step():
    loss, grads = repl.pipeline(stages, x, y, keras.losses.mean_squared_error, axis="worker",
                                microbatches=microbatches, schedule="1f1b")
    optimizer.apply_gradients(zip(grads, variables))
    return loss

  steps_by_name = {"shift": shift_step, "pipeline": pipeline_step}
  builds = {}
  for name, step in steps_by_name.items():
    start = time.perf_counter()
    repl.run(step)
    builds[name] = time.perf_counter() - start
    repl.run(step)
  times = {name: [] for name in steps_by_name}
  for _ in range(steps):
    for name, step in steps_by_name.items():
      start = time.perf_counter()
      repl.run(step)
      times[name].append(time.perf_counter() - start)
  if repl.task == 0:
    print("RESULT " + json.dumps({name: dict(step_ms=statistics.median(t) * 1e3, build_s=builds[name])
                                  for name, t in times.items()}), flush=True)


def run(workers: list[int], rounds: int, steps: int, rows: int, width: int, depth: int, microbatches: int) -> dict:
  """Every lowering at every number of workers, ``rounds`` fresh jobs each, alternated; worker 0's medians."""
  from benchmarks.multiworker import _result  # pylint: disable=protected-access
  out = dict(rows=rows, width=width, depth=depth, microbatches=microbatches, steps=steps, value_bytes=rows * width * 4,
             runs={})
  for w in workers:
    found = {"pairs": [], "gather": []}
    for _ in range(rounds):
      for permute in found:
        found[permute].append(_result(["-m", "benchmarks.pipeline_transfer", "--child", permute, "--rows", str(rows),
                                       "--width", str(width), "--depth", str(depth), "--microbatches",
                                       str(microbatches), "--steps", str(steps)], workers=w))
    row = {}
    for name in ("shift", "pipeline"):
      pairs = [r[name]["step_ms"] for r in found["pairs"]]
      gather = [r[name]["step_ms"] for r in found["gather"]]
      row[name] = dict(pairs_ms=pairs, gather_ms=gather, ratios=[a / b for a, b in zip(pairs, gather)],
                       ratio=statistics.median(pairs) / statistics.median(gather))
      print(f"{w} workers, {name}: pairs {statistics.median(pairs):.2f} ms, gather {statistics.median(gather):.2f} ms, "
            f"pairs / gather {row[name]['ratio']:.2f} (rounds {', '.join(f'{r:.2f}' for r in row[name]['ratios'])})",
            flush=True)
    out["runs"][str(w)] = row
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", default="2,4")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--rows", type=int, default=512)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--depth", type=int, default=1)
  parser.add_argument("--microbatches", type=int, default=4)
  parser.add_argument("--json", default=None)
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    _child(args.child, args.rows, args.width, args.depth, args.microbatches, args.steps)
    sys.stdout.flush()
    os._exit(0)  # skip TensorFlow's teardown of the collective runtime
  out = run([int(w) for w in args.workers.split(",")], args.rounds, args.steps, args.rows, args.width, args.depth,
            args.microbatches)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
