"""``replicator.plan_pipeline``'s choice against measured steps (issue 57: the chosen within 10% of the best measured
on 8 devices; balancing puts the slowest stage within 15% of the mean on the uneven model).

The model: an MLP with wide layers at both ends (``WIDE`` units first and last, ``MIDDLE`` layers of ``NARROW``
between, as ``docs/concepts/stages.md``'s ``split_stages`` example, scaled up), Adam, a global batch of ``ROWS``
rows, on 8 logical CPUs (``replicator.virtual_cpus(8)``) of this machine.

* Choice: every candidate of the grid ``p`` in {1, 2, 4, 8} stages x ``b = 8 / p`` batch replicas, ``m`` in
  {1, 2, 4, 8} microbatches, GPipe and 1F1B (``p = 1``: the plain data-parallel step of the local view,
  ``wrap_optimizer``'s all-reduce; no microbatches) is priced by ``plan_pipeline(machine=replicator.calibrate())``
  and measured: a local-view step (``repl.pipeline`` with the plan's stages, ``split_stages(split_points=...)``,
  then ``wrap_optimizer``'s update), each candidate's median seconds over interleaved rounds (``_timing``: every
  round runs each once, the order shuffled). Reported: each candidate's measured and predicted seconds, the chosen
  one's measured time over the best measured (target at most 1.10), and the rank correlation.
* Balancing: ``split_stages(model, p, input_shape=(rows, ...))``'s stages balanced by the cost model's estimates
  (``costs="estimated"``, priced with the calibrated machine) and by measured layer costs (``costs="measured"``,
  each layer timed when the stages are cut), against stages of as many layers each (``np.array_split`` of the
  layers), each stage's forward and backward pass timed alone on one device (a ``tf.function`` of 4 passes in a
  chain; every stage of the three cuts, and each layer alone, in the same interleaved rounds, 30 at least): the
  slowest stage's median over the mean of the stages' (target at most 1.15), and two floors: the slowest layer
  alone over the measured cut's mean stage (no cut's slowest stage is faster than its slowest layer), and the
  least slowest / mean of any cut where a stage costs a pass's fixed cost plus its layers' measured costs.

Run by hand: ``python -m benchmarks.pipeline_plan [--quick] [--rounds 15] [--budget 240] [--stages 1,2,4,8]
[--microbatches 1,2,4,8] [--balance 2,3,4,8] [--balance-only] [--json F]`` (``--quick``: p in {1, 4}, m in {1,
4}, balance 4, 5 rounds; ``--balance-only``: the balancing alone, written into ``--json``'s file under
``"balance"`` and ``"balance_config"``, the rest of the file kept). About 4 minutes on 2 cores, most of it the 25
steps' builds; the balancing alone 48-92 s.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from benchmarks import _timing  # noqa: E402

DEVICES, ROWS, FEATURES, WIDE, NARROW, MIDDLE = 8, 128, 256, 1280, 256, 10  # docs/concepts/stages.md's, 4 times as wide


def uneven_model():
  """The uneven MLP: ``FEATURES -> WIDE -> NARROW -> MIDDLE x NARROW (tanh) -> WIDE -> 1`` (``MIDDLE + 4`` layers)."""
  import keras  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(0)
  layers = [keras.Input((FEATURES,)), keras.layers.Dense(WIDE, name="wide_in"), keras.layers.Dense(NARROW, name="in")]
  layers += [keras.layers.Dense(NARROW, activation="tanh", name=f"mid_{k}") for k in range(MIDDLE)]
  layers += [keras.layers.Dense(WIDE, name="wide_out"), keras.layers.Dense(1, name="head")]
  return keras.Sequential(layers, name="uneven")


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(ROWS, FEATURES)).astype("float32"), rng.normal(size=(ROWS, 1)).astype("float32")


def build_step(candidate, names):
  """A function running one training step of ``candidate`` (a ``PipelineCandidate``) on the 8 logical CPUs."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel
  import replicator  # pylint: disable=import-outside-toplevel

  p, b, m = candidate.stages, candidate.replicas, candidate.microbatches
  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:DEVICES]]
  shape = {"batch": b} if p == 1 else {"stage": p, "batch": b}
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=devices), batch_axes=("batch",))
  with repl.context():
    model = uneven_model()
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
  variables = model.trainable_variables
  x, y = _data()
  data = tf.data.Dataset.from_tensors((x, y)).repeat()
  if p == 1:
    def step(batch):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(batch[1], model(batch[0])))
      optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
      return loss
  else:
    stages = replicator.split_stages(model, split_points=[names[c] for c in candidate.cuts[1:]])

    def step(batch):
      loss, grads = repl.pipeline(stages, batch[0], batch[1], keras.losses.mean_squared_error, microbatches=m,
                                  schedule=candidate.schedule)
      optimizer.apply_gradients(zip(grads, variables))
      return loss

  def call():
    return repl.run(step, data)[0].numpy()

  return call


