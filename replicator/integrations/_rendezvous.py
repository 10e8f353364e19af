"""A multi-client job's processes meet before TensorFlow starts: every start-up wait bounded, every mistake named.

TensorFlow's multi-client start (the coordination service's registration,
under ``tf.experimental.dtensor.initialize_accelerator_system``) waits without
bound for a worker that does not come, holding Python's interpreter lock (no
thread of the process runs meanwhile, so nothing in it can time the wait out:
checked on TensorFlow 2.21), and it names no mistake of the job's set-up. So,
before it starts, the processes meet over plain sockets, on the ports their
cluster gives them (the ports TensorFlow's servers take right after):

* each process listens on its own address's port: that proves the address is
  this machine's and the port free, as TensorFlow's server needs it; there it
  answers who it is (a second process claiming its task asks);
* every worker but 0 connects to worker 0 and says who it is: its task, the
  cluster it was given, its device count, its process id and host;
* worker 0 waits for every worker until ``connect_timeout``, compares what they
  said with its own, and answers each with one verdict: go, or the error that
  every process then raises (:func:`meet`).

A process that cannot take part (its address is not this machine's, its port
is held, another process claims its task) raises at once, after telling
worker 0 why (:func:`report_failure`), so that every process of the job names
the same mistake. Messages are JSON lines; nothing here uses TensorFlow.

What stays: a worker that dies between the meeting and the end of
TensorFlow's start (about a second). :class:`StartWatch` bounds that: a
separate small process that, if the start has not ended in time, prints the
named error and stops this process (TensorFlow's start cannot be interrupted).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time

from replicator.core import _errors
from replicator.integrations import _cluster

PROTOCOL = "replicator-rendezvous/1"
_LINE = 1 << 16  # bytes a message may take
_ANSWER = 2.0  # seconds a process that connected waits for the first answer of a peer of this job

MISSING = (
    "{who} did not come within {seconds:.1f} s (connect_timeout={timeout:g}): {missing}. A multi-client job starts "
    "when every worker has started its copy of the program and made its MultiWorkerReplicator (or called "
    "keras.distribution.initialize). Fix: start every worker (python -m replicator.launch starts them all on one "
    "machine; a cluster manager, every task), check that each process's TF_CONFIG names its own task, that worker "
    "0's address is reachable from every worker, or raise connect_timeout if a worker takes longer to start."
)
WORKER_0_MISSING = (
    "Worker 0 at {address} did not come within {seconds:.1f} s (connect_timeout={timeout:g}; last attempt: "
    "{reason}). Every worker reports to worker 0 at start. Fix: start worker 0 (python -m replicator.launch starts "
    "every worker on one machine), check its address in TF_CONFIG, or raise connect_timeout if it takes longer to "
    "start."
)
NOT_WORKER_0 = (
    "Worker 0's address {address} accepts connections but does not answer as worker 0 of this job ({what}): another "
    "program holds that port. Fix: stop that program (an earlier run of this job still running?), or give worker 0 "
    "another port in every process's TF_CONFIG (python -m replicator.launch picks free ports)."
)
PORT_TAKEN = (
    "Worker {task} cannot listen on its address {address}: port {port} is in use by another program ({what}). "
    "TensorFlow's server of worker {task} needs that port. Fix: stop that program (an earlier run of this job still "
    "running?), or give worker {task} another port in every process's TF_CONFIG (python -m replicator.launch picks "
    "free ports)."
)
NOT_THIS_MACHINE = (
    "Worker {task}'s address {address} is not this machine's ({host}: {reason}), yet a process ({me}) claims task "
    "{task}: TensorFlow's server of worker {task} must listen there. Fix: run worker {task} on {host}, or give that "
    "process the task whose address is its machine's (TF_CONFIG's task index)."
)
TWICE = (
    "Two processes claim worker {task} ({address}): {first} and {second}. Each task of the cluster is one process. "
    "Fix: give each process its own task index (TF_CONFIG's \"task\": {{\"type\": \"worker\", \"index\": i}}, i = 0 "
    "to {last}; python -m replicator.launch sets them), and stop the extra process."
)
OTHER_CLUSTER = (
    "Worker {task} ({who}) was given another cluster than worker 0: worker 0 has {ours}, worker {task} has {theirs}. "
    "Every process of a job needs the same cluster, the same addresses in the same order. Fix: give every process "
    "the same TF_CONFIG cluster (only its task index differs)."
)
OTHER_DEVICES = (
    "The workers run different numbers of devices: {counts}. Every worker of a multi-client job needs the same "
    "count. Fix: pass the same devices_per_worker in every process (python -m replicator.launch "
    "--devices-per-worker D sets REPLICATOR_DEVICES_PER_WORKER for all of them)."
)
GRPC = ("it answers as a gRPC server: a TensorFlow server, perhaps this worker of the job started by another process "
        "already, or of an earlier run still running")
FAILED_ELSEWHERE = "Worker {task} ({who}) cannot start, so neither can the job: {message}"


def _describe(hello: dict) -> str:
  return f"pid {hello.get('pid')} on {hello.get('host')}"


def _hello(kind: str, addresses, task: int, devices: int, **more) -> dict:
  return dict(protocol=PROTOCOL, kind=kind, task=task, cluster=list(addresses), devices=devices, pid=os.getpid(),
              host=socket.gethostname(), **more)


def _send(connection: socket.socket, message: dict) -> None:
  connection.sendall(json.dumps(message).encode() + b"\n")


def _receive(connection: socket.socket, timeout: float) -> dict | None:
  """The next message on ``connection`` within ``timeout`` s; None if it said something not of this job.

  Raises:
    TimeoutError: nothing came in time.
    ConnectionError: the connection closed first.
  """
  connection.settimeout(max(0.01, timeout))
  data = b""
  while not data.endswith(b"\n"):  # a byte at a time: what follows the line is the next message's (a few hundred)
    byte = connection.recv(1)  # (socket.timeout, a TimeoutError, when nothing comes)
    if not byte:
      raise ConnectionError(errno.ECONNRESET, "the peer closed the connection without an answer")
    if len(data) >= _LINE:
      return None
    data += byte
  try:
    message = json.loads(data)
  except ValueError:
    return None
  return message if isinstance(message, dict) and message.get("protocol") == PROTOCOL else None


def _ask(address: str, message: dict, timeout: float) -> tuple[dict | None, str]:
  """Sends ``message`` to ``address`` and returns the first answer (None: not of this job) and what was found."""
  try:
    with socket.create_connection(_cluster.host_and_port(address), timeout=timeout) as connection:
      _send(connection, message)
      answer = _receive(connection, timeout)
  except TimeoutError:
    return None, f"it answered nothing within {timeout:g} s"
  except OSError as e:
    return None, e.strerror or type(e).__name__
  if answer is None:
    return None, _other_protocol(address, timeout)
  return answer, ""


def _other_protocol(address: str, timeout: float) -> str:
  """What answers at ``address`` instead of a process of this job: a gRPC server (TensorFlow's?), or another."""
  return GRPC if _cluster.speaks_grpc(address, timeout) else "it answers in another protocol"


def _wildcard(host: str) -> tuple[int, str]:
  """The address family of ``host`` and its every-interface address (where TensorFlow's server listens)."""
  return (socket.AF_INET6, "::") if ":" in host else (socket.AF_INET, "0.0.0.0")


def _listen(addresses, task: int, devices: int, timeout: float) -> socket.socket:
  """A socket listening on this process's port, for the meeting; the named error if this process cannot have it."""
  address = addresses[task]
  host, port = _cluster.host_and_port(address)
  me = f"pid {os.getpid()} on {socket.gethostname()}"
  family, anywhere = _wildcard(host)
  try:  # the address is this machine's: a socket can be bound to it (no packet is sent)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.bind((host, 0))
  except OSError as e:
    reason = "no such host" if isinstance(e, socket.gaierror) else (e.strerror or type(e).__name__)
    raise _errors.ClusterConfigError(NOT_THIS_MACHINE.format(
        task=task, address=address, host=host, reason=reason, me=me)) from None
  listener = socket.socket(family, socket.SOCK_STREAM)
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as gRPC's own listener: TIME_WAIT is no owner)
  try:
    listener.bind((anywhere, port))
    listener.listen(64)
  except OSError as e:
    listener.close()
    if e.errno != errno.EADDRINUSE:
      raise _errors.ClusterConfigError(PORT_TAKEN.format(task=task, address=address, port=port,
                                                         what=e.strerror or type(e).__name__)) from None
    answer, what = _ask(address, _hello("who", addresses, task, devices), min(_ANSWER, timeout))
    if answer is not None and answer.get("task") == task:
      raise _errors.ClusterConfigError(TWICE.format(task=task, address=address, first=_describe(answer),
                                                    second=me, last=len(addresses) - 1)) from None
    if answer is not None:
      what = f"worker {answer.get('task')} of a job ({_describe(answer)})"
    raise _errors.ClusterConfigError(PORT_TAKEN.format(task=task, address=address, port=port, what=what)) from None
  return listener


class _Answering:
  """Answers ``who`` on ``listener`` from a thread (workers but 0, while they wait for worker 0's verdict)."""

  def __init__(self, listener: socket.socket, hello: dict):
    self._listener, self._hello = listener, hello
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._serve, name="replicator-rendezvous", daemon=True)
    self._thread.start()

  def _serve(self) -> None:
    self._listener.settimeout(0.1)
    while not self._stop.is_set():
      try:
        connection, _ = self._listener.accept()
      except TimeoutError:
        continue
      except OSError:
        return
      with connection, contextlib.suppress(OSError):
        if _receive(connection, _ANSWER) is not None:
          _send(connection, self._hello)

  def close(self) -> None:
    self._stop.set()
    with contextlib.suppress(OSError):
      self._listener.shutdown(socket.SHUT_RDWR)  # (wakes the thread's accept at once)
    self._thread.join()


