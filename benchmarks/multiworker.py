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

Against ``MultiWorkerMirroredStrategy``, one program per worker:
``python -m benchmarks.multiworker --versus-mwms 2,4 [--steps 30]``. For each
number of workers (one device each) and each model (the guard's deep and wide
MLPs, Keras Adam), alternately:

* ours, multi-client: that many processes started by ``python -m
  replicator.launch``, each running the same script with
  ``MultiWorkerReplicator.from_tf_config()`` (the local view; with
  ``--global-view``, the global view too), as theirs;
* ours, single-client: one client process driving that many ``python -m
  replicator.worker`` servers, the local view and the global view;
* theirs: that many processes started by ``python -m replicator.launch``, each
  running the same ``tf.distribute.MultiWorkerMirroredStrategy`` program
  (``TF_CONFIG``), the step a ``tf.function`` around ``strategy.run``.

Each reports its first call (build) and the median of ``--steps`` timed steps
after two untimed ones (worker 0's, for theirs). Every run starts fresh
processes, so no configuration inherits another's state.
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


def _timed(call, steps: int) -> dict:
  """The first call's seconds (the build), then the median of ``steps`` calls after two untimed ones, in ms."""
  start = time.perf_counter()
  call()
  build = time.perf_counter() - start
  call()
  call()
  times = []
  cpu = time.process_time()
  for _ in range(steps):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return dict(build_s=build, step_ms=statistics.median(times) * 1e3,
              cpu_ms=(time.process_time() - cpu) / steps * 1e3)  # this process's CPU time a step (all threads)


def _model(model: str, scope, wrap):
  """The benchmark model ``model`` built in ``scope`` with Adam (wrapped by ``wrap``): spec, model, optimizer, batch."""
  import keras

  from benchmarks import models
  from benchmarks import step_time
  spec = models.by_name(model)
  keras.utils.set_random_seed(0)
  batch = spec.batch()
  with scope:
    net = spec.build()
    optimizer = wrap(step_time.adam())
    optimizer.build(net.trainable_variables)
  return spec, net, optimizer, batch


def _mwms_child(model: str, steps: int) -> None:
  """One worker of the MultiWorkerMirroredStrategy job (started by replicator.launch); worker 0 prints JSON."""
  import tensorflow as tf
  strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any other TensorFlow op
  from benchmarks import step_time
  spec, net, optimizer, (x, y) = _model(model, strategy.scope(), lambda o: o)
  # Keras 3 all-reduces gradients with SUM under a strategy: each replica's mean loss scaled by 1/replicas.
  body = step_time._sgd_step(spec, net, optimizer, loss_scale=1.0 / strategy.num_replicas_in_sync)  # pylint: disable=protected-access
  iterator = iter(strategy.experimental_distribute_dataset(step_time._dataset(x, y)))  # pylint: disable=protected-access

  @tf.function
  def train_step(iterator):
    return strategy.run(body, args=next(iterator))

  result = _timed(lambda: [float(v) for v in strategy.experimental_local_results(train_step(iterator))], steps)
  if strategy.cluster_resolver.task_id == 0:
    print("RESULT " + json.dumps(dict(result, replicas=strategy.num_replicas_in_sync)), flush=True)


def _multi_client_child(model: str, steps: int, view: str = "local") -> None:
  """One worker of our multi-client job (started by replicator.launch) in ``view``; worker 0 prints JSON."""
  repl = replicator.MultiWorkerReplicator.from_tf_config(view=view)  # before any other TensorFlow op
  import resource

  from benchmarks import step_time
  spec, net, optimizer, (x, y) = _model(model, repl.context(), repl.wrap_optimizer)
  body = step_time._sgd_step(spec, net, optimizer)  # pylint: disable=protected-access
  dataset = step_time._dataset(x, y)  # pylint: disable=protected-access

  def step_fn(batch):
    return body(*batch)

  before = resource.getrusage(resource.RUSAGE_SELF)
  wall = time.perf_counter()
  repl.explain(step_fn, dataset)  # the build alone: its wall and CPU seconds
  after = resource.getrusage(resource.RUSAGE_SELF)
  build = dict(build_only_s=time.perf_counter() - wall,
               build_cpu_s=(after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))
  result = _timed(lambda: repl.run(step_fn, dataset), steps)
  if repl.task == 0:
    print("RESULT " + json.dumps(dict(result, **build, replicas=repl.num_replicas)), flush=True)


def _ours_child(workers: int, model: str, steps: int) -> None:
  """Our client over ``workers`` worker servers (one device each): both views; prints JSON."""
  import keras

  from benchmarks import models
  from benchmarks import step_time
  spec = models.by_name(model)
  keras.utils.set_random_seed(0)
  x, y = spec.batch()
  out = {}
  with testing.local_cluster(workers, devices_per_worker=1) as cluster:
    for view in ("local", "global"):
      repl = replicator.MultiWorkerReplicator(cluster.spec, view=view)
      with repl.context():
        net = spec.build()
        optimizer = repl.wrap_optimizer(step_time.adam())
        optimizer.build(net.trainable_variables)
      body = step_time._sgd_step(spec, net, optimizer)  # pylint: disable=protected-access
      dataset = step_time._dataset(x, y)  # pylint: disable=protected-access

      def step_fn(batch, body=body):
        return body(*batch)

      out[view] = _timed(lambda repl=repl, step_fn=step_fn, dataset=dataset: repl.run(step_fn, dataset), steps)
    print("RESULT " + json.dumps(out), flush=True)
  os._exit(0)  # skip TensorFlow's teardown of remote contexts


def _result(command: list[str], workers: int | None = None, devices: int = 1) -> dict:
  """The JSON a child prints after ``RESULT`` (``workers``: started as that many workers by replicator.launch)."""
  import subprocess
  import sys
  if workers is None:
    process = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=1800)
    text, code = process.stdout, process.returncode
  else:
    import io

    from replicator import launch
    out = io.TextIOWrapper(io.BytesIO(), write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), write_through=True)
    code = launch.launch(command, workers, devices, timeout=1800, out=out, err=err)
    text = out.buffer.getvalue().decode() + err.buffer.getvalue().decode()
  lines = [line.split("RESULT ", 1)[1] for line in text.splitlines() if "RESULT " in line]
  if code != 0 or not lines:
    raise RuntimeError(f"{command} exited with {code}:\n{text[-3000:]}")
  return json.loads(lines[0])


