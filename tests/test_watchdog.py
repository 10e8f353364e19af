"""The multi-client watchdog's decisions, on a stand-in key-value store, probe and abort.

With real processes (a hung and a dead worker, TensorFlow's own abort):
``tests/test_multi_client.py``.
"""

import sys
import threading
import time

import pytest

from replicator.integrations import _cluster
from replicator.integrations import _tf_coordination
from replicator.integrations import _watchdog

ADDRESSES = ["localhost:1", "localhost:2", "localhost:3"]
Watchdog = _watchdog.Watchdog


@pytest.fixture
def job(monkeypatch):
  """A stand-in job: the store (key -> value), the dead addresses, the aborts made; its watchdogs closed after."""
  store, dead, aborts = {}, set(), []
  monkeypatch.setattr(_tf_coordination, "publish", store.__setitem__)
  monkeypatch.setattr(_tf_coordination, "read", lambda key, timeout_seconds: store.get(key))
  monkeypatch.setattr(_tf_coordination, "abort_collectives", aborts.append)
  monkeypatch.setattr(_cluster, "probe", lambda address, timeout: "refused" if address in dead else None)
  made = []
  monkeypatch.setattr(_watchdog, "Watchdog", lambda *args, **kwargs: made.append(Watchdog(*args, **kwargs))
                      or made[-1])
  yield store, dead, aborts
  for dog in made:
    dog.close()


def _peers(store, calls, state="1"):
  """Each worker's published state: ``calls[task]`` calls started, ``state`` the rest ("1": in one, "0 1": left a
  failed one)."""
  for task, n in calls.items():
    store[_watchdog.KEY.format(task=task)] = f"{n} {state}"


def _until_verdict(dog, seconds=5.0):
  start = time.monotonic()
  while dog.verdict is None and time.monotonic() - start < seconds:
    time.sleep(0.01)
  return time.monotonic() - start


def _watchdog_in_a_call(timeout=0.2, calls=3):
  dog = _watchdog.Watchdog(ADDRESSES, task=0, interval=0.05)
  for _ in range(calls - 1):
    with dog.watching(timeout):
      pass
  return dog


def test_a_worker_that_has_not_started_the_call_is_named_late_at_the_timeout(job):
  store, _, aborts = job
  _peers(store, {1: 3, 2: 2})  # worker 2 is one call behind
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    waited = _until_verdict(dog)
  assert dog.verdict is not None and dog.verdict.task == 2 and dog.verdict.address == "localhost:3"
  assert 0.2 <= waited < 0.2 + 2.0  # (its interval is 0.05 s: a margin for a loaded machine)
  assert dog.verdict.message.startswith("Worker 2 at localhost:3 has not come to this step: this process started it "
                                        "0 s ago (its call #3 of the ones every worker makes alike: steps and "
                                        "agreements; collective_timeout=0.2 s), and worker 2 has started 2. It "
                                        "accepts connections: it is hung")
  assert aborts == [dog.verdict.message]  # this process's collectives aborted with it
  assert store[_watchdog.KEY.format(task=0)] == "3 1 0"  # its own state published: calls, in one, last one failed


def test_a_late_worker_that_refuses_connections_is_named_dead(job):
  store, dead, aborts = job
  _peers(store, {1: 2, 2: 3})
  dead.add("localhost:2")
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    _until_verdict(dog)
  assert dog.verdict.task == 1 and "is unavailable: it does not accept connections" in dog.verdict.message
  assert "Fix: restart the job, every worker with one fewer" in dog.verdict.message and len(aborts) == 1


def test_a_worker_that_died_inside_the_call_is_named_dead(job):
  store, dead, aborts = job
  _peers(store, {1: 3, 2: 3})  # both came to the call; worker 2 died in it
  dead.add("localhost:3")
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    _until_verdict(dog)
  assert dog.verdict.task == 2 and "is unavailable: it does not accept connections" in dog.verdict.message
  assert len(aborts) == 1