def _key(c) -> str:
  return f"p{c.stages}xb{c.replicas} m{c.microbatches} {c.schedule or 'data-parallel'}"


def measure_choice(machine, stages, microbatches, rounds: int, budget: float) -> dict:
  import replicator  # pylint: disable=import-outside-toplevel

  model = uneven_model()
  names = [layer.name for layer in model.layers]
  start = time.perf_counter()
  plan = replicator.plan_pipeline(model, DEVICES, input_shape=(ROWS, FEATURES), machine=machine, stages=stages,
                                  microbatches=microbatches, schedules=("gpipe", "1f1b"))
  plan_s = time.perf_counter() - start
  calls, builds = {}, {}
  for c in plan.candidates:
    call = build_step(c, names)
    builds[_key(c)], _ = _timing.timed(call)  # (the first call builds the step)
    calls[_key(c)] = call
  times = _timing.interleaved(calls, rounds, warmup=2, budget_seconds=budget)
  rows = []
  for c in plan.candidates:
    found = _timing.summary(times[_key(c)])
    rows.append({"candidate": _key(c), "stages": c.stages, "replicas": c.replicas, "microbatches": c.microbatches,
                 "schedule": c.schedule, "cuts": list(c.cuts), "predicted_s": c.seconds,
                 "predicted_path_s": c.path_seconds, "predicted_work_s": c.work_seconds,
                 "predicted_memory_bytes": c.memory_bytes, "measured_s": found, "build_s": builds[_key(c)]})
  best = min(rows, key=lambda r: r["measured_s"]["median"])
  chosen = rows[0]  # (the candidates come cheapest first)
  predicted = np.argsort(np.argsort([r["predicted_s"] for r in rows]))
  measured = np.argsort(np.argsort([r["measured_s"]["median"] for r in rows]))
  spearman = float(np.corrcoef(predicted, measured)[0, 1]) if len(rows) > 2 else None
  return {"plan_s": plan_s, "chosen": chosen["candidate"], "best_measured": best["candidate"],
          "chosen_over_best": chosen["measured_s"]["median"] / best["measured_s"]["median"],
          "rank_correlation": spearman, "candidates": rows}


