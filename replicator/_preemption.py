"""Preemption: SIGTERM to any worker of a job saves a checkpoint at the next step boundary, in every process.

A cluster manager that takes a machine back sends its process SIGTERM and,
after a grace period, SIGKILL. In a multi-client job the processes must stop
at the same step (a process that stops alone leaves the others waiting in
their next collective), so a signal only records the request; at each step
boundary every process calls :meth:`PreemptionHandler.stop_requested`, which
asks whether any process was signalled (one all-reduce of a flag across the
workers' first devices, every process the same answer), and if so saves the
checkpoint (the owning process writes) and returns True in every process: the
loop ends and the program exits cleanly.
"""

from __future__ import annotations

import signal
import threading


class PreemptionHandler:
  """Made by :meth:`replicator.MultiWorkerReplicator.preemption_handler`; see the module's docstring.

  Args:
    manager: the job's checkpoint manager (``repl.checkpoint_manager(...)``).
    agree: ``agree(flag) -> bool``, whether any process's flag is True (True: this process's alone).
    signals: the signals that ask for a stop (SIGTERM by default).
  """

  def __init__(self, manager, agree, signals=(signal.SIGTERM,)):
    self._manager = manager
    self._agree = agree
    self._requested = threading.Event()
    self._previous = {}
    if threading.current_thread() is threading.main_thread():  # (signals reach the main thread only)
      for signum in signals:
        self._previous[signum] = signal.signal(signum, self._on_signal)

  def _on_signal(self, signum, frame):  # pylint: disable=unused-argument
    self._requested.set()

  @property
  def signalled(self) -> bool:
    """Whether this process received a stop signal."""
    return self._requested.is_set()

  def stop_requested(self, checkpoint_number: int | None = None) -> bool:
    """At a step boundary, in every process: whether any process was signalled; if so, after saving the checkpoint."""
    if not self._agree(self._requested.is_set()):
      return False
    self._manager.save(checkpoint_number=checkpoint_number)
    return True

  def close(self) -> None:
    """Puts the signal handlers back."""
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}

  def __enter__(self) -> "PreemptionHandler":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
