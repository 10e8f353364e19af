"""A worker process: one TensorFlow gRPC server, nothing else.

The client (a :class:`replicator.MultiWorkerReplicator`) builds and sends the
graph; a worker only runs its part. Start one per task::

  python -m replicator.worker --cluster '{"worker": ["localhost:2222", "localhost:2223"]}' --task 0 --devices 2
  TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' python -m replicator.worker --devices 2

``--devices k`` gives the worker k logical CPU devices (``device_count``), so
one machine can host several replicas per worker.
"""

from __future__ import annotations

import argparse
import os
import sys


def serve(cluster, task: int, devices: int = 1):
  """Starts the worker server of ``task`` and returns it (``server.join()`` blocks)."""
  import tensorflow as tf

  from replicator import _cluster
  cluster = _cluster.parse(cluster)
  cluster.check_task(task)
  config = tf.compat.v1.ConfigProto(device_count={"CPU": devices})
  return tf.distribute.Server(cluster.spec, job_name=_cluster.JOB, task_index=task, protocol="grpc",
                              config=config, start=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cluster", help="JSON cluster spec, e.g. '{\"worker\": [\"localhost:2222\"]}' (default: TF_CONFIG)")
  parser.add_argument("--task", type=int, help="this worker's index (default: TF_CONFIG's task index)")
  parser.add_argument("--devices", type=int, default=1, help="logical CPU devices of this worker")
  args = parser.parse_args(argv)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

  from replicator import _cluster
  from replicator import _errors
  try:
    if args.cluster is not None:
      cluster, task = _cluster.parse(args.cluster), args.task
    else:
      cluster, task_config = _cluster.from_tf_config()
      task = args.task if args.task is not None else task_config.get("index")
    if task is None:
      raise _errors.ClusterConfigError("No task index: pass --task i (or set TF_CONFIG's task.index).")
    cluster.check_task(task)
    if args.devices < 1:
      raise _errors.ClusterConfigError(f"--devices must be >= 1, found {args.devices}.")
  except _errors.ClusterConfigError as e:
    sys.exit(f"replicator.worker: {e}")
  server = serve(cluster.spec.as_dict(), task, args.devices)
  print(f"replicator worker {task} ready at {cluster.workers[task]} with {args.devices} device(s)", flush=True)
  server.join()


if __name__ == "__main__":
  main()