def _stage_calls(stages, rows: int, name: str, repeats: int = 4) -> dict:
  """``{f"{name}/{s}": call}``: stage ``s``'s forward and backward pass on ``rows`` rows, ``repeats`` times in a
  chain (each pass's input waits for the previous pass's gradients: one at a time), on the first CPU."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  calls = {}
  shape = (rows, FEATURES)
  for s, stage in enumerate(stages):
    with tf.device("/device:CPU:0"):
      x = tf.constant(np.random.default_rng(s).normal(size=shape).astype("float32"))

    @tf.function
    def both(x=x, stage=stage):
      with tf.device("/device:CPU:0"):
        total = tf.zeros([])
        for _ in range(repeats):
          h = x + 0.0 * total
          with tf.GradientTape() as tape:
            tape.watch(h)
            y = stage(h, training=True)
          grads = tape.gradient(y, [h] + stage.trainable_variables)
          # (the output summed too: else a stage's last forward op is pruned where no gradient needs it, say a
          # Dense layer's without activation)
          total = tf.add_n([tf.reduce_sum(g) for g in grads] + [tf.reduce_sum(y)])
        return total

    calls[f"{name}/{s}"] = lambda both=both: both().numpy()
    shape = tuple(stage.compute_output_shape(shape))
  return calls


def _medians(times, name: str, count: int, repeats: int = 4) -> list[dict]:
  return [_timing.summary(np.asarray(times[f"{name}/{s}"]) / repeats) for s in range(count)]


def measure_balance(machine, counts, rows: int, rounds: int) -> dict:
  """Per stage count: the stages of each cut (``split_stages``' balanced by the cost model's estimates and by
  measured layer costs, and by layer count), every stage of the three cuts timed alone in the same interleaved
  rounds; first each layer alone (measured against its estimate and its measured cost: a stage's time is not its
  layers' alone-times' sum, each pass has a fixed cost of its own)."""
  import replicator  # pylint: disable=import-outside-toplevel
  from replicator.integrations import _keras_stages  # pylint: disable=import-outside-toplevel

  model = uneven_model()
  names = [layer.name for layer in model.layers]
  times = _timing.interleaved(_stage_calls(replicator.split_stages(model, split_points=names[1:]), rows, "layer"),
                              rounds, warmup=3)
  layer_s = [s["median"] for s in _medians(times, "layer", len(names))]
  estimated = _keras_stages.layer_costs(model.layers, (rows, FEATURES), machine=machine)
  start = time.perf_counter()
  measured = _keras_stages.measured_layer_costs(model.layers, (rows, FEATURES))
  # A pass's fixed cost, as the layers alone measure it over their measured costs (the empty pass taken out).
  fixed = float(np.median([a - m for a, m in zip(layer_s, measured)]))
  out = {"rows": rows, "layers": names, "layer_alone_s": layer_s, "layer_estimated_s": estimated,
         "layer_measured_s": measured, "measure_s": time.perf_counter() - start, "pass_fixed_s": fixed, "cuts": []}
  for p in counts:
    cuts = {"estimated": "estimated", "measured": "measured",
            "by_count": np.cumsum([len(a) for a in np.array_split(np.arange(len(names)), p)])[:-1]}
    calls, made = _stage_calls(replicator.split_stages(uneven_model(), split_points=names[1:]), rows, "alone"), {}
    for how, starts in cuts.items():
      model = uneven_model()
      if isinstance(starts, str):
        made[how] = replicator.split_stages(model, p, input_shape=(rows, FEATURES), costs=starts,
                                            machine=machine if starts == "estimated" else None)
      else:
        made[how] = replicator.split_stages(model, split_points=[names[k] for k in starts])
      calls.update(_stage_calls(made[how], rows, how))
    times = _timing.interleaved(calls, rounds, warmup=3)
    alone = [s["median"] for s in _medians(times, "alone", len(names))]
    record = {"stages": p, "layer_alone_s": alone}
    # The least slowest / mean of any cut where a stage costs a pass's fixed cost and its layers' measured costs
    # (the first measurement's: balanced_cuts' cut of them is the least slowest stage).
    starts = _keras_stages.balanced_cuts(measured, p)
    model_s = [fixed + sum(measured[a:b]) for a, b in zip(starts, starts[1:] + [len(names)])]
    record["additive_best"] = max(model_s) / float(np.mean(model_s))
    for how, stages in made.items():
      seconds = _medians(times, how, len(stages))
      medians = [s["median"] for s in seconds]
      record[how] = {"layers": [len(s.layers) for s in stages], "stage_s": seconds,
                     "slowest_over_mean": max(medians) / float(np.mean(medians))}
    # No cut's slowest stage is faster than its slowest layer alone, and the stages' total is about the same for
    # every cut of p stages (p passes' fixed costs and each layer's once): the least slowest / mean possible.
    record["bound"] = max(alone) / float(np.mean([s["median"] for s in record["measured"]["stage_s"]]))
    out["cuts"].append(record)
  return out


def _print_balance(balance) -> None:
  print(f"Balance ({balance['rows']} rows a stage, each stage's forward and backward pass alone on one device):")
  print("  layers alone (ms):    " + ", ".join(f"{s * 1e3:.3f}" for s in balance["layer_alone_s"]))
  print("  estimated (ms):       " + ", ".join(f"{s * 1e3:.3f}" for s in balance["layer_estimated_s"]))
  print("  measured costs (ms):  " + ", ".join(f"{s * 1e3:.3f}" for s in balance["layer_measured_s"]) +
        f" (measured in {balance['measure_s']:.1f} s)")
  for record in balance["cuts"]:
    print(f"  p = {record['stages']} slowest layer alone over the measured cut's mean stage {record['bound']:.3f}; "
          f"the best cut by the measured costs (a pass's fixed cost {balance['pass_fixed_s'] * 1e3:.3f} ms a "
          f"stage) {record['additive_best']:.3f}")
    for how in ("estimated", "measured", "by_count"):
      found = record[how]
      print(f"  p = {record['stages']} {how:10s} {str(found['layers']):26s} slowest / mean "
            f"{found['slowest_over_mean']:.3f} ({', '.join(_timing.ms(s['median']) for s in found['stage_s'])})")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="p in {1, 4}, m in {1, 4}, 5 rounds")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--budget", type=float, default=240.0, help="seconds of timed rounds at most")
  parser.add_argument("--stages", default=None, help="stage counts, as 1,2 (default: the grid's)")
  parser.add_argument("--microbatches", default=None, help="microbatch counts, as 1,2 (default: the grid's)")
  parser.add_argument("--balance", default=None, help="stage counts to balance, as 2,4 (default: 2,3,4,8)")
  parser.add_argument("--balance-only", action="store_true",
                      help="the balancing alone, merged into --json's file (its other keys kept)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import replicator  # pylint: disable=import-outside-toplevel
  replicator.virtual_cpus(DEVICES)
  load = [os.getloadavg()[0]]
  start = time.perf_counter()
  machine = replicator.calibrate(cache=False)
  stages, microbatches, rounds = ((1, 4), (1, 4), 5) if args.quick else ((1, 2, 4, 8), (1, 2, 4, 8), args.rounds)
  stages = tuple(int(p) for p in args.stages.split(",")) if args.stages else stages
  microbatches = tuple(int(m) for m in args.microbatches.split(",")) if args.microbatches else microbatches
  choice = None if args.balance_only else measure_choice(machine, stages, microbatches, rounds, args.budget)
  counts = (4,) if args.quick else (2, 3, 4, 8)
  counts = tuple(int(p) for p in args.balance.split(",")) if args.balance else counts
  balance = measure_balance(machine, counts, ROWS // 4, max(rounds, 30))
  load.append(os.getloadavg()[0])
  config = {"devices": DEVICES, "rows": ROWS, "features": FEATURES, "wide": WIDE, "narrow": NARROW,
            "middle": MIDDLE, "rounds": rounds, "quick": args.quick, "cores": os.cpu_count(),
            "tensorflow": tf.__version__, "load_average": load, "seconds": time.perf_counter() - start}
  print(f"Load average {load[0]:.2f} at start, {load[1]:.2f} at end; {config['seconds']:.0f} s.")
  if args.balance_only:
    results = {}
    if args.json and os.path.exists(args.json):
      with open(args.json, encoding="utf-8") as f:
        results = json.load(f)
    results.update({"balance": balance, "balance_config": dict(config, machine=dict(vars(machine)))})
  else:
    results = {"config": config, "machine": dict(vars(machine)), "choice": choice, "balance": balance}
    print(_timing.table(["candidate", "predicted", "measured (median)", "IQR", "build"],
                        [[r["candidate"], _timing.ms(r["predicted_s"]), _timing.ms(r["measured_s"]["median"]),
                          _timing.ms(r["measured_s"]["iqr"]), f"{r['build_s']:.1f} s"]
                         for r in choice["candidates"]]))
    print(f"chosen {choice['chosen']}, best measured {choice['best_measured']}: chosen / best "
          f"{choice['chosen_over_best']:.3f}; rank correlation {choice['rank_correlation']}")
  _print_balance(balance)
  _timing.save_json(results, args.json)
  return results


if __name__ == "__main__":
  main()