def test_a_dead_worker_0_is_named_without_reading_the_others(job, monkeypatch):
  _, dead, aborts = job  # (its store is gone: every read would wait)
  reads = []
  monkeypatch.setattr(_tf_coordination, "read", lambda key, timeout_seconds: reads.append(key))  # None: unreadable
  dead.add("localhost:1")
  dog = _watchdog.Watchdog(ADDRESSES, task=1, interval=0.05)
  with dog.watching(0.1):
    _until_verdict(dog)
  assert dog.verdict.task == 0 and reads == [_watchdog.KEY.format(task=0)] and len(aborts) == 1


def test_nothing_is_decided_while_every_worker_is_in_the_call_or_before_the_timeout(job):
  store, _, aborts = job
  _peers(store, {1: 3, 2: 3})  # in this call
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    time.sleep(0.5)
  _peers(store, {1: 1, 2: 1})  # behind, but the call ends before its timeout
  with dog.watching(5.0):
    time.sleep(0.3)
  _peers(store, {1: 5, 2: 5}, "0")  # finished it first: this process's own work after its last collective, shorter
  with dog.watching(5.0):
    time.sleep(0.3)
  with dog.watching(0.0):  # 0: wait forever
    time.sleep(0.3)
  assert dog.verdict is None and aborts == []


def test_a_worker_that_finished_the_call_while_this_process_is_still_in_it_is_named_at_the_timeout(job):
  store, _, aborts = job
  _peers(store, {1: 3})  # in this call
  _peers(store, {2: 3}, "0")  # finished it: its step ran fewer collectives than this one's
  dog = _watchdog_in_a_call()
  start = time.monotonic()
  with dog.watching(0.2):
    waited = _until_verdict(dog)
  assert dog.verdict is not None and dog.verdict.task == 2 and dog.verdict.address == "localhost:3"
  assert 0.2 <= time.monotonic() - start and waited < 0.2 + 2.0  # never before the timeout
  assert dog.verdict.message.startswith(
      "Worker 2 at localhost:3 finished this step while this process is still in it, 0 s after it started it (its "
      "call #3 of the ones every worker makes alike: steps and agreements; collective_timeout=0.2 s). Every worker "
      "must run the same collectives in it, in the same order; every worker came to it, but this process waits in a "
      "collective that worker 2 never ran: they ran different collectives (a tf.while_loop whose body communicates "
      "running more iterations here"), dog.verdict.message
  assert "raise collective_timeout above the step's time" in dog.verdict.message  # (a step that really runs on)
  assert aborts == [dog.verdict.message]


def test_a_worker_in_a_later_call_finished_this_one(job):
  store, _, aborts = job
  _peers(store, {1: 4, 2: 3})  # worker 1 waits in the next call
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    _until_verdict(dog)
  assert dog.verdict.task == 1 and dog.verdict.message.startswith("Worker 1 at localhost:2 finished this step while")
  assert len(aborts) == 1


def test_a_worker_whose_call_failed_is_named_as_having_left_it_with_an_error(job):
  store, _, _ = job
  _peers(store, {1: 3, 2: 3}, "0 1")
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    _until_verdict(dog)
  assert dog.verdict.message.startswith("Worker 1 at localhost:2 left this step with an error while this process is "
                                        "still in it"), dog.verdict.message
  assert "Fix: look at worker 1's output for the error" in dog.verdict.message


def test_a_worker_that_finished_the_call_and_ended_is_not_named_dead(job):
  store, dead, aborts = job
  _peers(store, {1: 3})
  _peers(store, {2: 3}, "0")
  dead.add("localhost:3")  # its process ended after it finished the step
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    _until_verdict(dog)
    gone = dog.gone(2)  # what the step's own failure names (its collective finds the connection closed)
  assert dog.verdict.message.startswith("Worker 2 at localhost:3 finished this step and its process has ended since "
                                        "(it does not accept connections) while this process is still in it")
  assert gone is not None and gone.message.split(",")[0] == dog.verdict.message.split(",")[0]
  with dog.watching(0.2):
    _peers(store, {2: 4})  # one that died in this call is dead
    assert dog.gone(2) is None
  assert "is unavailable" not in dog.verdict.message and len(aborts) == 1


