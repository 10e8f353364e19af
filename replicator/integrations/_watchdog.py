"""A multi-client job's watchdog: a worker that does not come to a step, or leaves it early, is named; never a hang.

Every process of a multi-client job makes the same calls that meet the others,
in the same order: steps, and eager agreements (a variable's initial value, a
checkpoint's barrier, a preemption check). Each process's watchdog (one daemon
thread) publishes, about once an ``interval``, how many such calls the process
has started, whether it is in one, and whether the last one it left failed, in
the coordination service's key-value store (``replicator/watchdog/<task>``).
When this process has been in a call for its ``timeout``
(``collective_timeout``), the watchdog reads the others': a worker that has
not started this call (fewer calls started, as of its last publication) is
late; if it does not accept connections it is dead, else hung or on another
path through the program. A worker that has left this call (finished it, or
started a later one) while this process is still in it ran fewer collectives
in it than this one (a loop with more iterations here): this process waits in
a collective that worker never runs. The watchdog then aborts this process's
collectives (``_tf_coordination.abort_collectives``) and keeps its verdict,
which the call's caller raises (:attr:`Watchdog.verdict`). Until the
collectives' own timeout (:func:`backstop`) it reads them again every
``interval`` (a worker may publish its finish late).

A worker that left the call is no proof that this process waits in a
collective: one whose step still works alone after its last collective is in
the call too. TensorFlow has no public way to tell, so a step still running in
this process ``timeout`` after it started it, while another worker has
finished it, is stopped as well (the message says to raise
``collective_timeout`` then).

A process that ends closes its connections: a collective waiting for it fails
at once, looking dead, and worker 0 takes the key-value store with it. So at
its end a process waits (:meth:`Watchdog.linger`, at most until the
collectives' own timeout) while another worker is in a call, or behind it:
that worker's watchdog names it for what it did.

The collectives' own timeout (TensorFlow's, a collective that waits that long
fails) stays for what the watchdog cannot tell apart: every worker still in
the call, and a collective not complete (the workers wait in different
collectives, or one is stuck in the step's own work). It is set later than
the watchdog's decision (:func:`backstop`): TensorFlow 2.21 sometimes crashes
while it aborts a collective that timed out, which the watchdog's abort does
not (tested).

Cost: one small write to worker 0's key-value store a second from each
process's thread, none on the step's path (the step only counts); reads only
in a call that has lasted ``timeout``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import sys
import threading
import time

import tensorflow as tf

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
FINISHED = (
    "Worker {task} at {address} finished {what}{ended} while this process is still in it, {waited:.0f} s after it "
    "started it (its call #{call} of the ones every worker makes alike: steps and agreements; "
    "collective_timeout={timeout:g} s). Every worker must run the same collectives in it, in the same order; every "
    "worker came to it, but this process waits in a collective that worker {task} never ran: they ran different "
    "collectives (a tf.while_loop whose body communicates running more iterations here, a tf.cond taking another "
    "branch). Fix: make every worker's loops run as many iterations and its branches take the same side (decide "
    "them from values alike in every worker, e.g. a repl.reduce of each worker's condition); if instead this "
    "process's step really runs that long, its work after its last collective outlasting worker {task}'s, raise "
    "collective_timeout above the step's time; then restart the job and restore the last checkpoint."
)
LEFT = (
    "Worker {task} at {address} left {what} with an error{ended} while this process is still in it, {waited:.0f} s "
    "after it started it (its call #{call} of the ones every worker makes alike: steps and agreements; "
    "collective_timeout={timeout:g} s): its call failed, and this process waits in a collective of it that worker "
    "{task} will not run. Fix: look at worker {task}'s output for the error; let an error in a step end every "
    "worker's program (not go on in one); then restart the job and restore the last checkpoint."
)
ENDED = " and its process has ended since (it does not accept connections)"


def backstop(timeout: float) -> float:
  """The collectives' own timeout for a watchdog deciding at ``timeout`` (0: none): later, by the time it takes."""
  return 0.0 if timeout == 0 else timeout + max(5.0, 0.2 * timeout)


