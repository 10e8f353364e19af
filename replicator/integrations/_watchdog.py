"""A multi-client job's watchdog: a worker that does not come to a step is named, and the step fails, never hangs.

Every process of a multi-client job makes the same calls that meet the others,
in the same order: steps, and eager agreements (a variable's initial value, a
checkpoint's barrier, a preemption check). Each process's watchdog (one daemon
thread) publishes, about once an ``interval``, how many such calls the process
has started and whether it is in one, in the coordination service's key-value
store (``replicator/watchdog/<task>``). When this process has been in a call
for its ``timeout`` (``collective_timeout``), the watchdog reads the others':
a worker that has not started this call (fewer calls started, as of its last
publication) is late; if it does not accept connections it is dead, else hung
or on another path through the program. The watchdog then aborts this
process's collectives (``_tf_coordination.abort_collectives``) and keeps its
verdict, which the call's caller raises (:attr:`Watchdog.verdict`).

The collectives' own timeout (TensorFlow's, a collective that waits that long
fails) stays for what the watchdog cannot tell apart: every worker in the
step, and a collective still not complete (another number of collectives, a
step longer than the timeout). It is set later than the watchdog's decision
(:func:`backstop`): TensorFlow 2.21 sometimes crashes while it aborts a ring
all-reduce that timed out, which the watchdog's abort does not (tested).

Cost: one small write to worker 0's key-value store a second from each
process's thread, none on the step's path (the step only counts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

from replicator.integrations import _cluster
from replicator.integrations import _tf_coordination

KEY = "replicator/watchdog/{task}"

LATE = (
    "Worker {task} at {address} has not come to {what}: this process started it {waited:.0f} s ago (its call #{call} "
    "of the ones every worker makes alike: steps and agreements; collective_timeout={timeout:g} s), and worker {task} "
    "has started {theirs}. It accepts connections: it is hung, or runs another path through the program (a step "
    "fewer, an evaluation or a save the others do not make). Fix: look at worker {task}'s output for an error or a "
    "hang; make every worker run the same steps; raise collective_timeout if a worker really takes longer between "
    "steps; then restart the job and restore the last checkpoint."
)
DEAD = (
    "Worker {task} at {address} is unavailable: it does not accept connections (the process died, or its machine or "
    "the network is down), and {what} (this process's call #{call}) has waited for it {waited:.0f} s "
    "(collective_timeout={timeout:g} s). Fix: restart the job, every worker with one fewer if that machine is gone, "
    "and restore the last checkpoint (a multi-client job cannot take a worker back in: TensorFlow's collective "
    "runtime is formed once per process)."
)


def backstop(timeout: float) -> float:
  """The collectives' own timeout for a watchdog deciding at ``timeout`` (0: none): later, by the time it takes."""
  return 0.0 if timeout == 0 else timeout + max(5.0, 0.2 * timeout)


@dataclasses.dataclass(frozen=True)
class Verdict:
  """Why the watchdog aborted this process's collectives."""

  task: int
  address: str
  message: str


