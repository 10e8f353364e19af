"""Part 1: step time of one training step, single device vs replicator vs MirroredStrategy.

Every configuration trains the same Keras 3 model (same initial weights) with
Keras 3 Adam on the same synthetic global batch, repeated by a ``tf.data``
dataset, and reads its input from that dataset inside its compiled step:

* ``single device``: a ``tf.function`` step on CPU:0 on the full global batch.
* ``replicator``: ``repl.run(step_fn, dataset)`` (global batches split in the
  step's graph), one step per call; ``replicator steps=10``: ten steps per
  call (an in-graph loop), reported per step.
* ``MirroredStrategy``: ``strategy.run`` inside a ``tf.function`` over an
  iterator of ``strategy.experimental_distribute_dataset``, default
  cross-device ops; ``MirroredStrategy R2OD``: the same with
  ``cross_device_ops=tf.distribute.ReductionToOneDevice()``.

Before timing, every configuration runs the same few steps from the same
weights, and the parameters are compared with the single device's.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

import replicator
from benchmarks import _timing
from benchmarks import models as models_lib

SINGLE = "single device"
OURS = "replicator"
OURS_10 = "replicator steps=10"
MS = "MirroredStrategy"
MS_R2OD = "MirroredStrategy R2OD"
CONFIGS = (SINGLE, OURS, OURS_10, MS, MS_R2OD)
CHECK_STEPS = 3  # steps every configuration runs before the parameters are compared
_KEY_BASES = itertools.count(1_000_000, 10_000)


@dataclasses.dataclass
class Setup:
  """A configuration ready to run: one call (and how many steps it runs), and its model."""

  call: Callable[[], float]  # runs one call and returns a loss (a float, so the call has finished)
  model: keras.Model
  steps_per_call: int = 1
  info: dict = dataclasses.field(default_factory=dict)


def _mean(per_replica) -> float:
  """The mean of per-replica losses (the global-batch loss when the batch splits evenly); waits for them."""
  return float(np.mean([t.numpy() for t in per_replica]))


def _dataset(x, y) -> tf.data.Dataset:
  return tf.data.Dataset.from_tensors((x, y)).repeat()


def _sgd_step(spec, model, optimizer, loss_scale=1.0, barrier=False):
  """The per-replica step body: forward, backward, update. Returns the unscaled loss.

  ``barrier``: no gradient leaves before the whole backward pass is done (a
  lever's baseline: without it each gradient's all-reduce may start as soon
  as that gradient exists, overlapping the rest of the backward pass).
  """

  def step(x, y):
    with tf.GradientTape() as tape:
      loss = spec.loss(y, model(x, training=True))
      scaled = loss * loss_scale
    grads = tape.gradient(scaled, model.trainable_variables)
    if barrier:
      with tf.control_dependencies(grads):
        grads = [tf.identity(g) for g in grads]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step


def adam() -> keras.optimizers.Optimizer:
  """The benchmarks' optimizer: Keras 3 Adam, learning rate 1e-3."""
  return keras.optimizers.Adam(1e-3)


def single_device(spec: models_lib.Model, weights, x, y, make_optimizer=adam, device: str = "/device:CPU:0") -> Setup:
  """The step in a ``tf.function`` on ``device`` (CPU:0 by default), on the full global batch."""
  with tf.device(device):
    model = spec.build()
    model.set_weights(weights)
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
  with tf.device("/device:CPU:0"):  # the input pipeline on the host
    iterator = iter(_dataset(x, y).prefetch(2))
  body = _sgd_step(spec, model, optimizer)

  @tf.function
  def train_step(iterator):
    with tf.device(device):
      return body(*next(iterator))

  return Setup(lambda: float(train_step(iterator)), model)


def ours(spec: models_lib.Model, weights, x, y, devices, steps: int = 1, shared: Setup | None = None,
         barrier: bool = False, make_optimizer=adam, implementation: str = "auto", **wrap_kwargs) -> Setup:
  """The replicator's step; with ``shared``, another call pattern of that setup's step (same model).

  ``barrier``: see :func:`_sgd_step`. ``implementation``: the Replicator's
  lowering by name. ``wrap_kwargs`` go to ``wrap_optimizer`` (defaults: the
  library's).
  """
  if shared is not None:
    repl, step_fn, dataset = shared.info["repl"], shared.info["step_fn"], shared.info["dataset"]
    return Setup(lambda: _mean(repl.run(step_fn, dataset, steps=steps)), shared.model, steps, shared.info)
  repl = replicator.Replicator(devices=devices, implementation=implementation)
  with repl.context():
    model = spec.build()
    optimizer = repl.wrap_optimizer(make_optimizer(), **wrap_kwargs)
    optimizer.build(model.trainable_variables)
  model.set_weights(weights)
  body = _sgd_step(spec, model, optimizer, barrier=barrier)

  def step_fn(batch):
    return body(*batch)

  dataset = _dataset(x, y)
  info = dict(repl=repl, step_fn=step_fn, dataset=dataset)
  return Setup(lambda: _mean(repl.run(step_fn, dataset, steps=steps)), model, steps, info)


