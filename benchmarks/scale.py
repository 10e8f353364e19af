"""One process's part of a multi-client job of W workers x 8 devices, built without running it.

Run by hand: ``python -m benchmarks.scale [--workers 1,8,64,512] [--json out.json]``.

In a multi-client job each process traces its own replicas only: what can
grow with the job is the rewrite of that trace, whose collectives are the
job's (``rewrite.plan`` matches this process's placeholders against groups of
every device; ``rewrite.fuse`` and ``rewrite.apply`` build this process's
members of them, with keys hashed from every device's name). Here process 0
of a job of W workers x 8 devices (the mesh ``{"worker": W, "device": 8}``,
4,096 devices at W = 512) is simulated in one process: its 8 replicas' trace
of a data-parallel step of the guard's deep MLP (16 dense layers of 128: 32
gradients and the loss, all-reduced over the whole mesh, as the global view's
expansion leaves them), on the job's device names, then planned, fused and
lowered (``hierarchical``, agreed keys). Nothing runs: the devices of the
other 511 processes do not exist here. Reported per W: seconds of each
pass, the GraphDef's nodes and bytes, and the passes' peak Python memory
(tracemalloc). The trace itself is the same 8 replicas at every W.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import tracemalloc

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import rewrite  # noqa: E402

DEVICES_PER_WORKER = 8
LAYERS, WIDTH = 16, 128


class JobMesh:
  """The groups of a ``{"worker": W, "device": D}`` mesh over the job's device names (none exist here)."""

  def __init__(self, workers: int, per_worker: int):
    self.shape = {"worker": workers, "device": per_worker}
    self.devices = tuple(f"/job:worker/replica:0/task:{t}/device:CPU:{d}" for t in range(workers)
                         for d in range(per_worker))
    self.size = len(self.devices)

  def groups(self, axes):
    index = np.arange(self.size).reshape(self.shape["worker"], self.shape["device"])
    if tuple(axes) == ("worker", "device"):
      return (tuple(index.reshape(-1).tolist()),)
    if tuple(axes) == ("worker",):
      return tuple(tuple(column.tolist()) for column in index.T)
    return tuple(tuple(row.tolist()) for row in index)


class Unplaced(rewrite.Hierarchical):
  """``hierarchical`` whose ordering tokens are made on this CPU (the job's devices do not exist here)."""

  def external_value(self, key):
    return rewrite.ordering_token("/device:CPU:0")


def _trace(mesh: JobMesh):
  """Process 0's replicas' step: per replica, 32 gradient all-reduces and the loss's, on its job device."""
  local = range(DEVICES_PER_WORKER)
  records = {r: [] for r in local}

  def step(x):
    outputs = []
    for r in local:
      device = mesh.devices[r]
      with tf.device(device):
        h, index = x * float(r + 1), 0
        for layer in range(LAYERS):
          for shape in ([WIDTH, WIDTH], [WIDTH]):
            gradient = tf.reshape(h[:, : shape[-1]], [-1])[: int(np.prod(shape))]
            gradient = tf.reshape(tf.tile(gradient, [max(1, int(np.prod(shape)) // 64)])[: int(np.prod(shape))],
                                  shape)
            reduced, record = rewrite.emit(gradient, replica=r, index=index, kind="all_reduce",
                                           params={"op": "mean"}, axes=("worker", "device"), result_shape=shape,
                                           device=device, location=f"layer {layer}", call="gradient")
            records[r].append(record)
            outputs.append(reduced)
            index += 1
        loss = tf.reduce_mean(h)
        mean, record = rewrite.emit(loss, replica=r, index=index, kind="all_reduce", params={"op": "mean"},
                                    axes=("worker", "device"), result_shape=[], device=device, location="loss",
                                    call="loss")
        records[r].append(record)
        outputs.append(mean)
    return outputs

  concrete = tf.function(step, autograph=False).get_concrete_function(tf.TensorSpec([64, WIDTH], tf.float32))
  return concrete.graph.as_graph_def(), [records.get(r) for r in range(mesh.size)]


def measure(workers: int) -> dict:
  mesh = JobMesh(workers, DEVICES_PER_WORKER)
  lowering = Unplaced(30.0, agreed_keys=True)
  start = time.perf_counter()
  graph_def, records = _trace(mesh)
  traced = time.perf_counter() - start
  tracemalloc.start()
  start = time.perf_counter()
  plan = rewrite.plan(records, mesh, lambda c: "hierarchical")
  planned = time.perf_counter()
  fused_def, fused = rewrite.fuse(graph_def, plan, {"hierarchical": lowering})
  fused_at = time.perf_counter()
  rewritten = rewrite.apply(fused_def, fused, {"hierarchical": lowering})
  applied = time.perf_counter()
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  ops = [n for n in rewritten.graph_def.node if n.op.startswith("Collective")]
  sizes = sorted({int(tf.make_ndarray(next(m for m in rewritten.graph_def.node if m.name == n.input[1].split(":")[0])
                                      .attr["value"].tensor)) for n in ops})
  return dict(workers=workers, devices=mesh.size, local_replicas=DEVICES_PER_WORKER, trace_s=traced,
              plan_s=planned - start, fuse_s=fused_at - planned, apply_s=applied - fused_at,
              collectives_planned=len(plan.collectives), collectives_run=len(fused.collectives),
              cross_process_ops=len(ops), group_sizes=sizes, nodes=len(rewritten.graph_def.node),
              graph_bytes=rewritten.graph_def.ByteSize(), peak_python_mb=peak / 2**20)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", default="1,8,64,512")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  rows = []
  for workers in (int(w) for w in args.workers.split(",")):
    row = measure(workers)
    rows.append(row)
    print(f"{workers} workers x {DEVICES_PER_WORKER} ({row['devices']} devices): trace {row['trace_s']:.2f} s, "
          f"plan {row['plan_s']:.3f} s, fuse {row['fuse_s']:.3f} s, apply {row['apply_s']:.3f} s; "
          f"{row['collectives_planned']} collectives -> {row['collectives_run']} run, {row['cross_process_ops']} "
          f"cross-process op(s) of group size {row['group_sizes']}; {row['nodes']} nodes, "
          f"{row['graph_bytes'] / 1e3:.0f} kB; peak {row['peak_python_mb']:.1f} MB", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
