"""TensorFlow's multi-client collective runtime, started in each worker process (``python -m replicator.launch``).

What the multi-client mode builds on, checked with real processes on loopback:
collectives whose group spans every worker's logical CPUs give the reduction
over all of them (a hand-derived sum); TensorFlow used before the runtime
starts is a named error; a peer that died makes the survivor's next collective
fail within the collective's timeout, never hang. In-process: the seed that makes unseeded shuffles alike.
"""

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

from replicator import launch
from replicator.integrations import _collective_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A worker: the runtime started from TF_CONFIG, then an all-reduce over every worker's devices (one op per local
# device, each with its own ordering token), its input on device d of worker t: t * D + d + 1.
PROLOGUE = """
import json, os, sys, time
import replicator  # the library imported first: it must not start TensorFlow
from replicator.integrations import _cluster, _collective_runtime
import tensorflow as tf

cluster, task = _cluster.from_tf_config()
task = task["index"]
D = int(os.environ["REPLICATOR_DEVICES_PER_WORKER"])
devices = _collective_runtime.start(cluster.workers, task, D)
W = len(cluster.workers)
local = [d for d in devices if f"/task:{task}/" in d]
tokens = []
for device in local:
  with tf.device(device):
    tokens.append(tf.Variable(0.0))

@tf.function
def all_sum(instance, timeout):
  out = []
  for i, device in enumerate(local):
    with tf.device(device):
      x = tf.fill([3], tf.cast(task * D + i + 1, tf.float32))
      out.append(tf.raw_ops.CollectiveReduceV2(
          input=x, group_size=W * D, group_key=1, instance_key=instance, ordering_token=[tokens[i].handle],
          merge_op="Add", final_op="Id", timeout_seconds=timeout))
  return out
"""


def _run(tmp_path, body: str, workers: int, devices: int, timeout: float = 240):
  script = tmp_path / "worker_script.py"
  script.write_text(textwrap.dedent(PROLOGUE) + textwrap.dedent(body))
  out = io.TextIOWrapper(io.BytesIO(), write_through=True)
  err = io.TextIOWrapper(io.BytesIO(), write_through=True)
  code = launch.launch([str(script)], workers, devices, timeout=timeout, grace=5.0,
                       env=dict(os.environ, PYTHONPATH=ROOT), out=out, err=err)
  return code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


@pytest.mark.parametrize("workers, devices", [(2, 2), (3, 1)])
def test_a_group_over_every_workers_devices_reduces_over_all_of_them(tmp_path, workers, devices):
  code, out, err = _run(tmp_path, """
      print("devices", json.dumps(devices))
      for instance in (1, 2):  # a second call: the group is resolved once, instances anew
        print("sum", instance, json.dumps([v.numpy().tolist() for v in all_sum(instance, 60.0)]))
      """, workers, devices)
  assert code == 0, err[-3000:]
  n = workers * devices
  expected = [[float(n * (n + 1) // 2)] * 3] * devices  # 1 + 2 + ... + n on every device
  for task in range(workers):
    assert f"[worker {task}] devices {json.dumps(list(_collective_runtime.device_names(workers, devices)))}" in out
    for instance in (1, 2):
      assert f"[worker {task}] sum {instance} {json.dumps(expected)}" in out, out


def test_an_agreement_gives_every_process_worker_0s_value_of_every_dtype(tmp_path):
  """``Agreement(value)`` (a variable's initial value): worker 0's value in each of 3 processes, by a broadcast;
  every dtype a variable can have (bfloat16 crosses as half), a scalar; a string stays each process's own."""
  code, out, err = _run(tmp_path, """
      leaders = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(W)]
      agree = _collective_runtime.Agreement(leaders, task, 60.0)
      found = {}
      for dtype in (tf.bool, tf.bfloat16, tf.float16, tf.float32, tf.float64, tf.int32, tf.int64):
        mine = tf.cast(tf.reshape(tf.range(6) * (task + 1) + task, [2, 3]), dtype)
        found[dtype.name] = tf.cast(agree(mine), tf.float64).numpy().tolist()
      found["scalar"] = float(agree(tf.constant(1.5 + task)))
      found["string"] = agree(tf.constant(f"task {task}")).numpy().decode()
      print("found", json.dumps(found, sort_keys=True))
      """, 3, 1)
  assert code == 0, err[-3000:]
  zero = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # worker 0's: range(6) * 1 + 0
  for task in range(3):
    found = json.loads(out.split(f"[worker {task}] found ", 1)[1].splitlines()[0])
    expected = {name: zero for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64")}
    expected.update(bool=[[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]], scalar=1.5, string=f"task {task}")
    assert found == expected, (task, found)


def test_tensorflow_used_before_the_runtime_starts_is_a_named_error(tmp_path):
  script = tmp_path / "early.py"
  script.write_text(textwrap.dedent("""
      import replicator
      from replicator.integrations import _collective_runtime
      import tensorflow as tf
      tf.constant(1.0) + 1.0  # TensorFlow starts here
      try:
        _collective_runtime.start(["localhost:1", "localhost:2"], 0, 1, connect_timeout=1.0)
      except replicator.ClusterConfigError as e:
        print("refused:", e)
      """))
  result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
  assert "refused: " + _collective_runtime.TF_ALREADY_STARTED in result.stdout, result.stderr[-2000:]


def test_a_dead_peer_fails_the_survivors_collective_within_its_timeout(tmp_path):
  code, out, err = _run(tmp_path, """
      all_sum(1, 60.0)  # both alive: the group is resolved
      if task == 1:
        time.sleep(1.0)  # (worker 0 may still be reading worker 1's part of the first all-reduce)
        print("worker 1 leaves", flush=True)
        os._exit(0)
      time.sleep(2.0)
      start = time.monotonic()
      try:
        all_sum(2, 5.0)
        print("no error")
      except tf.errors.OpError as e:
        print("failed", type(e).__name__, f"{time.monotonic() - start:.1f}")
      """, 2, 1)
  assert code == 0, err[-3000:]
  assert "[worker 1] worker 1 leaves" in out
  (line,) = [line for line in out.splitlines() if line.startswith("[worker 0] failed")]
  *_, kind, seconds = line.split()
  assert kind in ("DeadlineExceededError", "UnavailableError", "InternalError", "AbortedError"), line
  assert float(seconds) < 5.0 + 10.0, line  # the timeout and a margin for this loaded machine: never a hang


def test_seed_alike_gives_every_process_worker_0s_draw_unless_the_program_set_a_seed():
  """What makes an unseeded shuffle alike in every process (tests/test_multi_client.py: Keras's fit with real
  processes). A stand-in agreement returns "worker 0's" value; every call agrees, set seed or not (every process
  makes the same agreements)."""
  import tensorflow as tf

  agreed = []

  def agree(value, name):
    agreed.append(name)
    return tf.constant(1234, tf.int64)

  try:
    tf.random.set_seed(None)
    assert _collective_runtime.seed_alike(agree) == 1234
    assert tf.compat.v1.random.get_seed(None)[0] == 1234
    tf.random.set_seed(7)  # the program's own
    assert _collective_runtime.seed_alike(agree) is None
    assert tf.compat.v1.random.get_seed(None)[0] == 7
    assert agreed == ["random seed", "random seed"]
  finally:
    tf.random.set_seed(None)
