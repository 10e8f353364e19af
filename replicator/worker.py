"""A worker process: one TensorFlow gRPC server, nothing else.

The client (a :class:`replicator.MultiWorkerReplicator`) builds and sends the
graph; a worker only runs its part. Start one per task::

  python -m replicator.worker --cluster '{"worker": ["localhost:2222", "localhost:2223"]}' --task 0 --devices 2
  TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' python -m replicator.worker --devices 2

``--devices k`` gives the worker k logical CPU devices (``device_count``), so
one machine can host several replicas per worker.

Security: the server is TensorFlow's gRPC runtime. It listens on every network
interface, IPv4 and IPv6, whatever host the cluster address names: TensorFlow
2.21's ``GrpcServer`` asks gRPC for ``0.0.0.0:port``, which gRPC opens as one
dual-stack ``[::]`` socket (``ss -ltn`` shows ``*:port``), and neither
``ServerDef`` nor ``ConfigProto`` has a bind address; the host is used only by
clients. It has no authentication and no encryption: anyone who can reach the
port can run any TensorFlow op as this process's user, file reads and writes
included. The worker says so in one line on stderr when it starts (``NOTICE``).
Run workers on a private network only, or firewall their ports.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys

NOTICE = (
    "replicator.worker: task {task} serves TensorFlow's gRPC runtime on port {port} of every network interface, "
    "IPv4 and IPv6 (TensorFlow cannot bind it to {host} alone), without authentication or encryption: anyone who "
    "can reach this port can run any TensorFlow op as {user}, including reading and writing files. Run workers on "
    "a private network only, or firewall the port."
)


def notice(address: str, task: int) -> str:
  """The one-line security notice of the worker serving ``address`` (``host:port``) as ``task``."""
  host, _, port = address.rpartition(":")
  try:
    user = f"user {getpass.getuser()}"
  except (KeyError, OSError, ImportError):  # no name for this uid (e.g. in a container)
    user = "this process's user"
  return NOTICE.format(task=task, port=port, host=host, user=user)


PORT_TAKEN = (
    "Worker {task} cannot listen on port {port} ({address}): another process holds it ({reason}). Fix: stop "
    "that process, or give this worker a free port in the cluster spec (every worker and the client must use "
    "the same spec)."
)


def could_not_start(address: str, task: int, error: Exception) -> str:
  """Why the server of ``task`` did not start: a taken port named as such, else TensorFlow's error."""
  import socket

  from replicator.integrations import _cluster
  _, port = _cluster.host_and_port(address)
  # The server listens on every interface (see the module's docstring), dual-stack where IPv6 exists: so
  # does this probe.
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
    try:
      probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
      continue  # no IPv6 on this machine
    with probe:
      try:
        probe.bind((host, port))
      except OSError as taken:
        return PORT_TAKEN.format(task=task, port=port, address=address, reason=taken.strerror)
    break
  return f"worker {task} at {address} did not start: {error}"


def serve(cluster, task: int, devices: int = 1):
  """Starts the worker server of ``task`` and returns it (``server.join()`` blocks)."""
  import tensorflow as tf

  from mesh import _devices
  from replicator.integrations import _cluster
  cluster = _cluster.parse(cluster)
  cluster.check_task(task)
  # As replicator.virtual_cpus: a worker's logical CPUs run at once, a kernel gets cores // devices threads.
  config = tf.compat.v1.ConfigProto(device_count={"CPU": devices},
                                    intra_op_parallelism_threads=_devices.intra_op_threads_for(devices))
  return tf.distribute.Server(cluster.spec, job_name=_cluster.JOB, task_index=task, protocol="grpc",
                              config=config, start=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cluster", help="JSON cluster spec, e.g. '{\"worker\": [\"localhost:2222\"]}' (default: TF_CONFIG)")
  parser.add_argument("--task", type=int, help="this worker's index (default: TF_CONFIG's task index)")
  parser.add_argument("--devices", type=int, default=1, help="logical CPU devices of this worker")
  args = parser.parse_args(argv)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

  from replicator.core import _errors
  from replicator.integrations import _cluster
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
  try:
    server = serve(cluster.spec.as_dict(), task, args.devices)
  except Exception as e:  # pylint: disable=broad-except  (TensorFlow says only "Could not start gRPC server")
    sys.exit(f"replicator.worker: {could_not_start(cluster.workers[task], task, e)}")
  print(notice(cluster.workers[task], task), file=sys.stderr, flush=True)
  print(f"replicator worker {task} ready at {cluster.workers[task]} with {args.devices} device(s)", flush=True)
  server.join()


if __name__ == "__main__":
  main()
