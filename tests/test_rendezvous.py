"""A multi-client job's start: every wait bounded by connect_timeout, every set-up mistake named in every process.

Real worker processes on loopback ports (``tests/start_scenarios.py``, each
with its own ``TF_CONFIG``), as a user starts them by hand or a cluster
manager does: each process prints how its start ended, and the seconds it
took from the call. Then the meeting itself (``_rendezvous.meet``) in threads
of this process, for the cases that need no TensorFlow.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

import replicator
from replicator import launch
from replicator.integrations import _rendezvous

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "start_scenarios.py")
TIMEOUT = 4.0  # connect_timeout in the processes
SLACK = 5.0  # seconds past the timeout a process may take to say why it stops (asking a port's holder waits 2 s)
WALL = 120.0  # seconds a test waits for its processes (their imports, on a loaded machine, included)


def _addresses(n):
  return [f"localhost:{port}" for port in launch.free_ports(n)]


def _start(addresses, task, *options, entry="replicator", devices=1, timeout=TIMEOUT):
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
             TF_CONFIG=launch.tf_config(addresses, task), REPLICATOR_DEVICES_PER_WORKER=str(devices),
             KERAS_DISTRIBUTION_JOB_ADDRESSES=",".join(addresses), KERAS_DISTRIBUTION_NUM_PROCESSES=str(len(addresses)),
             KERAS_DISTRIBUTION_PROCESS_ID=str(task))
  return subprocess.Popen([sys.executable, SCRIPT, entry, str(timeout), *options], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _ended(*processes):
  """Each process's (result, stderr, exit code): every one must end within WALL seconds (else killed: a hang)."""
  deadline = time.monotonic() + WALL
  ended = []
  for p in processes:
    try:
      out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      for q in processes:
        q.kill()
      pytest.fail(f"a worker process still ran {WALL:g} s after it started: a hang")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    ended.append((json.loads(lines[-1]) if lines else None, err, p.returncode))
  return ended


def _failed(result, error: str, *pieces: str, seconds: float | None = None):
  """``result`` is the named ``error`` whose message holds each of ``pieces``, within ``seconds`` (default: SLACK)."""
  assert result is not None and not result["started"], result
  assert result["error"] == error, result
  for piece in pieces:
    assert piece in result["message"], (piece, result["message"])
  assert result["seconds"] <= (SLACK if seconds is None else seconds), result


def test_a_worker_that_never_starts_is_named_by_every_waiting_process_within_the_timeout():
  addresses = _addresses(3)
  results = _ended(_start(addresses, 0), _start(addresses, 1))  # worker 2 never starts
  for result, _, _ in results:
    _failed(result, "WorkerUnavailableError", f"Worker 2 did not come within {TIMEOUT:.0f}.",
            f"connect_timeout={TIMEOUT:g}", f"worker 2 at {addresses[2]}", "Fix: start every worker",
            seconds=TIMEOUT + SLACK)
    assert result["seconds"] >= TIMEOUT - 0.5
    assert (result["task"], result["address"]) == (2, addresses[2])


def test_a_worker_0_that_never_starts_is_named_within_the_timeout():
  addresses = _addresses(2)
  [(result, _, _)] = _ended(_start(addresses, 1))
  _failed(result, "WorkerUnavailableError", f"Worker 0 at {addresses[0]} did not come within",
          "last attempt: Connection refused", "Fix: start worker 0", seconds=TIMEOUT + SLACK)
  assert (result["task"], result["address"]) == (0, addresses[0])


def test_a_worker_that_starts_late_within_the_timeout_still_joins():
  addresses = _addresses(2)
  first = _start(addresses, 0, timeout=60.0)
  host, port = addresses[0].split(":")
  deadline = time.monotonic() + WALL
  while time.monotonic() < deadline:  # worker 0 is waiting at the meeting (its imports done)...
    try:
      socket.create_connection((host, int(port)), timeout=1.0).close()
      break
    except OSError:
      time.sleep(0.1)
  time.sleep(2.0)  # ... and worker 1 starts 2 s later (its imports besides)
  results = _ended(first, _start(addresses, 1, timeout=60.0))
  for result, err, _ in results:
    assert result is not None and result["started"], (result, err[-2000:])
  assert results[0][0]["seconds"] > 2.0
  assert results[0][0]["devices"] == results[1][0]["devices"] == [
      f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(2)]


