"""Part 2: build cost: wall time from the first call to its first result, by replica count.

For each replica count a fresh Replicator (or MirroredStrategy) and a fresh
overhead-bound MLP are made on the first n logical CPUs, variables and Adam
slots are created (timed separately, as ``setup``), and then the first call is
timed: for the replicator ``repl.run(step_fn, dataset)`` (distribute the
dataset, trace every replica, plan, rewrite, import, run), for
MirroredStrategy ``iter(experimental_distribute_dataset(dataset))`` plus the
first call of the ``tf.function`` step (trace, run).

Graph size: there is no public accessor for the rewritten graph, so it is read
from ``repl._views["local"].steps`` (the cached :class:`replicator.views._local_step.CompiledStep`): its
``graph_def`` (the rewritten step) and the concrete function that runs it.
Nodes count those of the graph plus those of its function library.
"""

from __future__ import annotations

import gc

import keras
import numpy as np
import tensorflow as tf

import replicator
from benchmarks import _timing
from benchmarks import models as models_lib
from benchmarks import step_time

OURS = "replicator"
MS = "MirroredStrategy"


def graph_nodes(graph_def) -> int:
  """Nodes of a GraphDef, its library functions' nodes included."""
  return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def _our_graph(repl) -> dict:
  # Internals (no public accessor): the one compiled step and its executable.
  (by_source,) = repl._views["local"].steps.values()  # pylint: disable=protected-access
  (variants,) = by_source.values()
  (step,) = variants.values()
  (function,) = step._executables.values()  # pylint: disable=protected-access
  return dict(rewritten_step_nodes=graph_nodes(step.graph_def),
              function_nodes=graph_nodes(function.graph.as_graph_def()))


def _data(spec):
  x, y = spec.batch()
  return tf.data.Dataset.from_tensors((x, y)).repeat()


def build_ours(spec, devices) -> dict:
  setup, (model, step_fn, repl) = _timing.timed(lambda: _make_ours(spec, devices))
  dataset = _data(spec)
  first, _ = _timing.timed(lambda: step_time._mean(repl.run(step_fn, dataset)))  # pylint: disable=protected-access
  second, _ = _timing.timed(lambda: step_time._mean(repl.run(step_fn, dataset)))  # pylint: disable=protected-access
  return dict(setup_s=setup, first_call_s=first, second_call_s=second, **_our_graph(repl))


def _make_ours(spec, devices):
  repl = replicator.Replicator(devices=devices)
  with repl.context():
    model = spec.build()
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
    optimizer.build(model.trainable_variables)
  body = step_time._sgd_step(spec, model, optimizer)  # pylint: disable=protected-access

  def step_fn(batch):
    return body(*batch)

  return model, step_fn, repl


def build_mirrored(spec, devices) -> dict:
  def make():
    strategy = step_time.mirrored_strategy(devices)
    with strategy.scope():
      model = spec.build()
      optimizer = keras.optimizers.Adam(1e-3)
      optimizer.build(model.trainable_variables)
    return strategy, model, optimizer

  setup, (strategy, model, optimizer) = _timing.timed(make)
  body = step_time._sgd_step(spec, model, optimizer, 1.0 / strategy.num_replicas_in_sync)  # pylint: disable=protected-access

  @tf.function
  def train_step(iterator):
    return strategy.run(body, args=next(iterator))

  dataset = _data(spec)

  def first_call():
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    return iterator, step_time._mean(strategy.experimental_local_results(train_step(iterator)))  # pylint: disable=protected-access

  first, (iterator, _) = _timing.timed(first_call)
  second, _ = _timing.timed(lambda: step_time._mean(strategy.experimental_local_results(train_step(iterator))))  # pylint: disable=protected-access
  nodes = graph_nodes(train_step.get_concrete_function(iterator).graph.as_graph_def())
  return dict(setup_s=setup, first_call_s=first, second_call_s=second, function_nodes=nodes)


def _repeats(n: int, quick: bool) -> int:
  return 1 if quick or n >= 16 else 2


