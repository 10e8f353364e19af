"""Measuring the machine for the global view's cost model (``rewrite._cost.Machine``), cached.

:func:`measure` (the public ``replicator.calibrate``, ``_machine``) times, on the devices it is given: a chain of matrix
products on one device (flops a second), a chain of elementwise ops on a
large vector (bytes a second), a chain of scalar ops (the fixed cost of an
op), the product chain on every device at once (how many run at the same
time), and an all-reduce of a scalar and of 1 MB over all of them (a
collective's fixed cost and rate). About ten seconds; the result is kept in
a JSON file named after the machine, the device count and TensorFlow's
version (``$REPLICATOR_CACHE``, else ``~/.cache/replicator``), and read back
the next time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time

import tensorflow as tf

import mesh
from rewrite import _cost

_VERSION = 2  # of the measurements: a new one ignores older files (2: each kind of collective)


def _cache_path(devices: list[str]) -> str:
  root = os.environ.get("REPLICATOR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "replicator")
  key = json.dumps([_VERSION, platform.node(), platform.machine(), os.cpu_count(), tf.__version__,
                    os.environ.get("TF_ENABLE_ONEDNN_OPTS", ""), devices])
  return os.path.join(root, f"machine-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def _seconds(fn, repeats: int = 7) -> float:
  fn()  # built and warm
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _chain(devices, make, length):
  """A tf.function running ``length`` ops of ``make`` in a chain on each of ``devices``; returns a caller."""
  starts = []
  for d in devices:
    with tf.device(d):
      starts.append(tf.Variable(make.start()))

  @tf.function
  def run():
    ends = []
    for d, v in zip(devices, starts):
      with tf.device(d):
        x = v.read_value()
        for _ in range(length):
          x = make.step(x)
        ends.append(tf.reduce_sum(x[:1]))
    return tf.add_n(ends)

  return lambda: run().numpy()


@dataclasses.dataclass
class _Product:
  n: int

  def start(self):
    return tf.eye(self.n) * 0.5 + 0.01

  def step(self, x):
    return tf.matmul(x, x) * 0.5


@dataclasses.dataclass
class _Root:  # (a chain of products by constants would be folded into one by Grappler)
  n: int

  def start(self):
    return tf.fill([self.n], 2.0)

  def step(self, x):
    return tf.sqrt(x)


# Each kind as the lowering makes it (``rewrite._collective_ops``): an all-gather along dimension 0 is one op, along
# another a transpose around it; an all-to-all and a reduce-scatter transpose and reshape around an exchange. Per
# kind: the input of each device (rows of 64 floats) -> the collective -> an output of the input's shape.
_KINDS = {
    "all_reduce": lambda repl, x: repl.all_reduce(x),
    "all_gather": lambda repl, x: tf.concat([  # half along dimension 0, half along 1: both are common
        repl.all_gather(x[:x.shape[0] // repl.num_replicas // 2], concat_dimension=0),
        repl.all_gather(x[x.shape[0] // 2:, :x.shape[1] // repl.num_replicas], concat_dimension=1)], 0),
    "all_to_all": lambda repl, x: repl.all_to_all(x, split_dimension=0, concat_dimension=0),
    "reduce_scatter": lambda repl, x: tf.tile(repl.reduce_scatter(x, scatter_dimension=0), [repl.num_replicas, 1]),
}


def _collective_seconds(devices, elements: int, kind: str, replicator_type) -> float:
  """One collective of ``kind`` on ``elements`` floats a device over ``devices``, less a step that only reads them."""
  repl = replicator_type(mesh=mesh.Mesh({"all": len(devices)}, devices=devices))
  with repl.context():
    v = tf.Variable(tf.ones([max(2 * len(devices), elements // 64), 64]))
  calls = 8

  def reduced():
    x = v.read_value()
    for _ in range(calls):
      x = _KINDS[kind](repl, x) * 0.25
    return tf.reduce_sum(x[:1])

  def read():
    x = v.read_value()
    for _ in range(calls):
      x = x * 0.25
    return tf.reduce_sum(x[:1])

  with_collectives = _seconds(lambda: repl.run(reduced))
  without = _seconds(lambda: repl.run(read))
  return max(0.0, with_collectives - without) / calls


def measure(devices, cache: bool, replicator_type) -> _cost.Machine:
  """The machine's rates on ``devices`` (default: every CPU): see ``replicator.calibrate``.

  ``replicator_type``: the ``Replicator`` class, whose collectives are timed
  (it is above this module: the replicator gives it, so that this module does
  not import it).
  """
  if devices is None:
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  devices = [str(d) for d in devices]
  path = _cache_path(devices)
  if cache and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      found = json.load(f)
    found["collectives"] = {kind: tuple(cost) for kind, cost in found.get("collectives", {}).items()}
    return _cost.Machine(**found)
  n, length = 256, 16
  product = _seconds(_chain(devices[:1], _Product(n), length))
  flops = 2.0 * n ** 3 * length / product
  vector = 1 << 20
  scale = _seconds(_chain(devices[:1], _Root(vector), length))
  scalar = _seconds(_chain(devices[:1], _Root(1), 200))
  op_seconds = scalar / 200
  bytes_per_second = 2.0 * 4 * vector * length / max(1e-9, scale - length * op_seconds)
  everywhere = _seconds(_chain(devices, _Product(n), length))
  parallel = min(float(len(devices)), max(1.0, len(devices) * product / everywhere))
  kinds = {}
  if len(devices) > 1:
    k, large_elements = len(devices), 1 << 18
    small_elements = 2 * k * 64
    for kind in _KINDS:  # a fixed cost and a rate for each, from a small and a 1 MB one
      small = _collective_seconds(devices, small_elements, kind, replicator_type)
      large = _collective_seconds(devices, large_elements, kind, replicator_type)
      per_device = 4 * (large_elements - small_elements) // (k if kind == "all_gather" else 1)  # (a k-th gathered)
      sent = _cost.CollectiveWork(kind, k, per_device, "").sent
      kinds[kind] = (small, sent / max(1e-9, large - small))
    small, rate = kinds["all_reduce"]
  else:
    small, rate = 0.0, float("inf")
  machine = _cost.Machine(flops_per_second=flops, bytes_per_second=bytes_per_second, op_seconds=op_seconds,
                          parallel_devices=parallel, collective_seconds=small, collective_bytes_per_second=rate,
                          devices=len(devices), collectives=kinds)
  if cache:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(dataclasses.asdict(machine), f, indent=1)
  return machine