def mirrored_strategy(devices, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
  """A MirroredStrategy whose collective group keys no other strategy (or the replicator) uses.

  On CPUs its default cross-device ops are ``CollectiveAllReduce`` (RING), and
  every MirroredStrategy numbers its groups from key 1: a second strategy on
  another device set reuses group key 1 with another size, which aborts the
  process's collective executor ("joining a group with size 8, but that group
  has size 2"; TF 2.21). The class attribute ``_collective_key_base`` (TF:
  "only set this in tests") moves each strategy's keys to a range of its own.
  """
  tf.distribute.MirroredStrategy._collective_key_base = next(_KEY_BASES)  # pylint: disable=protected-access
  return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)


def mirrored(spec: models_lib.Model, weights, x, y, devices, cross_device_ops=None, make_optimizer=adam) -> Setup:
  strategy = mirrored_strategy(devices, cross_device_ops)
  with strategy.scope():
    model = spec.build()
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
  model.set_weights(weights)
  # Keras 3 all-reduces gradients with SUM under a strategy: scale each
  # replica's mean loss by 1/replicas so the update is the global-batch mean's.
  body = _sgd_step(spec, model, optimizer, loss_scale=1.0 / strategy.num_replicas_in_sync)
  iterator = iter(strategy.experimental_distribute_dataset(_dataset(x, y)))

  @tf.function
  def train_step(iterator):
    return strategy.run(body, args=next(iterator))

  return Setup(lambda: _mean(strategy.experimental_local_results(train_step(iterator))), model,
               info=dict(strategy=strategy, cross_device_ops=cross_device_ops_name(strategy)))


def cross_device_ops_name(strategy) -> str:
  """The class of the cross-device ops a MirroredStrategy uses (explicit or inferred)."""
  extended = strategy.extended
  ops = getattr(extended, "_cross_device_ops", None) or getattr(extended, "_inferred_cross_device_ops", None)
  name = type(ops).__name__
  options = getattr(extended, "_communication_options", None)
  if name == "CollectiveAllReduce" and options is not None:
    name += f"({options.implementation.name})"
  return name


def replica_params(model: keras.Model) -> list[list[np.ndarray]]:
  """Every trainable variable's value on every device: ``[variable][device]``."""
  out = []
  for v in model.trainable_variables:
    tv = getattr(v, "value", v)
    if hasattr(tv, "components"):  # replicator.ReplicatedVariable
      out.append([c.numpy() for c in tv.components])
    elif hasattr(tv, "values"):  # tf.distribute MirroredVariable
      out.append([c.numpy() for c in tv.values])
    else:
      out.append([tv.numpy()])
  return out


def _max_difference(a, b) -> float:
  return max(float(np.max(np.abs(x - y))) for xs, ys in zip(a, b) for x in xs for y in ys)