def run(all_devices, counts=(2, 4, 8, 16, 32, 64), model_name: str = "mlp_deep", quick: bool = False,
        mirrored_max_replicas: int = 32, log=print) -> dict:
  """Measures both builds at every replica count (interleaved, fewer repeats for large counts).

  MirroredStrategy is measured up to ``mirrored_max_replicas`` only: at 64
  replicas its first call alone takes about 2 minutes on 2 cores.
  """
  spec = models_lib.by_name(model_name)
  results = {OURS: {}, MS: {}}
  skipped = [n for n in counts if n > mirrored_max_replicas]
  for n in counts:
    devices = list(all_devices[:n])
    if len(devices) < n:
      log(f"build cost: only {len(all_devices)} logical CPUs, skipping {n}")
      continue
    for r in range(_repeats(n, quick)):
      order = [OURS, MS] if r % 2 == 0 else [MS, OURS]
      for name in order:
        if name == MS and n in skipped:
          continue
        keras.backend.clear_session()
        gc.collect()
        record = (build_ours if name == OURS else build_mirrored)(spec, devices)
        results[name].setdefault(n, []).append(record)
        log(f"build cost: {name:<16} n={n:<3} setup {record['setup_s']:7.2f} s  first call "
            f"{record['first_call_s']:7.2f} s  second call {_timing.ms(record['second_call_s']):>9}  "
            f"nodes {record['function_nodes']:,}")
  return dict(model=model_name, runs=results, summary=_summarize(results), mirrored_skipped=skipped)


def _fit(ns, ts) -> dict:
  """Linear fit t = a + b n, and the exponent k of t ~ n^k (k <= 1: no worse than linear).

  The exponent is fitted over n >= 8 when there are two such counts (the
  fixed cost hides the growth at small n), else over all counts.
  """
  if len(ns) < 2:
    return {}
  b, a = np.polyfit(ns, ts, 1)
  big = [(n, t) for n, t in zip(ns, ts) if n >= 8]
  big = big if len(big) >= 2 else list(zip(ns, ts))
  k = float(np.polyfit(np.log([n for n, _ in big]), np.log([t for _, t in big]), 1)[0])
  return dict(intercept_s=float(a), slope_s_per_replica=float(b), exponent=k, exponent_from_n=min(n for n, _ in big))


def _summarize(results) -> dict:
  out = {}
  for name, by_n in results.items():
    ns = sorted(by_n)
    medians = {n: float(np.median([r["first_call_s"] for r in by_n[n]])) for n in ns}
    out[name] = dict(
        first_call_median_s={str(n): medians[n] for n in ns},
        per_replica_s={str(n): medians[n] / n for n in ns},
        nodes={str(n): by_n[n][0]["function_nodes"] for n in ns},
        fit=_fit(ns, [medians[n] for n in ns]))
  return out


def markdown(result: dict) -> str:
  s = result["summary"]
  ours, ms = s[OURS], s[MS]
  rows = []
  for n in ours["first_call_median_s"]:
    t_ours = ours["first_call_median_s"][n]
    t_ms = ms["first_call_median_s"].get(n)
    runs = result["runs"][OURS][int(n)]
    rows.append([n, f"{t_ours:.1f} s", f"{t_ours / int(n):.2f} s",
                 "" if t_ms is None else f"{t_ms:.1f} s", "" if t_ms is None else f"{t_ours / t_ms:.2f}",
                 f"{runs[0]['rewritten_step_nodes']:,}", f"{ours['nodes'][n]:,}",
                 "" if t_ms is None else f"{ms['nodes'][n]:,}", len(runs)])
  table = _timing.table(["replicas", "ours first call", "ours per replica", "MS first call", "ours / MS",
                         "ours rewritten step nodes", "ours function nodes", "MS function nodes", "repeats"], rows)
  fits = []
  for name, v in ((OURS, ours), (MS, ms)):
    f = v["fit"]
    if f:
      fits.append(f"{name}: least-squares t = {f['intercept_s']:.2f} s + {f['slope_s_per_replica'] * 1e3:.0f} ms "
                  f"x replicas; t ~ n^k over n >= {f['exponent_from_n']}: k = {f['exponent']:.2f}")
  if result.get("mirrored_skipped"):
    fits.append(f"{MS} not measured at {result['mirrored_skipped']} replicas (run time; --mirrored-max-replicas).")
  return table + "\n\n" + "\n".join(f"* {line}" for line in fits)