def test_two_processes_claiming_one_task_are_named_in_both():
  addresses = _addresses(2)
  first = _start(addresses, 0)
  time.sleep(1.0)
  results = _ended(first, _start(addresses, 0))  # worker 1 never starts: the first waits for it until the timeout
  pids = re.findall(r"pid (\d+)", results[0][0]["message"])
  for result, _, _ in results:
    _failed(result, "ClusterConfigError", f"Two processes claim worker 0 ({addresses[0]})",
            "Fix: give each process its own task index", seconds=TIMEOUT + SLACK)
    assert re.findall(r"pid (\d+)", result["message"]) == pids and len(set(pids)) == 2
  assert results[1][0]["seconds"] <= SLACK  # the second claimant knows at once


def test_a_port_held_by_another_program_is_named_in_every_process():
  addresses = _addresses(2)
  host, port = addresses[0].split(":")
  with socket.socket() as other:  # another program: it listens on worker 0's port and answers nothing
    other.bind((host, int(port)))
    other.listen()
    results = _ended(_start(addresses, 0), _start(addresses, 1))
  _failed(results[0][0], "ClusterConfigError", f"Worker 0 cannot listen on its address {addresses[0]}: port {port} "
          "is in use by another program (it answered nothing within 2 s)", "Fix: stop that program")
  _failed(results[1][0], "ClusterConfigError", f"Worker 0's address {addresses[0]} accepts connections but does not "
          "answer as worker 0 of this job", "another program holds that port", seconds=2 * 2 + SLACK)


def test_an_address_not_of_this_machine_is_named_in_every_process():
  addresses = _addresses(2)
  addresses[1] = "192.0.2.1:" + addresses[1].split(":")[1]  # TEST-NET-1: never this machine's (only bound, never sent)
  results = _ended(_start(addresses, 0), _start(addresses, 1))
  mistake = f"Worker 1's address {addresses[1]} is not this machine's (192.0.2.1: Cannot assign requested address)"
  _failed(results[1][0], "ClusterConfigError", mistake, "Fix: run worker 1 on 192.0.2.1")
  _failed(results[0][0], "ClusterConfigError", "Worker 1 (pid ", "cannot start, so neither can the job: " + mistake,
          seconds=TIMEOUT + SLACK)


def test_workers_with_different_device_counts_are_named_in_every_process():
  addresses = _addresses(2)
  results = _ended(_start(addresses, 0, devices=1), _start(addresses, 1, devices=2))
  for result, _, _ in results:
    _failed(result, "ClusterConfigError", "The workers run different numbers of devices: worker 0: 1, worker 1: 2.",
            "Fix: pass the same devices_per_worker in every process", seconds=TIMEOUT + SLACK)


def test_tensorflow_run_before_the_start_is_named_in_every_process():
  addresses = _addresses(2)
  results = _ended(_start(addresses, 0), _start(addresses, 1, "--tensorflow-first"))
  _failed(results[1][0], "ClusterConfigError", "TensorFlow was already initialized in this process")
  _failed(results[0][0], "ClusterConfigError", "Worker 1 (pid ", "cannot start, so neither can the job: TensorFlow "
          "was already initialized", seconds=TIMEOUT + SLACK)


def test_keras_distribution_initialize_waits_connect_timeout_for_a_missing_worker():
  addresses = _addresses(2)
  [(result, _, _)] = _ended(_start(addresses, 0, entry="keras"))
  _failed(result, "WorkerUnavailableError", f"Worker 1 did not come within {TIMEOUT:.0f}.",
          f"worker 1 at {addresses[1]}", "keras.distribution.initialize", seconds=TIMEOUT + SLACK)
  assert result["seconds"] >= TIMEOUT - 0.5


def test_a_worker_dying_between_the_meeting_and_tensorflows_start_stops_the_others_naming_it():
  addresses = _addresses(2)
  (_, err, code), (_, _, died) = _ended(_start(addresses, 0), _start(addresses, 1, "--die-after-meeting"))
  assert died == 7
  assert code == -9, err[-2000:]  # stopped: TensorFlow's start cannot be interrupted
  message = [line for line in err.splitlines() if line.startswith("replicator.WorkerUnavailableError")]
  assert message and "TensorFlow's multi-worker start did not end within 10 s after every worker had met" in \
      message[0] and f"worker 1 at {addresses[1]} (died during the start)" in message[0], err[-2000:]


# -- the meeting alone, in threads of this process (no TensorFlow) -------------------------------------------------


