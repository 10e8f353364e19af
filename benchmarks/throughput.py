"""Part 3: collective throughput (NCCL-tests definitions) for both collective implementations.

Each measurement is one ``repl.run`` of a step doing ``k`` collectives of the
same size on ``k`` distinct buffers per replica, one after the other (each
waits for the previous one's output through a control dependency), with ``k``
16 up to 16 MB, then at most 256 MB per replica (4 at 64 MB); the
time per collective is the call's time divided by ``k``, as NCCL-tests average
back-to-back iterations on one stream. The time of a step with ONE collective (the fixed
cost of a ``repl.run`` call included) is reported next to it. Inputs are fed
as ``inputs=replicator.PerReplica([...])`` of tensors created once on each
replica's device (``tf.fill`` under ``tf.device``): nothing crosses from the
host during the timed call, and, unlike filling the tensor inside the step,
no fill of the payload is timed with the collective. The step returns the
collectives' outputs (handles only; no copy to the host).

Sizes are NCCL-tests' ``size``: bytes per replica for all_reduce and
broadcast, and the output size for all_gather (each replica contributes
size / n). ``algbw = size / time``; ``busbw = algbw * 2(n-1)/n`` (all_reduce),
``* (n-1)/n`` (all_gather), ``* 1`` (broadcast), with the time per collective.
The fixed cost of one ``repl.run`` call is also measured alone (``empty
step``, a step returning its input).

Memory-copy references measured in the same run: ``np.copyto`` of 64 MB (the
physical limit used), a ``DeepCopy`` of 64 MB inside a ``tf.function`` (a
real copy by TensorFlow) and ``tf.identity`` from CPU:0 onto CPU:1 (between
logical CPUs of one process TensorFlow shares the buffer, so this is not a copy).
"""

from __future__ import annotations

import gc

import numpy as np
import tensorflow as tf

import replicator
from benchmarks import _timing

KINDS = ("all_reduce", "all_gather", "broadcast")
IMPLEMENTATIONS = ("one_device", "collective_ops")
SIZES = tuple(4 ** k * 4096 for k in range(8))  # 4 KB ... 64 MB
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0}
MEMCPY_BYTES = 64 * 2 ** 20


