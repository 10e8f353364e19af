"""The pipeline's bubble, measured from each device's timeline of one step against ``(p - 1) / (m + p - 1)``.

``repl.pipeline`` (``replicator/core/_pipeline.py``) on ``p`` logical CPUs, one stage a device, ``m``
microbatches, GPipe and 1F1B. Every stage costs the same: ``depth`` matmuls ``[rows, width] x [width, width]``
(tanh after each) on its microbatch, after a scale by a per-stage vector (a variable, so that the first stage's
backward pass, which needs no gradient of its input, still computes its first matmul's: every stage's backward
pass is ``2 depth`` matmuls, its forward pass ``depth``). Each microbatch has ``rows`` rows whatever ``m``, so a
pass costs the same at every ``m`` (several milliseconds at the defaults) and the transfers between stages (an
activation of ``[rows, width]``, in one process a plain cross-device edge) are small beside it.

One step (after warm-up steps) is recorded by TensorFlow's profiler (:func:`op_events`): every kernel's start
and end on its thread. An op belongs to replica ``r`` (the device at position ``r`` of the stage axis) when its
name is under ``replica_r/`` (the local view traces each replica under that scope; the forward passes' ops) or
``gradient_tape/replica_r/`` (the backward passes' ops: TensorFlow names a gradient op after the forward op it
differentiates). For each device: busy = the union of its ops' intervals, span = first start to last end over
every device's ops, idle = 1 - busy / span. Not counted (neither busy nor in the span): ``_Send`` and ``_Recv``
(transfers; a receive's interval is its wait), and the ops of no replica (the step's input, the lowered
all-reduce of the loss and the gradients after the last pass, the outputs). The median over ``--steps``
recorded steps is reported.

Each stage names its ops ``mb``, ``mb_1``, ... (its ``k``-th call in the trace: the forward pass of microbatch
``k``, as the pipeline calls a stage on its microbatches in order), so an op's pass is read from its name:
``replica_r/mb_k/...`` forward, ``gradient_tape/replica_r/mb_k/...`` backward (:func:`passes`; the pipeline's
own ``pipeline/stage<g>/F<j>`` and ``.../B<j>`` scopes are read first, should it put its passes under them);
``tests/test_pipeline_bubble.py`` compares each device's passes, by their first op's start, with the schedule.

Threads. The logical CPUs are not processors of their own: every device's kernels run on TensorFlow's one
inter-op pool (as many threads as cores by default: 2 here), and ``replicator.virtual_cpus(n)`` gives a kernel
``cores // n`` intra-op threads (one here: a matmul runs on the thread that started it). At ``p = 2`` the two
devices compute at once, a core each, but one device may take both threads (a backward pass's input-gradient
and weight-gradient matmuls are independent), and then a value its neighbour waits for, although computed,
waits for a thread to send it (:func:`send_waits`). At ``p = 4`` four devices share the two threads: once all
of them have work, at least half wait for a thread whatever the schedule, so their idle fraction is not the
schedule's bubble (reported apart). An op's interval counts as busy even while the OS runs another process
(``others' cores`` says how much other processes ran meanwhile). ``--inter-op`` and ``--intra-op`` set
``tf.config.threading`` in this process before the devices are made.

Run by hand: ``python -m benchmarks.pipeline_bubble [--stages 2,4] [--microbatches 1,2,4,8] [--width 512]
[--depth 4] [--rows 128] [--steps 5] [--inter-op N] [--intra-op N] [--json F]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from benchmarks import _timing  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved")
CHUNKS = 2  # the interleaved schedule's stages a device, each half a device's depth
TRANSFERS = frozenset({"_Send", "_Recv", "_HostSend", "_HostRecv"})
_OP = re.compile(r"(?:^|/)(gradient_tape/)?replica_(\d+)/([^:]*):(\w+)$")
_PASS = re.compile(r"(?:^|/)(?:pipeline/stage\d+/([FB])(\d+)|mb(?:_(\d+))?)/")
_SENT = re.compile(r"^(.*)/_\d+$")


def op_events(run) -> list[tuple[str, str, float, float]]:
  """``(node name, op type, start, end)`` (seconds, one clock) of every kernel ``run()`` runs, by the profiler.

  Why the profiler: ``tensorflow.python.eager.context``'s ``enable_run_metadata()`` / ``export_run_metadata()``
  (RunMetadata's step stats, TF 1's per-node timings) return no step stats for eager calls or ``tf.function`` s
  since TF 2.1 (tensorflow/tensorflow#36314; empty here on TF 2.21). ``tf.profiler.experimental.start/stop`` are public; what
  they write is not: an XSpace proto (``<logdir>/plugins/profile/<run>/<host>.xplane.pb``), read with the proto
  module TensorFlow ships at ``tensorflow.tsl.profiler.protobuf.xplane_pb2`` (TF 2.21; the module path and the
  event names are TensorFlow's internals). In it the host plane has a line a thread and an event a kernel, named
  ``"<node name>:<op type>"`` by the executor; this function is the only place that knows that.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel

  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir)
    try:
      run()
    finally:
      tf.profiler.experimental.stop()
    (path,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
      space.ParseFromString(f.read())
  events = []
  for plane in space.planes:
    if plane.name != "/host:CPU":
      continue
    for line in plane.lines:
      for event in line.events:
        name, _, kind = plane.event_metadata[event.metadata_id].name.partition(":")
        if not kind or " " in name or not kind.isidentifier():  # not a kernel ("EagerLocalExecute: f", "A::B")
          continue
        start = line.timestamp_ns * 1e-9 + event.offset_ps * 1e-12
        events.append((name, kind, start, start + event.duration_ps * 1e-12))
  return events


def device_ops(events, replicas: int) -> list[list[tuple[str, str, float, float]]]:
  """The events of each replica's compute ops (forward and backward), transfers and ops of no replica left out."""
  ops = [[] for _ in range(replicas)]
  for name, kind, start, end in events:
    found = _OP.search(f"{name}:{kind}")
    if found and kind not in TRANSFERS and int(found.group(2)) < replicas:
      ops[int(found.group(2))].append((name, kind, start, end))
  return ops


def busy(intervals) -> float:
  """The length of the union of ``(start, end)`` intervals."""
  total, reach = 0.0, -np.inf
  for start, end in sorted(intervals):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


def passes(ops) -> list[tuple[str, int, float, float]]:
  """A device's passes ``(kind, microbatch, first start, last end)`` by their first op's start.

  ``kind`` is ``"F"`` or ``"B"``: an op under the stage's ``mb_k`` scope, under ``gradient_tape/`` or not (or
  under the pipeline's own ``pipeline/stage<g>/F<j>`` and ``.../B<j>`` scopes, where it has them). Ops of no pass
  (the loss, the gradients' sums, the variables' reads) are left out.
  """
  found = {}
  for name, _, start, end in ops:
    label = _PASS.search(name)
    if label is None:
      continue
    backward = "gradient_tape/" in name or label.group(1) == "B"
    key = ("B" if backward else "F", int(label.group(2) or label.group(3) or 0))
    first, last = found.get(key, (start, end))
    found[key] = (min(first, start), max(last, end))
  return sorted(((kind, j, a, b) for (kind, j), (a, b) in found.items()), key=lambda x: x[2])


def send_waits(events, ops) -> list[list[float]]:
  """Each device's sends of its passes' outputs (activations forward, their gradients back): each one's wait.

  A tensor goes to another device by a ``_Send`` kernel named after the op making it (``<op>/_<n>``), which runs
  when a thread of TensorFlow's inter-op pool takes it; the wait (seconds) is from that op's end to the send's
  start: how long the neighbour waited for a value that was ready.
  """
  ends = [{name: end for name, _, _, end in device} for device in ops]
  waits = [[] for _ in ops]
  for name, kind, start, _ in events:
    found = _SENT.match(name) if kind == "_Send" else None
    if found and _PASS.search(found.group(1)):
      for d, device in enumerate(ends):
        if found.group(1) in device:
          waits[d].append(start - device[found.group(1)])
  return waits


def timeline(call, replicas: int) -> dict:
  """One step of ``call`` recorded: each device's busy time and idle fraction, the span, each device's passes.

  Times in milliseconds from the span's start; ``passes``: each device's ``[kind, microbatch, start, end]``
  in the order they started (:func:`passes`); ``send_waits_ms``: each device's :func:`send_waits`.
  """
  events = op_events(call)
  ops = device_ops(events, replicas)
  everything = [op for device in ops for op in device]
  if not all(ops):
    raise RuntimeError(f"No op of replica {[d for d, device in enumerate(ops) if not device]} in the step's "
                       f"timeline ({len(everything)} ops of the others): were the ops renamed?")
  t0 = min(op[2] for op in everything)
  span = max(op[3] for op in everything) - t0
  busy_times = [busy([(op[2], op[3]) for op in device]) for device in ops]
  return {"span_ms": span * 1e3, "busy_ms": [b * 1e3 for b in busy_times],
          "idle": [1 - b / span for b in busy_times],
          "send_waits_ms": [[w * 1e3 for w in device] for device in send_waits(events, ops)],
          "passes": [[[kind, j, (a - t0) * 1e3, (b - t0) * 1e3] for kind, j, a, b in passes(device)]
                     for device in ops]}


def bubble(p: int, m: int, chunks: int = 1) -> float:
  """The schedules' bubble when every stage costs the same: ``(p - 1) / (m + p - 1)`` of the step, and
  ``(p - 1) / (v m + p - 1)`` for the interleaved schedule's ``v`` (``chunks``) stages a device."""
  return (p - 1) / (chunks * m + p - 1)


def _stage(tf, scale, kernel, depth: int):
  def stage(h):
    with tf.name_scope("mb"):  # mb, mb_1, ...: the k-th call in this replica's trace, microbatch k's forward pass
      h = h * scale
      for _ in range(depth):
        h = tf.tanh(h @ kernel)
      return h
  return stage


def build(p: int, m: int, schedule: str, width: int, depth: int, rows: int):
  """A function running one pipelined step on the first ``p`` logical CPUs (returns the loss): one stage of
  ``depth`` matmuls a device, or for the interleaved schedule :data:`CHUNKS` stages of ``depth / CHUNKS`` each (a
  device's work the same)."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel
  import replicator  # pylint: disable=import-outside-toplevel

  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:p]]
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=devices))
  rng = np.random.default_rng(0)
  chunks = CHUNKS if schedule == "interleaved" else 1
  with repl.context():
    scales = [tf.Variable(np.ones(width, np.float32), name=f"scale{s}") for s in range(p * chunks)]
    kernels = [tf.Variable((rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32), name=f"kernel{s}")
               for s in range(p * chunks)]
  stages = [_stage(tf, scales[s], kernels[s], depth // chunks) for s in range(p * chunks)]
  variables = [v for pair in zip(scales, kernels) for v in pair]
  x = tf.constant(rng.normal(size=(rows * m, width)).astype(np.float32))
  y = tf.constant(rng.normal(size=(rows * m, width)).astype(np.float32))

  def step():
    loss, grads = repl.pipeline(stages, x, y, keras.losses.mean_squared_error, microbatches=m, schedule=schedule,
                                variables=variables)
    return loss, [tf.reduce_sum(g) for g in grads]  # (the gradients used: the backward passes are not pruned)

  def call():
    loss, _ = repl.run(step)  # (each replica's)
    return float(loss[0])

  return call


def _cpu_seconds() -> tuple[float, float] | None:
  """``(CPU seconds every process has used, this process's)``, from Linux's ``/proc/stat``; None elsewhere."""
  try:
    with open("/proc/stat") as f:
      ticks = [int(v) for v in f.readline().split()[1:]]
  except OSError:
    return None
  own = os.times()
  return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system  # not idle, iowait


def measure(p: int, m: int, schedule: str, width: int = 512, depth: int = 4, rows: int = 128, steps: int = 5,
            warmup: int = 3) -> dict:
  """One configuration: ``steps`` steps' timelines (:func:`timeline`) after ``warmup`` steps, and their summary.

  ``idle``: each device's median over the steps; ``quietest``: the idle fractions of the step of the shortest
  span (the one least slowed by other processes on a shared machine); ``send_waits_ms``: each device's sends'
  waits in a step, summed (the median over the steps); ``others_cores``: the cores other processes kept busy
  meanwhile (on average; None where ``/proc/stat`` is not).
  """
  call = build(p, m, schedule, width, depth, rows)
  for _ in range(warmup):
    call()
  before, start = _cpu_seconds(), time.perf_counter()
  timelines = [timeline(call, p) for _ in range(steps)]
  after, wall = _cpu_seconds(), time.perf_counter() - start
  others = None if before is None else ((after[0] - before[0]) - (after[1] - before[1])) / wall
  quietest = min(timelines, key=lambda t: t["span_ms"])
  chunks = CHUNKS if schedule == "interleaved" else 1
  return {"p": p, "m": m, "schedule": schedule, "bubble": bubble(p, m, chunks),
          "idle": [float(np.median([t["idle"][d] for t in timelines])) for d in range(p)],
          "quietest": quietest["idle"], "span_ms": float(np.median([t["span_ms"] for t in timelines])),
          "send_waits_ms": [float(np.median([sum(t["send_waits_ms"][d]) for t in timelines])) for d in range(p)],
          "others_cores": others, "timelines": timelines}


def _row(r) -> list:
  off = max(abs(i - r["bubble"]) for i in r["idle"]) * 100
  return [r["m"], r["schedule"], " ".join(f"{i:.3f}" for i in r["idle"]), f"{r['bubble']:.3f}", f"{off:.1f}",
          " ".join(f"{i:.3f}" for i in r["quietest"]), f"{r['span_ms']:.1f} ms",
          " ".join(f"{w:.1f}" for w in r["send_waits_ms"]),
          "" if r["others_cores"] is None else f"{max(0.0, r['others_cores']):.2f}"]


def rounded(value, digits: int = 4):
  """``value`` (a nest of dicts, lists and numbers) with its floats rounded: milliseconds to 0.1 us in the JSON."""
  if isinstance(value, float):
    return round(value, digits)
  if isinstance(value, dict):
    return {k: rounded(v, digits) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [rounded(v, digits) for v in value]
  return value


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--stages", default="2,4")
  parser.add_argument("--microbatches", default="1,2,4,8")
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--rows", type=int, default=128, help="rows of a microbatch")
  parser.add_argument("--steps", type=int, default=5, help="steps recorded per configuration")
  parser.add_argument("--inter-op", type=int, help="tf.config.threading's inter-op threads (default: TF's)")
  parser.add_argument("--intra-op", type=int, help="intra-op threads (default: virtual_cpus', cores // devices)")
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import replicator  # pylint: disable=import-outside-toplevel

  if args.inter_op is not None:
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
  stages = [int(p) for p in args.stages.split(",")]
  replicator.virtual_cpus(max(stages), intra_op_threads=args.intra_op)
  threads = {"inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
             "intra_op": tf.config.threading.get_intra_op_parallelism_threads(), "cores": os.cpu_count()}
  load = [os.getloadavg()[0]]
  records = []
  for p in stages:
    for m in (int(m) for m in args.microbatches.split(",")):
      for schedule in SCHEDULES:
        if schedule == "interleaved" and m % p:
          continue  # (its microbatches a multiple of the devices)
        records.append(measure(p, m, schedule, args.width, args.depth, args.rows, args.steps))
  load.append(os.getloadavg()[0])
  print(f"Threads {threads} (0: TensorFlow's default); load average {load[0]:.2f} at start, {load[1]:.2f} at end.")
  for p in stages:
    print(f"\np = {p}" + (f" ({p} devices on {os.cpu_count()} cores: a device also waits for a thread)"
                           if p > (os.cpu_count() or 1) else "") + ":")
    print(_timing.table(["m", "schedule", f"idle by device (median of {args.steps})", "bubble (formula)",
                         "most off (points)", "quietest step", "span", "sends waited (ms)",
                         "others' cores"], [_row(r) for r in records if r["p"] == p], align="rrlrrlrlr"))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": {"width": args.width, "depth": args.depth, "rows": args.rows, "steps": args.steps,
                            "threads": threads, "load_average": load}, "records": rounded(records)}, f, indent=1)


if __name__ == "__main__":
  main()