def meet(addresses, task: int, devices: int, timeout: float, failure: str | None = None) -> None:
  """Meets every other process of the job (see the module docstring); returns when all came and agree.

  ``failure``: why this process cannot start (found before the meeting); every process that comes is told, and
  this one raises it (worker 0 tells those that come until the timeout; another worker tells worker 0).

  Raises:
    WorkerUnavailableError: a worker did not come within ``timeout`` seconds (every waiting process names it).
    ClusterConfigError: a mistake of the job's set-up (every process that came names the same one).
  """
  addresses = list(addresses)
  start = time.monotonic()
  try:
    listener = _listen(addresses, task, devices, timeout)
  except _errors.ClusterConfigError as e:
    report_failure(addresses, task, devices, str(e), timeout)
    raise
  with listener:
    if failure is not None and task != 0:
      listener.close()
      report_failure(addresses, task, devices, failure, timeout)
      raise _errors.ClusterConfigError(failure)
    if len(addresses) < 2:
      if failure is not None:
        raise _errors.ClusterConfigError(failure)
      return  # (the address is this machine's, its port free)
    if task == 0:
      _chair(listener, addresses, devices, start + timeout, timeout, failure)
    else:
      answering = _Answering(listener, _hello("identity", addresses, task, devices))
      try:
        _report(addresses, task, devices, start + timeout, timeout)
      finally:
        answering.close()