def measure_model(spec: models_lib.Model, devices, rounds: int, budget_seconds: float, log=print) -> dict:
  """Builds every configuration, checks they agree, times them interleaved; returns the model's record."""
  keras.utils.set_random_seed(0)
  with tf.device("/device:CPU:0"):
    weights = spec.build().get_weights()
  x, y = spec.batch()
  setups = {SINGLE: single_device(spec, weights, x, y)}
  setups[OURS] = ours(spec, weights, x, y, devices)
  setups[OURS_10] = ours(spec, weights, x, y, devices, steps=10, shared=setups[OURS])
  setups[MS] = mirrored(spec, weights, x, y, devices)
  setups[MS_R2OD] = mirrored(spec, weights, x, y, devices, tf.distribute.ReductionToOneDevice())

  # Correctness: the same steps from the same weights (first calls also build the steps).
  check_names = [SINGLE, OURS, MS, MS_R2OD]
  losses = {name: [setups[name].call() for _ in range(CHECK_STEPS)] for name in check_names}
  params = {name: replica_params(setups[name].model) for name in check_names}
  check = {name: dict(losses=losses[name],
                      max_abs_param_diff_vs_single=_max_difference(params[name], params[SINGLE]),
                      max_abs_param_diff_across_replicas=_max_difference(params[name], [p[:1] for p in params[name]]))
           for name in check_names}
  for name in check_names:
    log(f"  check {name:<24} losses {', '.join(f'{v:.6f}' for v in losses[name])}  "
        f"max|param - single| {check[name]['max_abs_param_diff_vs_single']:.2e}")

  plan = setups[OURS].info["repl"].explain(setups[OURS].info["step_fn"], setups[OURS].info["dataset"])
  times = _timing.interleaved({name: s.call for name, s in setups.items()}, rounds, warmup=1,
                              per_call={name: s.steps_per_call for name, s in setups.items()},
                              every={OURS_10: 3},  # a call is 10 steps: time every 3rd round
                              budget_seconds=budget_seconds)
  stats = {name: _timing.summary(t) for name, t in times.items()}
  best = min((MS, MS_R2OD), key=lambda name: stats[name]["median"])  # MS on a tie, as before
  best_ms = stats[best]["median"]
  record = dict(
      model=spec.name, description=spec.description, global_batch=spec.global_batch,
      parameters=int(sum(np.prod(w.shape) for w in weights)), devices=list(devices),
      mirrored_default_cross_device_ops=setups[MS].info["cross_device_ops"],
      collectives=len(plan.collectives), bytes_per_step=plan.bytes_per_step,
      collectives_by_kind={k: sum(c.kind == k for c in plan.collectives)
                           for k in sorted({c.kind for c in plan.collectives})},
      check=check, times_s=times, stats=stats,
      ratios=dict(ours_over_mirrored_best=stats[OURS]["median"] / best_ms,
                  ours_over_single=stats[OURS]["median"] / stats[SINGLE]["median"],
                  ours10_over_mirrored_best=stats[OURS_10]["median"] / best_ms,
                  ours10_over_single=stats[OURS_10]["median"] / stats[SINGLE]["median"]),
      # Per-round ratios (both timed in the same round): drift cancels.
      paired=dict(mirrored_best=best,
                  ours_over_mirrored_best=_timing.paired_ratio(times[OURS], times[best]),
                  ours_over_single=_timing.paired_ratio(times[OURS], times[SINGLE])))
  del setups
  gc.collect()
  return record


def run(devices, model_names=None, rounds: int = 30, budget_seconds: float = 60.0, log=print) -> list[dict]:
  """Measures every model; prints one line per configuration."""
  records = []
  for spec in models_lib.MODELS:
    if model_names and spec.name not in model_names:
      continue
    log(f"step time: {spec.name} ({spec.description}, global batch {spec.global_batch}) on {len(devices)} devices")
    record = measure_model(spec, devices, rounds, budget_seconds, log)
    for name in CONFIGS:
      s = record["stats"][name]
      log(f"  {name:<24} median {_timing.ms(s['median']):>9}  IQR {_timing.ms(s['iqr']):>9}  n={s['n']}")
    r = record["ratios"]
    p = record["paired"]
    log(f"  ours/MS(best) {r['ours_over_mirrored_best']:.2f}  ours/single {r['ours_over_single']:.2f}  "
        f"(steps=10: {r['ours10_over_mirrored_best']:.2f}, {r['ours10_over_single']:.2f}); per round: "
        f"{_timing.interval(p['ours_over_mirrored_best'])} and {_timing.interval(p['ours_over_single'])}")
    records.append(record)
  return records


def markdown(records: list[dict]) -> str:
  """The step-time table and the ratio table."""
  rows = []
  for rec in records:
    for name in CONFIGS:
      s = rec["stats"][name]
      diff = rec["check"].get(name, {}).get("max_abs_param_diff_vs_single")
      rows.append([rec["model"], name, _timing.ms(s["median"]), _timing.ms(s["iqr"]), s["n"],
                   "" if diff is None else f"{diff:.1e}"])
  steps = _timing.table(["model", "configuration", "median step", "IQR", "n", "max abs param diff vs single"],
                        rows, "llrrrr")
  ratio_rows = [[rec["model"], f"{rec['ratios']['ours_over_mirrored_best']:.2f}",
                 f"{rec['ratios']['ours_over_single']:.2f}", f"{rec['ratios']['ours10_over_mirrored_best']:.2f}",
                 f"{rec['ratios']['ours10_over_single']:.2f}", ", ".join(f"{v} {k}" for k, v in rec["collectives_by_kind"].items()),
                 f"{rec['bytes_per_step']:,}"]
                for rec in records]
  ratios = _timing.table(["model", "ours / MS best", "ours / single", "ours steps=10 / MS best",
                          "ours steps=10 / single", "collectives per step", "bytes/step"], ratio_rows)
  paired_rows = [[rec["model"], rec["paired"]["mirrored_best"], _timing.interval(rec["paired"]["ours_over_mirrored_best"]),
                  _timing.interval(rec["paired"]["ours_over_single"]), rec["paired"]["ours_over_single"]["n"]]
                 for rec in records]
  per_round = _timing.table(["model", "MS best", "ours / MS best per round [95% CI]",
                             "ours / single per round [95% CI]", "rounds"], paired_rows, "llrrr")
  return steps + "\n\n" + ratios + "\n\nRound-by-round ratios (median, 95% bootstrap interval of the median):\n\n" + per_round