def test_a_finish_published_after_the_timeout_is_named_before_the_collectives_own_timeout(job):
  store, _, aborts = job
  _peers(store, {1: 3, 2: 3})  # every worker in the call at its timeout
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    time.sleep(0.4)
    assert dog.verdict is None
    _peers(store, {2: 3}, "0")  # worker 2's finish, published late
    waited = _until_verdict(dog)
  assert dog.verdict.task == 2 and waited < 1.0 and len(aborts) == 1


def test_a_process_that_ends_waits_while_another_is_in_a_call_it_left(job, monkeypatch):
  store, dead, _ = job
  monkeypatch.delattr(sys, "last_value", raising=False)  # (pytest sets it after a failed test)
  dog = _watchdog_in_a_call(calls=4)  # 3 calls made, each ended
  _peers(store, {1: 3})  # in the last call, this process's collectives awaited
  _peers(store, {2: 2}, "0")  # behind (or not yet published)

  def peers_leave():
    time.sleep(0.3)
    _peers(store, {1: 3}, "0")
    time.sleep(0.3)
    dead.add("localhost:3")  # ended before it published: not waited for

  leaving = threading.Thread(target=peers_leave)
  leaving.start()
  start = time.monotonic()
  dog.linger()
  leaving.join()
  assert 0.6 <= time.monotonic() - start < 0.6 + 1.5
  assert store[_watchdog.KEY.format(task=0)] == "3 0 0"  # its last state, published first


def test_a_process_that_ends_after_an_error_or_with_no_timeout_does_not_wait(job, monkeypatch):
  store, _, _ = job
  monkeypatch.delattr(sys, "last_value", raising=False)
  _peers(store, {1: 3, 2: 3})  # still in the call
  dog = _watchdog.Watchdog(ADDRESSES, task=0, interval=0.05)
  with pytest.raises(ValueError):
    with dog.watching(0.2):
      raise ValueError("the step failed here")
  start = time.monotonic()
  dog.linger()
  with dog.watching(0.2):
    pass
  monkeypatch.setattr(sys, "last_value", ValueError("an uncaught error ends the program"), raising=False)
  dog.linger()
  monkeypatch.delattr(sys, "last_value")
  with dog.watching(0.0):  # 0: every wait is forever; nobody is named
    pass
  dog.linger()
  assert time.monotonic() - start < 0.5


def test_worker_0_whose_store_cannot_be_read_is_not_accused_while_it_accepts_connections(job):
  _, _, aborts = job  # (worker 0 serves the store; an unreadable key there tells nothing)
  dog = _watchdog.Watchdog(ADDRESSES, task=1, interval=0.05)
  job[0][_watchdog.KEY.format(task=2)] = "1 1"
  with dog.watching(0.1):
    time.sleep(0.4)
  assert dog.verdict is None and aborts == []


def test_a_call_made_inside_a_call_is_not_counted():
  dog = _watchdog.Watchdog(["localhost:1"], task=0)  # (one worker: no thread)
  with dog.watching(1.0):
    with dog.watching(1.0):
      pass
    assert dog._inside  # pylint: disable=protected-access
  assert (dog._calls, dog._inside) == (1, False)  # pylint: disable=protected-access


def test_the_collectives_own_timeout_comes_after_the_watchdogs_decision():
  assert _watchdog.backstop(0.0) == 0.0  # none: wait forever
  assert _watchdog.backstop(5.0) == 10.0
  assert _watchdog.backstop(60.0) == 72.0
