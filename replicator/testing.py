"""Helpers for tests and examples: a real local cluster of worker processes.

Examples:
  >>> from replicator import testing
  >>> with testing.local_cluster(num_workers=2, devices_per_worker=2) as cluster:  # doctest: +SKIP
  ...   repl = replicator.MultiWorkerReplicator(cluster=cluster.spec)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from replicator.core import _errors
from replicator.integrations import _cluster
from replicator.launch import free_ports


class LocalCluster:
  """Worker server processes on loopback ports (``python -m replicator.worker``).

  Attributes:
    addresses: ``host:port`` of each task.
    devices_per_worker: logical CPU devices of each worker.
  """

  def __init__(self, num_workers: int, devices_per_worker: int = 1, start_timeout: float = 60.0):
    if num_workers < 1 or devices_per_worker < 1:
      raise _errors.ArgumentError(f"local_cluster needs num_workers >= 1 and devices_per_worker >= 1, found "
                       f"{num_workers} and {devices_per_worker}.")
    self.addresses = tuple(f"localhost:{p}" for p in free_ports(num_workers))
    self.devices_per_worker = devices_per_worker
    self.start_timeout = start_timeout
    self._processes: dict[int, subprocess.Popen] = {}
    self._logs = tempfile.mkdtemp(prefix="replicator_cluster_")

  @property
  def spec(self) -> dict:
    """The cluster as ``{"worker": [addresses]}``."""
    return {_cluster.JOB: list(self.addresses)}

  @property
  def num_workers(self) -> int:
    return len(self.addresses)

  def log(self, task: int) -> str:
    """The worker's output so far."""
    path = os.path.join(self._logs, f"worker_{task}.log")
    if not os.path.exists(path):
      return ""
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read()

  def start(self, tasks=None) -> None:
    """Starts the given tasks (default: all) and waits until they accept connections."""
    tasks = range(self.num_workers) if tasks is None else tasks
    for task in tasks:
      if self.alive(task):
        continue
      log = open(os.path.join(self._logs, f"worker_{task}.log"), "ab")  # noqa: SIM115  (owned by the child)
      env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
      env.pop("TF_CONFIG", None)
      self._processes[task] = subprocess.Popen(
          [sys.executable, "-m", "replicator.worker", "--cluster", json.dumps(self.spec),
           "--task", str(task), "--devices", str(self.devices_per_worker)],
          stdout=log, stderr=subprocess.STDOUT, env=env)
      log.close()
    deadline = time.monotonic() + self.start_timeout
    for task in tasks:
      while _cluster.probe(self.addresses[task], timeout=0.5) is not None:
        process = self._processes[task]
        if process.poll() is not None:
          raise _errors.WorkerUnavailableError(
              f"Worker {task} exited with code {process.returncode} while starting:\n{self.log(task)[-2000:]}",
              task, self.addresses[task])
        if time.monotonic() > deadline:
          raise _errors.WorkerUnavailableError(
              f"Worker {task} did not start listening at {self.addresses[task]} within "
              f"{self.start_timeout:.0f} s:\n{self.log(task)[-2000:]}", task, self.addresses[task])
        time.sleep(0.1)

  def alive(self, task: int) -> bool:
    process = self._processes.get(task)
    return process is not None and process.poll() is None

  def kill(self, task: int) -> None:
    """Kills worker ``task`` (SIGKILL, as a crash would) and waits for it to exit."""
    process = self._processes.get(task)
    if process is not None and process.poll() is None:
      process.kill()
      process.wait()

  def restart(self, task: int) -> None:
    """Kills (if needed) and starts worker ``task`` again on the same address."""
    self.kill(task)
    self.start([task])

  def stop(self) -> None:
    """Stops every worker."""
    for task in list(self._processes):
      process = self._processes[task]
      if process.poll() is None:
        process.terminate()
    for process in self._processes.values():
      try:
        process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def local_cluster(num_workers: int = 2, devices_per_worker: int = 1, start_timeout: float = 60.0) -> Iterator[LocalCluster]:
  """Starts ``num_workers`` worker processes on loopback ports; stops them on exit.

  Args:
    num_workers: worker processes (tasks).
    devices_per_worker: logical CPU devices each worker offers.
    start_timeout: seconds to wait for the workers to listen.

  Yields:
    The :class:`LocalCluster` (``cluster.spec`` is the cluster for
    ``MultiWorkerReplicator``; ``kill``/``restart`` simulate failures).
  """
  cluster = LocalCluster(num_workers, devices_per_worker, start_timeout)
  try:
    cluster.start()
    yield cluster
  finally:
    cluster.stop()
