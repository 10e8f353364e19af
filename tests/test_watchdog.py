"""The multi-client watchdog's decisions, on a stand-in key-value store, probe and abort.

With real processes (a hung and a dead worker, TensorFlow's own abort):
``tests/test_multi_client.py``.
"""

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


def _peers(store, calls):
  for task, n in calls.items():
    store[_watchdog.KEY.format(task=task)] = f"{n} 1"


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
  assert store[_watchdog.KEY.format(task=0)] == "3 1"  # its own state published


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
  _peers(store, {1: 3, 2: 4})  # in this call, or past it
  dog = _watchdog_in_a_call()
  with dog.watching(0.2):
    time.sleep(0.5)
  _peers(store, {1: 1, 2: 1})  # behind, but the call ends before its timeout
  with dog.watching(5.0):
    time.sleep(0.3)
  with dog.watching(0.0):  # 0: wait forever
    time.sleep(0.3)
  assert dog.verdict is None and aborts == []


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
