"""Cluster specifications: parsing, validation and reachability, before anything runs.

A cluster is TensorFlow's: a ``{"worker": ["host:port", ...]}`` mapping (or a
``tf.train.ClusterSpec``, a cluster resolver, or ``TF_CONFIG``'s JSON). Every
mistake is reported here with the offending value and a fix, so that no
training starts on a cluster that cannot work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from replicator.core import _errors

JOB = "worker"

MALFORMED_CLUSTER = (
    "The cluster {value!r} is not valid JSON ({error}). Expected e.g. "
    '\'{{"worker": ["host0:2222", "host1:2222"]}}\' (an IPv6 host in brackets: "[::1]:2222").'
)
MALFORMED_TF_CONFIG = (
    "TF_CONFIG is not valid JSON ({error}): {value!r}. Expected e.g. "
    '\'{{"cluster": {{"worker": ["host0:2222", "host1:2222"]}}, "task": {{"type": "worker", "index": 0}}}}\'.'
)
NO_WORKERS = (
    "The cluster {cluster!r} has no '{job}' job with at least one address. Expected e.g. "
    "{{'worker': ['localhost:2222', 'localhost:2223']}}. Fix: list the worker processes' "
    "addresses under 'worker'."
)
BAD_ADDRESS = (
    "Worker {task}'s address {address!r} is not 'host:port' with a port in 1..65535. "
    "Fix: e.g. 'localhost:2222', or '[::1]:2222' for an IPv6 address."
)
TASK_OUT_OF_RANGE = (
    "Task index {index} is out of range: the cluster has {count} worker(s), indices "
    "0..{last}. Fix: use an index in that range, or add the worker's address to the cluster."
)
TASK_NOT_AN_INT = (
    "Task index {index!r} is a {kind}, not an integer. Fix: write it as a number, e.g. "
    '"task": {{"type": "worker", "index": 0}} (not "0").'
)
NOT_A_WORKER = (
    "Worker {task} at {address} accepts TCP connections but is not a TensorFlow worker: it did not "
    "answer the gRPC (HTTP/2) handshake within {seconds:.1f} s. Fix: check the address (another "
    "service listens on that port?), and start the worker there with python -m replicator.worker "
    "--cluster ... --task {task}."
)
BAD_TIMEOUT = "{name}={value!r}: needs a number of seconds {bound}."
UNREACHABLE = (
    "Worker {task} at {address} is unreachable ({reason}) after {seconds:.1f} s. Fix: start "
    "it first (python -m replicator.worker --cluster ... --task {task}), check the address, "
    "or raise connect_timeout."
)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A validated list of worker addresses (task i at ``workers[i]``)."""

  workers: tuple[str, ...]

  @property
  def spec(self) -> tf.train.ClusterSpec:
    return tf.train.ClusterSpec({JOB: list(self.workers)})

  def task_name(self, task: int) -> str:
    return f"/job:{JOB}/replica:0/task:{task}"

  def check_task(self, index: Any) -> int:
    if not isinstance(index, int) or isinstance(index, bool):
      raise _errors.ClusterConfigError(TASK_NOT_AN_INT.format(index=index, kind=type(index).__name__))
    if not 0 <= index < len(self.workers):
      raise _errors.ClusterConfigError(TASK_OUT_OF_RANGE.format(
          index=index, count=len(self.workers), last=len(self.workers) - 1))
    return index


def parse(cluster: Any) -> Cluster:
  """A :class:`Cluster` from a dict, ``tf.train.ClusterSpec``, cluster resolver or JSON string."""
  if isinstance(cluster, str):
    try:
      cluster = json.loads(cluster)
    except ValueError as e:
      raise _errors.ClusterConfigError(MALFORMED_CLUSTER.format(error=e, value=cluster)) from None
  if hasattr(cluster, "cluster_spec"):  # a cluster resolver
    cluster = cluster.cluster_spec()
  if isinstance(cluster, tf.train.ClusterSpec):
    cluster = cluster.as_dict()
  workers = cluster.get(JOB) if isinstance(cluster, Mapping) else None
  if isinstance(workers, Mapping):  # {"worker": {0: "host:port"}}
    workers = [workers[k] for k in sorted(workers)]
  if not isinstance(workers, (list, tuple)) or not workers:
    raise _errors.ClusterConfigError(NO_WORKERS.format(cluster=cluster, job=JOB))
  for task, address in enumerate(workers):
    if host_and_port(address) is None:
      raise _errors.ClusterConfigError(BAD_ADDRESS.format(task=task, address=address))
  return Cluster(tuple(workers))


def host_and_port(address: Any) -> tuple[str, int] | None:
  """``("::1", 2222)`` for ``"[::1]:2222"``, ``("host", 2222)`` for ``"host:2222"``; None if malformed."""
  if not isinstance(address, str):
    return None
  host, sep, port = address.rpartition(":")
  if host.startswith("[") and host.endswith("]"):  # a bracketed IPv6 address, as URLs and gRPC write it
    host = host[1:-1]
  elif ":" in host:
    return None  # an unbracketed IPv6 address: which colon starts the port is ambiguous
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    return None
  return host, int(port)