def report_failure(addresses, task: int, devices: int, message: str, timeout: float) -> None:
  """Tells worker 0 that this process (worker ``task``) cannot start and why, trying for ``timeout`` s at most."""
  if task == 0 or len(addresses) < 2:
    return  # (worker 0 cannot listen: the others find its port another program's, or no one there)
  deadline = time.monotonic() + timeout
  failure = _hello("failed", addresses, task, devices, message=message)
  while time.monotonic() < deadline:
    try:
      with socket.create_connection(_cluster.host_and_port(addresses[0]),
                                    timeout=max(0.1, deadline - time.monotonic())) as connection:
        _send(connection, failure)
        _receive(connection, max(0.1, deadline - time.monotonic()))  # (worker 0's acknowledgement)
        return
    except OSError:
      time.sleep(0.1)


def _raise(verdict: dict) -> None:
  if verdict.get("error") == "WorkerUnavailableError":
    raise _errors.WorkerUnavailableError(verdict["message"], verdict.get("task"), verdict.get("address"))
  raise _errors.ClusterConfigError(verdict["message"])


def _report(addresses, task: int, devices: int, deadline: float, timeout: float) -> None:
  """A worker but 0: says who it is to worker 0 and waits for its verdict (raised if not a go)."""
  address = addresses[0]
  reason = "not tried"
  hello = _hello("hello", addresses, task, devices)
  silent = 0  # connections in a row that worker 0's port accepted and nothing answered
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      raise _errors.WorkerUnavailableError(WORKER_0_MISSING.format(
          address=address, seconds=timeout - left, timeout=timeout, reason=reason), 0, address)
    try:
      connection = socket.create_connection(_cluster.host_and_port(address), timeout=min(1.0, left))
    except OSError as e:
      reason = e.strerror or type(e).__name__
      time.sleep(min(0.1, max(0.0, left)))
      continue
    with connection:
      try:
        _send(connection, hello)
        welcome = _receive(connection, _ANSWER)  # (worker 0 answers at once)
      except TimeoutError:
        silent += 1  # twice nothing: that port is another program's
        if silent < 2:
          continue
        raise _errors.ClusterConfigError(NOT_WORKER_0.format(
            address=address, what=f"it accepted connections and answered nothing within {_ANSWER:g} s")) from None
      except OSError as e:
        reason = e.strerror or type(e).__name__  # (worker 0 stopped meanwhile: it may be started again)
        continue
      if welcome is None:
        raise _errors.ClusterConfigError(NOT_WORKER_0.format(address=address, what=(
            _other_protocol(address, 1.0))))
      try:  # the verdict, once every worker came (worker 0's deadline is about this one's)
        verdict = _receive(connection, deadline - time.monotonic() + 5.0)
      except OSError as e:
        reason = f"worker 0 gave no verdict ({e.strerror or type(e).__name__})"
        continue
      if verdict is None or verdict.get("kind") != "verdict":
        reason = "worker 0's verdict was not of this job"
        continue
      if not verdict.get("ok"):
        _raise(verdict)
      return