@dataclasses.dataclass(frozen=True)
class Verdict:
  """Why the watchdog aborted this process's collectives."""

  task: int
  address: str
  message: str


@dataclasses.dataclass(frozen=True)
class State:
  """A process's published state: calls started, whether in one, whether the last one it left failed."""

  calls: int
  inside: bool
  failed: bool = False

  @classmethod
  def parse(cls, text: str | None) -> State | None:
    """The state published as ``text`` ("calls inside failed"); None if there is none (or it is not one)."""
    try:
      fields = [int(f) for f in (text or "").split()]
      return cls(fields[0], bool(fields[1]), len(fields) > 2 and bool(fields[2]))
    except (ValueError, IndexError):
      return None

  def __str__(self) -> str:
    return f"{self.calls} {int(self.inside)} {int(self.failed)}"

  def left(self, call: int) -> bool:
    """Whether this process has left call number ``call`` (finished it, or failed in it), as of this state."""
    return self.calls > call or (self.calls == call and not self.inside)


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
    self._publishing = threading.Lock()
    self._calls = 0  # calls started (steps, agreements)
    self._inside = False
    self._failed = False  # the last call left raised (not the end of the input)
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
    (an agreement while a step is traced) are not counted. A body that raises
    (but for the end of the input) is published as a failed call.
    """
    with self._lock:
      self._depth += 1
      if self._depth == 1:  # (a call made inside one, by the library: the outer call is the one counted)
        self._calls += 1
        self._inside, self._since, self._timeout, self._what = True, time.monotonic(), timeout, what
      if self._thread is None and len(self._addresses) > 1:
        self._thread = threading.Thread(target=self._loop, name="replicator-watchdog", daemon=True)
        self._thread.start()
    failed = False
    try:
      yield
    except BaseException as e:
      failed = not isinstance(e, (StopIteration, tf.errors.OutOfRangeError))  # (the end of the input: not a failure)
      raise
    finally:
      with self._lock:
        self._depth -= 1
        self._inside = self._depth > 0
        if not self._inside:
          self._failed = failed

  def close(self) -> None:
    """Stops the thread (after its current wake); the process's watchdog runs as long as the process."""
    self._closed.set()

  def gone(self, task: int) -> Verdict | None:
    """For worker ``task``, which does not accept connections: the verdict if it had left the current call first.

    A worker that finished this process's current call (or failed in it) and
    then ended is not dead: this process waits in a collective it never ran.
    None if it had not (as of its last publication), or outside a call.
    """
    with self._lock:
      call, waited, timeout, what, inside = (self._calls, time.monotonic() - self._since, self._timeout, self._what,
                                             self._inside)
    state = State.parse(_tf_coordination.read(KEY.format(task=task), timeout_seconds=1.0)) if inside else None
    if state is None or not state.left(call):
      return None
    return self._left(task, state, call, waited, timeout, what, ENDED)

  def linger(self) -> None:
    """At the process's end: waits while another worker may wait for it in a collective, so that it is named right.

    A process that ends closes its connections: a collective waiting for it
    fails at once as if it had died, and worker 0's end takes the job's
    key-value store with it. So this process first publishes its last state,
    then waits while another worker that accepts connections is in a call, or
    has started fewer than this one: that worker's watchdog names this one as
    finished (or late) meanwhile. At most the collectives' own timeout of the
    last call and two intervals; not at all after a verdict, a failed call or
    an error that ends the program, nor with no timeout (0: waits are forever).
    """
    with self._lock:
      calls, timeout, failed = self._calls, self._timeout, self._failed
    ended_by_error = getattr(sys, "last_value", None) is not None  # (set when an uncaught error ends the program)
    if len(self._addresses) < 2 or calls == 0 or timeout == 0 or failed or ended_by_error or self.verdict is not None:
      return
    try:
      self._publish()
      deadline = time.monotonic() + backstop(timeout) + 2 * self._interval
      while time.monotonic() < deadline and self._awaited(calls):
        time.sleep(min(0.2, self._interval))
    except Exception:  # noqa: BLE001  (the watchdog never fails the process's end)
      pass

  def _awaited(self, calls: int) -> bool:
    """Whether another worker that accepts connections is in a call, or has started fewer than ``calls``."""
    if self._task != 0 and _cluster.probe(self._addresses[0], timeout=1.0) is not None:
      return False  # (worker 0 is gone, and the store with it)
    for task in range(len(self._addresses)):
      if task != self._task:
        state = State.parse(_tf_coordination.read(KEY.format(task=task), timeout_seconds=1.0))
        if (state is not None and (state.inside or state.calls < calls)
            and _cluster.probe(self._addresses[task], timeout=1.0) is None):
          return True
    return False

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

  def _publish(self) -> None:
    with self._publishing:
      with self._lock:
        state = State(self._calls, self._inside, self._failed)
      if state != self._published:
        _tf_coordination.publish(KEY.format(task=self._task), str(state))
        self._published = state

  def _beat(self) -> None:
    with self._lock:
      call, waited, timeout, what = self._calls, time.monotonic() - self._since, self._timeout, self._what
      # Checked at the timeout, then each wake until the collectives' own (a worker's finish may be published late).
      due = self._inside and 0 < timeout <= waited and (self._checked != call or waited < backstop(timeout))
      if due:
        self._checked = call
    self._publish()
    if due and self.verdict is None:
      verdict = self._late(call, waited, timeout, what)
      if verdict is not None:
        self.verdict = verdict
        _tf_coordination.abort_collectives(verdict.message)

  def _verdict(self, task: int, form: str, call: int, waited: float, timeout: float, what: str, **extra) -> Verdict:
    address = self._addresses[task]
    return Verdict(task, address, form.format(task=task, address=address, call=call, waited=waited, timeout=timeout,
                                              what=what, **extra))

  def _left(self, task: int, state: State, call: int, waited: float, timeout: float, what: str,
            ended: str) -> Verdict:
    """The verdict for worker ``task``, which left call ``call`` (``state``) while this process is still in it."""
    form = LEFT if state.failed and state.calls == call else FINISHED
    return self._verdict(task, form, call, waited, timeout, what, ended=ended)

  def _late(self, call: int, waited: float, timeout: float, what: str) -> Verdict | None:
    """The worker that keeps call ``call`` waiting: a dead one first, then a late one, then one that left it; or None.

    A dead worker may have died inside the call (its count says it came); so
    every other worker is probed, and a dead one explains the wait whatever
    its count, unless it had left the call before (then it finished, and
    ended). Worker 0 serves the store: when a read fails and worker 0 is
    dead, it is named at once (no more reads to wait for).
    """
    peers = [task for task in range(len(self._addresses)) if task != self._task]
    found = {}
    for task in peers:
      found[task] = State.parse(_tf_coordination.read(KEY.format(task=task), timeout_seconds=1.0))
      if found[task] is None and self._task != 0 and _cluster.probe(self._addresses[0], timeout=1.0) is not None:
        return self._verdict(0, DEAD, call, waited, timeout, what)
    for task in peers:
      if _cluster.probe(self._addresses[task], timeout=1.0) is not None:
        if found[task] is not None and found[task].left(call):
          return self._left(task, found[task], call, waited, timeout, what, ENDED)
        return self._verdict(task, DEAD, call, waited, timeout, what)
    for task in peers:
      if found[task] is None and task == 0:
        continue  # (worker 0 serves the store: its key unread tells nothing while it accepts connections)
      theirs = found[task].calls if found[task] else 0
      if theirs < call:
        return self._verdict(task, LATE, call, waited, timeout, what, theirs=theirs)
    for task in peers:
      if found[task] is not None and found[task].left(call):
        return self._left(task, found[task], call, waited, timeout, what, "")
    return None


_watchdogs: dict = {}


def for_job(addresses, task: int) -> Watchdog:
  """This process's watchdog for the job at ``addresses`` (one a process: its step calls are counted once).

  It lingers at the process's end (:meth:`Watchdog.linger`).
  """
  key = (tuple(addresses), task)
  if key not in _watchdogs:
    _watchdogs[key] = Watchdog(addresses, task)
    atexit.register(_watchdogs[key].linger)
  return _watchdogs[key]