def per_call(size: int) -> int:
  """Independent collectives per timed call: 16 up to 16 MB, then at most 256 MB per replica."""
  return max(2, min(16, (256 * 2 ** 20) // size))


def _rounds(size: int, quick: bool) -> int:
  rounds = 15 if size <= 2 ** 20 else 9 if size <= 2 ** 24 else 5
  return max(5, rounds // 2) if quick else rounds


def human(size: int) -> str:
  return f"{size // 2 ** 20} MB" if size >= 2 ** 20 else f"{size // 2 ** 10} KB"


def _step(repl, kind):
  def one(x):
    if kind == "all_reduce":
      return repl.all_reduce(x, "sum")
    if kind == "all_gather":
      return repl.all_gather(x, concat_dimension=0)
    return repl.broadcast(x, source=0)

  def step_fn(xs):  # a list of buffers: one collective each, one after the other
    if kind == "empty":
      return xs  # the fixed cost of a call
    outputs = []
    for x in xs:
      if outputs:  # serialised like NCCL-tests' iterations on one stream (identity: no copy)
        with tf.control_dependencies([outputs[-1]]):
          x = tf.identity(x)
      outputs.append(one(x))
    return outputs

  return step_fn


def _inputs(devices, elements: int, count: int = 1) -> replicator.PerReplica:
  values = []
  for i, device in enumerate(devices):
    with tf.device(device):
      values.append([tf.fill([elements], float(i + 1 + j)) for j in range(count)])
  return replicator.PerReplica(values)


def memcpy(log=print) -> dict:
  """Memory-copy bandwidths (bytes copied per second) of 64 MB, medians of 15."""
  n = MEMCPY_BYTES // 4
  src, dst = np.ones(n, np.float32), np.zeros(n, np.float32)
  with tf.device("/device:CPU:0"):
    x = tf.ones([n])

  @tf.function
  def deep_copy(x):
    return tf.raw_ops.DeepCopy(x=x)

  @tf.function
  def to_cpu1(x):
    with tf.device("/device:CPU:1"):
      return tf.identity(x)

  calls = {"np.copyto": lambda: np.copyto(dst, src), "tf DeepCopy": lambda: deep_copy(x),
           "tf.identity CPU:0->CPU:1": lambda: to_cpu1(x)}
  times = _timing.interleaved(calls, rounds=15, warmup=2)
  out = {name: dict(seconds=_timing.summary(t), bytes_per_s=MEMCPY_BYTES / _timing.summary(t)["median"])
         for name, t in times.items()}
  for name, v in out.items():
    log(f"memcpy 64 MB: {name:<26} {v['bytes_per_s'] / 1e9:8.2f} GB/s  ({_timing.ms(v['seconds']['median'])})")
  out["physical_limit"] = "np.copyto"
  return out


def measure(devices, sizes=SIZES, kinds=KINDS, quick: bool = False, log=print) -> list[dict]:
  """Rows of (devices, kind, size, implementation): times, algbw and busbw."""
  n = len(devices)
  repls = {impl: replicator.Replicator(devices=devices, implementation=impl) for impl in IMPLEMENTATIONS}
  rows = []
  empty = _inputs(devices, 1)  # the fixed cost of a call: a step that returns its input
  steps = {impl: _step(r, "empty") for impl, r in repls.items()}
  times = _timing.interleaved({impl: (lambda impl=impl: repls[impl].run(steps[impl], inputs=empty))
                               for impl in IMPLEMENTATIONS}, rounds=15 if quick else 25, warmup=2)
  empty_median = {}
  for impl in IMPLEMENTATIONS:
    stats = _timing.summary(times[impl])
    empty_median[impl] = stats["median"]
    rows.append(dict(devices=n, kind="empty step", size=0, implementation=impl, times_s=times[impl],
                     stats=stats, algbw=None, busbw=None))
  for kind in kinds:
    steps = {impl: _step(r, kind) for impl, r in repls.items()}
    for size in sizes:
      per_replica = size // n if kind == "all_gather" else size
      k = per_call(size)
      one, many = _inputs(devices, max(1, per_replica // 4)), _inputs(devices, max(1, per_replica // 4), k)
      calls = {}
      for impl in IMPLEMENTATIONS:
        calls[impl] = lambda step=steps[impl], repl=repls[impl], many=many: repl.run(step, inputs=many)
        calls[impl + " x1"] = lambda step=steps[impl], repl=repls[impl], one=one: repl.run(step, inputs=one)
      times = _timing.interleaved(calls, rounds=_rounds(size, quick), warmup=2)
      for impl in IMPLEMENTATIONS:
        stats = _timing.summary([t / k for t in times[impl]])  # per collective
        single = _timing.summary(times[impl + " x1"])
        algbw = size / stats["median"]
        rows.append(dict(devices=n, kind=kind, size=size, implementation=impl, per_call=k,
                         times_s=times[impl], stats=stats, one_per_call_times_s=times[impl + " x1"],
                         one_per_call_stats=single, algbw=algbw, busbw=algbw * BUS_FACTOR[kind](n),
                         busbw_one_per_call=size / single["median"] * BUS_FACTOR[kind](n)))
      a, b = rows[-2], rows[-1]
      log(f"throughput n={n} {kind:<10} {human(size):>6} (x{k}): " + "  ".join(
          f"{r['implementation']} {_timing.ms(r['stats']['median']):>9} busbw {r['busbw'] / 1e9:6.2f} GB/s"
          for r in (a, b)))
      calls = one = many = None  # free this size's buffers before the next
      gc.collect()
  return rows


SPARSE_SIZES = SIZES[::2] + SIZES[-1:]  # 4 KB, 64 KB, 1 MB, 16 MB, 64 MB


def run(all_devices, device_counts=(4, 8), quick: bool = False, log=print) -> dict:
  """Every size on the first device count, every other size on the others (each size is a new step to build)."""
  reference = memcpy(log)
  rows = []
  for i, n in enumerate(device_counts):
    sizes = SPARSE_SIZES if quick or i > 0 else SIZES
    rows += measure(list(all_devices[:n]), sizes=sizes, quick=quick, log=log)
  return dict(memcpy=reference, rows=rows)


def markdown(result: dict) -> str:
  limit = result["memcpy"][result["memcpy"]["physical_limit"]]["bytes_per_s"]
  refs = _timing.table(["64 MB copy", "GB/s", "median"], [
      [name, f"{v['bytes_per_s'] / 1e9:.2f}", _timing.ms(v["seconds"]["median"])]
      for name, v in result["memcpy"].items() if isinstance(v, dict)])
  rows = []
  by_key = {(r["devices"], r["kind"], r["size"], r["implementation"]): r for r in result["rows"]}
  for (n, kind, size, impl), r in by_key.items():
    if impl != IMPLEMENTATIONS[0]:
      continue
    other = by_key[(n, kind, size, IMPLEMENTATIONS[1])]
    cells = [n, kind, human(size) if size else "-"]
    for x in (r, other):
      cells.append(_timing.ms(x["stats"]["median"]))
      if x["busbw"] is None:
        cells += ["", "", "", ""]
      else:
        cells += [f"{x['algbw'] / 1e9:.2f}", f"{x['busbw'] / 1e9:.2f}", f"{x['busbw'] / limit:.0%}",
                  _timing.ms(x["one_per_call_stats"]["median"])]
    rows.append(cells)
  header = ["devices", "collective", "size"]
  for impl in IMPLEMENTATIONS:
    header += [f"{impl} time", "algbw GB/s", "busbw GB/s", "busbw / memcpy", "one per call"]
  return refs + "\n\n" + _timing.table(header, rows, "rlr" + "r" * 10)