class Watchdog:
  """One process's watchdog (see the module docstring); :func:`for_job` makes the process's one.

  Args:
    addresses: every worker's address, worker by worker.
    task: this process's worker.
    interval: seconds between the thread's wakes (publications and checks).
  """

  def __init__(self, addresses, task: int, interval: float = 1.0):
    self._addresses, self._task, self._interval = tuple(addresses), task, interval
    self._lock = threading.Lock()
    self._calls = 0  # calls started (steps, agreements)
    self._inside = False
    self._depth = 0
    self._since = 0.0  # when the current call started (monotonic)
    self._timeout = 0.0  # the current call's
    self._what = ""
    self._checked = -1  # the call last checked
    self._published = None
    self._thread = None
    self._closed = threading.Event()
    self.verdict: Verdict | None = None

  @contextlib.contextmanager
  def watching(self, timeout: float, what: str = "this step"):
    """The body is one call every worker makes (a step, an agreement); after ``timeout`` s (0: never) a late one is named.

    ``what`` names the call in the error ("this step"). Calls made inside one
    (an agreement while a step is traced) are not counted.
    """
    with self._lock:
      self._depth += 1
      if self._depth == 1:  # (a call made inside one, by the library: the outer call is the one counted)
        self._calls += 1
        self._inside, self._since, self._timeout, self._what = True, time.monotonic(), timeout, what
      if self._thread is None and len(self._addresses) > 1:
        self._thread = threading.Thread(target=self._loop, name="replicator-watchdog", daemon=True)
        self._thread.start()
    try:
      yield
    finally:
      with self._lock:
        self._depth -= 1
        self._inside = self._depth > 0

  def close(self) -> None:
    """Stops the thread (after its current wake); the process's watchdog runs as long as the process."""
    self._closed.set()

  def _loop(self) -> None:
    while not self._closed.wait(self._next_wake()):
      try:
        self._beat()
      except Exception:  # noqa: BLE001  (the watchdog never takes the process down; the collectives' timeout stays)
        pass

  def _next_wake(self) -> float:
    """Seconds to the next wake: an interval, or less when the current call is due for its check sooner."""
    with self._lock:
      if self._inside and self._timeout > 0 and self._checked != self._calls:
        due = self._since + self._timeout - time.monotonic()
        return min(self._interval, max(0.01, due))
    return self._interval

  def _beat(self) -> None:
    with self._lock:
      state = (self._calls, self._inside)
      call, waited, timeout, what = self._calls, time.monotonic() - self._since, self._timeout, self._what
      due = self._inside and timeout > 0 and waited >= timeout and self._checked != call
      if due:
        self._checked = call
    if state != self._published:
      _tf_coordination.publish(KEY.format(task=self._task), f"{state[0]} {int(state[1])}")
      self._published = state
    if due and self.verdict is None:
      verdict = self._late(call, waited, timeout, what)
      if verdict is not None:
        self.verdict = verdict
        _tf_coordination.abort_collectives(verdict.message)

  def _late(self, call: int, waited: float, timeout: float, what: str) -> Verdict | None:
    """The worker that keeps call ``call`` waiting: a dead one first, else one that has not started it; or None.

    A dead worker may have died inside the call (its count says it came); so
    every other worker is probed, and a dead one explains the wait whatever
    its count. Worker 0 serves the store: when a read fails and worker 0 is
    dead, it is named at once (no more reads to wait for).
    """
    def verdict(task, form, **extra):
      address = self._addresses[task]
      return Verdict(task, address, form.format(task=task, address=address, call=call, waited=waited,
                                                timeout=timeout, what=what, **extra))

    peers = [task for task in range(len(self._addresses)) if task != self._task]
    found = {}
    for task in peers:
      found[task] = _tf_coordination.read(KEY.format(task=task), timeout_seconds=1.0)
      if found[task] is None and self._task != 0 and _cluster.probe(self._addresses[0], timeout=1.0) is not None:
        return verdict(0, DEAD)
    for task in peers:
      if _cluster.probe(self._addresses[task], timeout=1.0) is not None:
        return verdict(task, DEAD)
    for task in peers:
      if found[task] is None and task == 0:
        continue  # (worker 0 serves the store: its key unread tells nothing while it accepts connections)
      theirs = int(found[task].split()[0]) if found[task] else 0
      if theirs < call:
        return verdict(task, LATE, theirs=theirs)
    return None


_watchdogs: dict = {}


def for_job(addresses, task: int) -> Watchdog:
  """This process's watchdog for the job at ``addresses`` (one a process: its step calls are counted once)."""
  key = (tuple(addresses), task)
  if key not in _watchdogs:
    _watchdogs[key] = Watchdog(addresses, task)
  return _watchdogs[key]