def _meet_in_threads(cluster_of, devices_of, tasks, timeout=2.0, delays=None):
  """Each task's outcome of ``meet`` (None: a go; else the error), each in its own thread; and the seconds each took."""
  outcomes, seconds = {}, {}

  def run(task):
    time.sleep((delays or {}).get(task, 0.0))
    start = time.monotonic()
    try:
      _rendezvous.meet(cluster_of(task), task, devices_of(task), timeout)
      outcomes[task] = None
    except replicator.ReplicatorError as e:
      outcomes[task] = e
    seconds[task] = time.monotonic() - start

  threads = [threading.Thread(target=run, args=(t,)) for t in tasks]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout + 15.0)
    assert not t.is_alive(), "a meeting outlived its timeout"
  return outcomes, seconds


def test_three_workers_meet_whatever_order_they_come_in():
  addresses = _addresses(3)
  outcomes, _ = _meet_in_threads(lambda t: addresses, lambda t: 2, [2, 1, 0], delays={0: 0.5, 1: 0.2})
  assert outcomes == {0: None, 1: None, 2: None}
  outcomes, _ = _meet_in_threads(lambda t: addresses, lambda t: 2, [0, 1, 2])  # the same ports again, at once
  assert outcomes == {0: None, 1: None, 2: None}


def test_a_cluster_that_differs_between_processes_is_named_in_every_process():
  addresses = _addresses(3)
  other = addresses[:2] + [addresses[2].replace("localhost", "127.0.0.1")]
  outcomes, seconds = _meet_in_threads(lambda t: other if t == 1 else addresses, lambda t: 1, [0, 1, 2])
  for task in range(3):
    assert isinstance(outcomes[task], replicator.ClusterConfigError), outcomes
    assert f"Worker 1 (pid {os.getpid()} on {socket.gethostname()}) was given another cluster than worker 0: " \
           f"worker 0 has {addresses}, worker 1 has {other}." in str(outcomes[task])
    assert seconds[task] < 2.0


def test_a_second_process_claiming_a_task_other_than_0_is_named_in_every_process():
  addresses = _addresses(3)
  outcomes, seconds = {}, {}
  # Worker 0, worker 1 twice, then worker 2: the second claimant of 1 finds the port taken, asks who holds it, and
  # tells worker 0 before the job is complete. (Had worker 2 come first, the job would start without the extra
  # process, which alone would raise.)

  def run(key, task, delay):
    time.sleep(delay)
    start = time.monotonic()
    try:
      _rendezvous.meet(addresses, task, 1, 3.0)
      outcomes[key] = None
    except replicator.ReplicatorError as e:
      outcomes[key] = e
    seconds[key] = time.monotonic() - start

  threads = [threading.Thread(target=run, args=args) for args in (("0", 0, 0.0), ("1a", 1, 0.1), ("1b", 1, 0.3),
                                                                   ("2", 2, 1.5))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(20.0)
  assert set(outcomes) == {"0", "1a", "1b", "2"}
  for key, e in outcomes.items():
    assert isinstance(e, replicator.ClusterConfigError), (key, e)
    assert f"Two processes claim worker 1 ({addresses[1]})" in str(e), (key, e)
    assert seconds[key] < 2.5, (key, seconds)


def test_a_single_worker_job_checks_its_own_address_only():
  [address] = _addresses(1)
  _rendezvous.meet([address], 0, 1, 1.0)
  with socket.socket() as other:
    host, port = address.split(":")
    other.bind((host, int(port)))
    other.listen()
    with pytest.raises(replicator.ClusterConfigError, match=f"Worker 0 cannot listen on its address {address}"):
      _rendezvous.meet([address], 0, 1, 1.0)


def test_the_start_watch_ends_with_the_start_and_costs_it_nothing():
  start = time.monotonic()
  watch = _rendezvous.StartWatch(["localhost:1"], 0, 30.0)
  watch.done()
  assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("failing", [0, 1])
def test_a_process_that_cannot_start_tells_every_process_why(failing):
  addresses = _addresses(2)
  outcomes = {}

  def run(task):
    try:
      _rendezvous.meet(addresses, task, 1, 3.0, failure="Cannot start: a reason." if task == failing else None)
      outcomes[task] = None
    except replicator.ReplicatorError as e:
      outcomes[task] = e

  threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(10.0)
  assert str(outcomes[failing]) == "Cannot start: a reason."
  assert str(outcomes[1 - failing]) == f"Worker {failing} (pid {os.getpid()} on {socket.gethostname()}) cannot " \
                                       f"start, so neither can the job: Cannot start: a reason."
