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

from replicator import _errors

JOB = "worker"

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
    "Fix: e.g. 'localhost:2222'."
)
TASK_OUT_OF_RANGE = (
    "Task index {index} is out of range: the cluster has {count} worker(s), indices "
    "0..{last}. Fix: use an index in that range, or add the worker's address to the cluster."
)
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
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.workers):
      raise _errors.ClusterConfigError(TASK_OUT_OF_RANGE.format(
          index=index, count=len(self.workers), last=len(self.workers) - 1))
    return index


def parse(cluster: Any) -> Cluster:
  """A :class:`Cluster` from a dict, ``tf.train.ClusterSpec``, cluster resolver or JSON string."""
  if isinstance(cluster, str):
    try:
      cluster = json.loads(cluster)
    except ValueError as e:
      raise _errors.ClusterConfigError(MALFORMED_TF_CONFIG.format(error=e, value=cluster)) from None
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
    host, sep, port = str(address).rpartition(":")
    if not isinstance(address, str) or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise _errors.ClusterConfigError(BAD_ADDRESS.format(task=task, address=address))
  return Cluster(tuple(workers))


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


def probe(address: str, timeout: float) -> str | None:
  """None if a TCP connection to ``address`` succeeds within ``timeout`` seconds, else why not."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host, int(port)), timeout=timeout):
      return None
  except OSError as e:
    return e.strerror or type(e).__name__


def wait_reachable(cluster: Cluster, timeout: float, tasks=None) -> None:
  """Waits until every worker accepts connections; WorkerUnavailableError after ``timeout``."""
  start = time.monotonic()
  for task in (range(len(cluster.workers)) if tasks is None else tasks):
    address = cluster.workers[task]
    while True:
      reason = probe(address, timeout=min(1.0, timeout))
      if reason is None:
        break
      if time.monotonic() - start >= timeout:
        raise _errors.WorkerUnavailableError(UNREACHABLE.format(
            task=task, address=address, reason=reason, seconds=time.monotonic() - start), task, address)
      time.sleep(0.1)