def _chair(listener: socket.socket, addresses, devices: int, deadline: float, timeout: float,
           failure: str | None) -> None:
  """Worker 0: waits for every other worker, compares, and gives each the verdict (raised here too if not a go).

  ``failure``: worker 0's own reason not to start, the verdict from the start.
  """
  workers = len(addresses)
  me = _hello("identity", addresses, 0, devices)
  waiting: dict[int, tuple[socket.socket, dict]] = {}  # task -> its open connection and hello
  told: set[int] = set()  # tasks given the verdict
  counts = {0: devices}
  verdict = None  # once a mistake is found: the error every process raises

  def fail(error: str, message: str, task=None, address=None):
    nonlocal verdict
    if verdict is None:
      verdict = dict(protocol=PROTOCOL, kind="verdict", ok=False, error=error, message=message, task=task,
                     address=address)

  if failure is not None:
    fail("ClusterConfigError", FAILED_ELSEWHERE.format(task=0, who=_describe(me), message=failure))

  listener.settimeout(0.05)
  try:
    while len(told | set(waiting)) < workers - 1 and time.monotonic() < deadline:
      if verdict is not None:  # tell those waiting now; keep telling those that come until the deadline
        for task, (connection, _) in list(waiting.items()):
          with contextlib.suppress(OSError):
            _send(connection, verdict)
          connection.close()
          told.add(task)
          del waiting[task]
      try:
        connection, _ = listener.accept()
      except TimeoutError:
        continue
      try:
        message = _receive(connection, _ANSWER)
      except OSError:
        message = None
      kind = message and message.get("kind")
      task = message.get("task") if message else None
      if kind == "who":  # another process found this port taken: it asks who holds it
        with contextlib.suppress(OSError):
          _send(connection, me)
        connection.close()
        if task == 0:
          fail("ClusterConfigError", TWICE.format(task=0, address=addresses[0], first=_describe(me),
                                                  second=_describe(message), last=workers - 1))
        continue
      if kind == "failed":
        with contextlib.suppress(OSError):
          _send(connection, dict(protocol=PROTOCOL, kind="received"))
        connection.close()
        fail("ClusterConfigError", FAILED_ELSEWHERE.format(message=message.get("message"), task=task,
                                                           who=_describe(message)))
        continue
      if kind != "hello" or not isinstance(task, int):
        connection.close()
        continue
      with contextlib.suppress(OSError):
        _send(connection, dict(protocol=PROTOCOL, kind="welcome"))
      if message.get("cluster") != list(addresses):
        fail("ClusterConfigError", OTHER_CLUSTER.format(task=task, who=_describe(message), ours=list(addresses),
                                                        theirs=message.get("cluster")))
      elif task in waiting or task in told or task == 0:
        if task in waiting:
          first = _describe(waiting[task][1])
        else:
          first = _describe(me) if task == 0 else "another process (told already)"
        fail("ClusterConfigError", TWICE.format(task=task, address=addresses[task], first=first,
                                                second=_describe(message), last=workers - 1))
      else:
        counts[task] = message.get("devices")
        if len(set(counts.values())) > 1:
          fail("ClusterConfigError", OTHER_DEVICES.format(counts=", ".join(
              f"worker {t}: {counts[t]}" for t in sorted(counts))))
      if task in waiting or task in told or not 0 < task < workers:
        _send_and_close(connection, verdict)
      else:
        waiting[task] = (connection, message)
    if verdict is None and len(waiting) < workers - 1:
      missing = [t for t in range(1, workers) if t not in waiting]
      fail("WorkerUnavailableError", MISSING.format(
          who=("Worker " if len(missing) == 1 else "Workers ") + ", ".join(str(t) for t in missing), seconds=timeout + time.monotonic() - deadline,
          timeout=timeout, missing=", ".join(f"worker {t} at {addresses[t]}" for t in missing)),
          missing[0], addresses[missing[0]])
    go = verdict or dict(protocol=PROTOCOL, kind="verdict", ok=True)
    for connection, _ in waiting.values():
      with contextlib.suppress(OSError):
        _send(connection, go)
    for connection, _ in waiting.values():  # the workers close first (their side keeps TIME_WAIT, not this port)
      with contextlib.suppress(OSError):
        _receive(connection, 1.0)
  finally:
    for connection, _ in waiting.values():
      connection.close()
  if failure is not None:
    raise _errors.ClusterConfigError(failure)
  if verdict is not None:
    _raise(verdict)