def alternate(model: str, workers: int, pairs: int, steps: int, devices: int = 1, view: str = "local") -> dict:
  """Our multi-client job and MultiWorkerMirroredStrategy's, ``pairs`` of each in turn (fresh processes each).

  Returns each side's step times (ms, worker 0's medians) and the ratio of each pair (ours / theirs), for the
  benchmark guard.
  """
  ours, theirs = [], []
  for _ in range(pairs):
    ours.append(_result(["-m", "benchmarks.multiworker", "--multi-client-child", model, "--view", view, "--steps",
                         str(steps)], workers=workers, devices=devices)["step_ms"])
    theirs.append(_result(["-m", "benchmarks.multiworker", "--mwms-child", model, "--steps", str(steps)],
                          workers=workers)["step_ms"])
  return dict(ours_ms=ours, theirs_ms=theirs, ratios=[a / b for a, b in zip(ours, theirs)])


def versus_mwms(workers: list[int], models: list[str], steps: int, single_client: bool = True,
                devices: int = 1, global_view: bool = False) -> list[dict]:
  """Ours against MultiWorkerMirroredStrategy at each number of workers (``devices`` each; MWMS: one).

  Ours multi-client (every worker runs the program; with ``global_view``, the
  global view's multi-client job too) and, with ``single_client``, one client
  driving worker servers (both views).
  """
  rows = []
  for model in models:
    for w in workers:
      multi = _result(["-m", "benchmarks.multiworker", "--multi-client-child", model, "--steps", str(steps)],
                      workers=w, devices=devices)
      theirs = _result(["-m", "benchmarks.multiworker", "--mwms-child", model, "--steps", str(steps)], workers=w)
      row = dict(model=model, workers=w, devices_per_worker=devices, ours_multi_client=multi, mwms=theirs)
      line = (f"{model}, {w} workers x {devices}: ours multi-client {multi['build_s']:.2f} s / "
              f"{multi['step_ms']:.1f} ms (build alone {multi['build_only_s']:.2f} s, CPU {multi['build_cpu_s']:.2f} s)")
      if global_view:
        multi_global = _result(["-m", "benchmarks.multiworker", "--multi-client-child", model, "--view", "global",
                                "--steps", str(steps)], workers=w, devices=devices)
        row.update(ours_multi_client_global=multi_global)
        line += (f"; multi-client global {multi_global['build_s']:.2f} s / {multi_global['step_ms']:.1f} ms "
                 f"(/ theirs {multi_global['step_ms'] / theirs['step_ms']:.2f})")
      if single_client:
        ours = _result(["-m", "benchmarks.multiworker", "--ours-child", str(w), "--model", model, "--steps",
                        str(steps)])
        row.update(ours_local=ours["local"], ours_global=ours["global"])
        line += (f"; single-client local {ours['local']['build_s']:.2f} s / {ours['local']['step_ms']:.1f} ms, "
                 f"global {ours['global']['build_s']:.2f} s / {ours['global']['step_ms']:.1f} ms")
      rows.append(row)
      print(line + f"; MultiWorkerMirroredStrategy {theirs['build_s']:.2f} s / {theirs['step_ms']:.1f} ms "
            f"(multi-client / theirs {multi['step_ms'] / theirs['step_ms']:.2f})", flush=True)
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--json", default=None)
  parser.add_argument("--bucket-bytes", type=int, default=None, help="wrap_optimizer(bucket_bytes=...)")
  parser.add_argument("--versus-mwms", default=None, help="numbers of workers, e.g. 2,4: ours against MWMS")
  parser.add_argument("--models", default="mlp_deep,mlp_wide", help="with --versus-mwms: the models")
  parser.add_argument("--steps", type=int, default=30, help="with --versus-mwms: timed steps a run")
  parser.add_argument("--multi-client-only", action="store_true",
                      help="with --versus-mwms: leave out the single-client runs")
  parser.add_argument("--devices-per-worker", type=int, default=1,
                      help="with --versus-mwms: our multi-client workers' devices (MWMS: one each)")
  parser.add_argument("--global-view", action="store_true",
                      help="with --versus-mwms: our multi-client job in the global view too")
  parser.add_argument("--view", default="local", help=argparse.SUPPRESS)
  parser.add_argument("--multi-client-child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--mwms-child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--ours-child", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.mwms_child:
    return _mwms_child(args.mwms_child, args.steps)
  if args.multi_client_child:
    return _multi_client_child(args.multi_client_child, args.steps, args.view)
  if args.ours_child:
    return _ours_child(args.ours_child, args.model, args.steps)
  if args.versus_mwms:
    rows = versus_mwms([int(w) for w in args.versus_mwms.split(",")], args.models.split(","), args.steps,
                       not args.multi_client_only, args.devices_per_worker, args.global_view)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    return rows
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