def from_tf_config(value: str | None = None) -> tuple[Cluster, dict]:
  """The cluster and task of ``TF_CONFIG`` (the environment variable by default)."""
  if value is None:
    value = os.environ.get("TF_CONFIG")
    if not value:
      raise _errors.ClusterConfigError(
          "TF_CONFIG is not set. Fix: export TF_CONFIG='{\"cluster\": {\"worker\": [\"host0:2222\", "
          "\"host1:2222\"]}}' or pass the cluster to MultiWorkerReplicator(cluster=...).")
  try:
    config = json.loads(value)
  except ValueError as e:
    raise _errors.ClusterConfigError(MALFORMED_TF_CONFIG.format(error=e, value=value)) from None
  if not isinstance(config, dict) or "cluster" not in config:
    raise _errors.ClusterConfigError(MALFORMED_TF_CONFIG.format(error="no 'cluster' key", value=value))
  cluster = parse(config["cluster"])
  task = config.get("task") or {}
  if not isinstance(task, dict):
    raise _errors.ClusterConfigError(MALFORMED_TF_CONFIG.format(error="'task' is not an object", value=value))
  if task.get("type", JOB) == JOB and "index" in task:
    cluster.check_task(task["index"])
  return cluster, task


def from_resolver(resolver, task: int | None = None) -> tuple[Cluster, int | None]:
  """The cluster of a TensorFlow cluster resolver, and this process's worker task (``task``, else the resolver's).

  The resolver's own task counts once its ``cluster_spec()`` has run (``SlurmClusterResolver`` sets it there,
  from ``SLURM_PROCID``); a resolver that knows none (Kubernetes's) gives None unless ``task`` is passed.
  """
  if not hasattr(resolver, "cluster_spec"):
    raise _errors.ClusterConfigError(
        f"from_cluster_resolver() takes a tf.distribute.cluster_resolver.ClusterResolver (TFConfigClusterResolver, "
        f"SlurmClusterResolver, KubernetesClusterResolver, SimpleClusterResolver), not {type(resolver).__name__}. "
        f"Fix: pass a resolver, or the cluster itself to MultiWorkerReplicator(cluster=...).")
  cluster = parse(resolver)
  if task is None and getattr(resolver, "task_type", None) in (None, JOB):
    found = getattr(resolver, "task_id", None)
    task = None if found is None else int(found)
  if task is not None:
    cluster.check_task(task)
  return cluster, task


def probe(address: str, timeout: float) -> str | None:
  """None if a TCP connection to ``address`` succeeds within ``timeout`` seconds, else why not."""
  try:
    with socket.create_connection(host_and_port(address), timeout=timeout):
      return None
  except OSError as e:
    return e.strerror or type(e).__name__


# The HTTP/2 client connection preface and an empty SETTINGS frame: a gRPC
# server (a TensorFlow worker) answers with a SETTINGS frame of its own.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def speaks_grpc(address: str, timeout: float) -> bool:
  """Whether ``address`` answers the HTTP/2 handshake (as a TensorFlow worker's gRPC server does) in time."""
  try:
    with socket.create_connection(host_and_port(address), timeout=timeout) as connection:
      connection.settimeout(timeout)
      connection.sendall(_HTTP2_PREFACE)
      header = b""
      while len(header) < 9:
        chunk = connection.recv(9 - len(header))
        if not chunk:
          return False
        header += chunk
      return header[3] == 4  # the frame type: SETTINGS
  except OSError:
    return False


def check_timeout(name: str, value: Any, allow_zero: bool) -> float:
  """A timeout argument as float seconds, or a clear error."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
    bound = ">= 0 (0: wait forever)" if allow_zero else "> 0"
    raise _errors.ArgumentError(BAD_TIMEOUT.format(name=name, value=value, bound=bound))
  return float(value)


def wait_reachable(cluster: Cluster, timeout: float, tasks=None) -> None:
  """Waits until every worker answers as a TensorFlow worker; WorkerUnavailableError after ``timeout``.

  A port that accepts connections but does not answer the gRPC handshake is
  reported as not a worker (connecting TensorFlow to it would hang).
  """
  start = time.monotonic()
  for task in (range(len(cluster.workers)) if tasks is None else tasks):
    address = cluster.workers[task]
    while True:
      left = max(0.1, timeout - (time.monotonic() - start))
      reason = probe(address, timeout=min(1.0, left))
      if reason is None and speaks_grpc(address, timeout=min(2.0, left)):
        break
      if time.monotonic() - start >= timeout:
        seconds = time.monotonic() - start
        message = (UNREACHABLE.format(task=task, address=address, reason=reason, seconds=seconds) if reason
                   else NOT_A_WORKER.format(task=task, address=address, seconds=seconds))
        raise _errors.WorkerUnavailableError(message, task, address)
      time.sleep(0.1)