def _send_and_close(connection: socket.socket, verdict: dict | None) -> None:
  with connection, contextlib.suppress(OSError):
    if verdict is not None:
      _send(connection, verdict)


class StartWatch:
  """Stops this process, naming why, if TensorFlow's start has not ended ``timeout`` seconds after the meeting.

  A small separate process (Python without TensorFlow or site packages, started and waiting
  in parallel: 2 ms to start it, about 30 ms to end it) waits for this one to
  say the start ended (:meth:`done`, or this process's end, which closes the
  pipe). If neither comes in time, it probes every worker's address, prints the
  error to this process's standard error and kills this process: a
  TensorFlow start that waits for a worker holds the interpreter lock, so no
  thread of this process can raise.
  """

  def __init__(self, addresses, task: int, timeout: float):
    self._process = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _WATCH, str(os.getpid()), str(timeout), str(task), json.dumps(list(addresses))],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)

  def done(self) -> None:
    """The start ended: the watching process exits."""
    with contextlib.suppress(OSError):
      self._process.stdin.close()
    self._process.wait()


_WATCH = r"""
import json, os, select, signal, socket, sys, time
pid, timeout, task, addresses = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if ready:
  sys.exit(0)  # the start ended (or the process did)
dead = []
for t, address in enumerate(addresses):
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
  except OSError:
    dead.append(f"worker {t} at {address}")
state = ("every worker accepts connections: one of them is stuck in its start, or failed it and its server stays up"
         if not dead else "not accepting connections now: " + ", ".join(dead) + " (died during the start)")
sys.stderr.write(
    f"replicator.WorkerUnavailableError: worker {task}: TensorFlow's multi-worker start did not end within "
    f"{timeout:g} s after every worker had met ({state}). TensorFlow's start cannot be interrupted, so this process "
    f"is stopped (SIGKILL). Fix: look at the other workers' output for an error; restart the job.\n")
sys.stderr.flush()
os.kill(pid, signal.SIGKILL)
"""
