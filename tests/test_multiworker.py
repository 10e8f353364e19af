"""Multi-worker training over TensorFlow's gRPC runtime, on loopback.

Scenarios that connect to a cluster run in their own client process
(tests/multiworker_scenarios.py): connecting changes TensorFlow's
process-wide context. Configuration errors are raised before anything
connects, so they are tested here directly.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import replicator
from replicator import testing

HERE = os.path.dirname(os.path.abspath(__file__))


def _scenario(name: str, timeout: float = 240.0) -> dict:
  process = subprocess.run([sys.executable, os.path.join(HERE, "multiworker_scenarios.py"), name],
                           capture_output=True, text=True, timeout=timeout)
  lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
  assert lines, f"scenario {name} failed (exit {process.returncode}):\n{process.stderr[-4000:]}"
  return json.loads(lines[-1][len("RESULT "):])


def test_keras_fit_on_two_workers_equals_one_device():
  result = _scenario("keras_fit")
  assert result["replicas"] == 4 and result["components_per_variable"] == 4
  assert result["max_abs_diff"] <= 1e-5  # every component of every model and optimizer variable
  assert result["history_diff"] <= 1e-5


def test_training_on_two_workers_equals_one_device():
  result = _scenario("train_equivalence")
  assert result["max_abs_diff"] <= 1e-5
  assert result["mesh"] == {"worker": 2, "device": 2}
  assert result["implementations"] == ["hierarchical"]  # reduce within each worker, then across
  # Replicas and their input pipelines live on the workers, not on this client.
  assert [d.split("/device:")[0] for d in result["devices"]] == ["/job:worker/replica:0/task:0"] * 2 + [
      "/job:worker/replica:0/task:1"] * 2
  assert result["input_hosts"] == ["/job:worker/replica:0/task:0/device:CPU:0"] * 2 + [
      "/job:worker/replica:0/task:1/device:CPU:0"] * 2
  assert result["components"] == result["devices"]


def test_collectives_across_workers_against_numpy():
  result = _scenario("collectives")
  x = np.array(result["inputs"])  # replica r at worker r // 2, device r % 2
  for implementation in ("auto", "collective_ops"):
    out = {k: np.array(v) for k, v in result[implementation].items()}
    np.testing.assert_allclose(out["sum"], [x.sum(0)] * 4)
    np.testing.assert_allclose(out["mean"], [x.mean(0)] * 4)
    np.testing.assert_allclose(out["max"], [x.max(0)] * 4)
    np.testing.assert_allclose(out["worker_sum"], [x[0] + x[2], x[1] + x[3]] * 2)
    np.testing.assert_allclose(out["device_sum"], [x[0] + x[1]] * 2 + [x[2] + x[3]] * 2)
    np.testing.assert_allclose(out["broadcast"], [x[3]] * 4)
    np.testing.assert_allclose(out["gather"], [np.concatenate(list(x), 1)] * 4)
    np.testing.assert_allclose(out["scatter"], [x.sum(0)[r:r + 1] for r in range(4)])
    np.testing.assert_allclose(out["to_all"], [np.concatenate([x[s][r:r + 1] for s in range(4)], 1) for r in range(4)])
    np.testing.assert_allclose(out["permute"], [x[3], np.zeros_like(x[0]), x[1], x[0]])
    np.testing.assert_allclose(out["rows"], [np.concatenate([x[r][:r + 1] for r in range(4)])] * 4)
    np.testing.assert_array_equal(out["row_indices"], [[0, 10, 11, 20, 21, 22, 30, 31, 32, 33]] * 4)
  # auto: hierarchical across workers, one_device within one, collective_ops for the rest
  assert result["auto_plan"] == ["collective_ops", "hierarchical", "one_device"]
  assert result["collective_ops_plan"] == ["collective_ops"]


def test_a_step_failing_on_one_device_names_its_worker_and_address():
  result = _scenario("failing_device")
  assert result["error"] == "StepFailedError", result
  device = "/job:worker/replica:0/task:1/device:CPU:0"
  assert result["devices"] == [device]
  assert result["message"].startswith(f"The step failed on {device} (worker 1 at {result['addresses'][1]}) at "), result
  assert "made on replica 1" in result["message"] and "No variable was written" in result["message"]
  assert result["after"] == [0.0, 0.0]


def test_killing_a_worker_gives_the_named_error_within_the_timeout():
  result = _scenario("kill_mid_step")
  assert result["error"] == "WorkerUnavailableError", result
  assert result["task"] == 1, result
  assert "Worker 1 at localhost:" in result["message"] and "is unavailable" in result["message"]
  assert "restore the last checkpoint" in result["message"]
  assert result["seconds_after_kill"] < 10.0 + 5.0, result  # the collective timeout, plus slack


def test_calls_after_a_worker_restarts_give_the_named_error_with_the_fix():
  # Was: TensorFlow's UnavailableError ("Socket closed"), then AbortedError ("Unable to find a context_id").
  outcomes = _scenario("restarted_worker")
  assert [o["error"] for o in outcomes] == ["WorkerUnavailableError"] * 2, outcomes
  for outcome in outcomes:
    assert outcome["message"].startswith("A worker of this MultiWorkerReplicator restarted since this process "
                                         "connected to it"), outcome
    assert "Fix: restart this client process too, create the MultiWorkerReplicator and the model again, and " \
        "restore the last checkpoint" in outcome["message"]


def test_kill_and_resume_example_matches_the_uninterrupted_run():
  pytest.importorskip("sklearn")
  from examples import multiworker
  result = multiworker.main(["--steps", "16", "--checkpoint-every", "5", "--kill-at", "7"])
  assert result["restarts"] == 1 and result["killed_at"] >= 7
  assert len(result["lost_reports"]) == 1 and "worker 1 lost" in result["lost_reports"][0]
  assert result["restored"] == [5]  # the last checkpoint before the failure
  assert result["max_abs_diff"] <= 1e-6


# -- configuration errors: before anything connects -------------------------------------


def test_malformed_tf_config():
  with pytest.raises(replicator.ClusterConfigError, match=r"TF_CONFIG is not valid JSON \(.*\): '\{cluster'\. Expected e\.g\."):
    replicator.MultiWorkerReplicator.from_tf_config("{cluster")
  with pytest.raises(replicator.ClusterConfigError, match="no 'cluster' key"):
    replicator.MultiWorkerReplicator.from_tf_config('{"task": {"type": "worker", "index": 0}}')
  with pytest.raises(replicator.ClusterConfigError, match=r"has no 'worker' job with at least one address"):
    replicator.MultiWorkerReplicator.from_tf_config('{"cluster": {"chief": ["localhost:1"]}}')
  with pytest.raises(replicator.ClusterConfigError, match=r"Worker 1's address 'localhost' is not 'host:port'"):
    replicator.MultiWorkerReplicator(cluster={"worker": ["localhost:2222", "localhost"]})


def test_cluster_resolvers_give_the_cluster_and_this_process_task():
  """SLURM's, Kubernetes's (a stand-in for its API client) and a simple resolver: the cluster and the task."""
  import tensorflow as tf

  from replicator.integrations import _cluster

  class Pods:  # what KubernetesClusterResolver asks of the Kubernetes API: the pods of a label selector
    def __init__(self, ips):
      self._ips = ips

    def list_pod_for_all_namespaces(self, label_selector):
      assert label_selector == "job-name=train"
      pod = lambda i, ip: type("Pod", (), dict(  # noqa: E731
          metadata=type("Meta", (), dict(name=f"train-{i}")), status=type("Status", (), dict(phase="Running",
                                                                                              host_ip=ip))))
      return type("Pods", (), dict(items=[pod(i, ip) for i, ip in enumerate(self._ips)]))

  kubernetes = tf.distribute.cluster_resolver.KubernetesClusterResolver(
      {"worker": ["job-name=train"]}, tf_server_port=2222, override_client=Pods(["10.0.0.1", "10.0.0.2"]))
  cluster, task = _cluster.from_resolver(kubernetes)
  assert cluster.workers == ("10.0.0.1:2222", "10.0.0.2:2222") and task is None  # (it knows no task)
  assert _cluster.from_resolver(kubernetes, task=1)[1] == 1
  with pytest.raises(replicator.ClusterConfigError, match=r"Task index 2 is out of range"):
    _cluster.from_resolver(kubernetes, task=2)
  spec = tf.train.ClusterSpec({"worker": ["host0:2222", "host1:2222"]})
  simple = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=1)
  assert _cluster.from_resolver(simple) == (_cluster.Cluster(("host0:2222", "host1:2222")), 1)
  with pytest.MonkeyPatch.context() as env:
    for name, value in dict(SLURM_PROCID="2", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_NODELIST="node[07-08]",
                            SLURM_STEP_TASKS_PER_NODE="2(x2)").items():
      env.setenv(name, value)
    slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=8888, gpus_per_node=2, gpus_per_task=1,
                                                                 auto_set_gpu=False)
    cluster, task = _cluster.from_resolver(slurm)
  assert cluster.workers == ("node07:8888", "node07:8889", "node08:8888", "node08:8889") and task == 2
  with pytest.raises(replicator.ClusterConfigError, match=r"takes a tf.distribute.cluster_resolver.ClusterResolver"):
    replicator.MultiWorkerReplicator.from_cluster_resolver({"worker": ["host0:2222"]})


def test_task_index_out_of_range():
  config = json.dumps({"cluster": {"worker": ["localhost:2222", "localhost:2223"]}, "task": {"type": "worker", "index": 2}})
  with pytest.raises(replicator.ClusterConfigError, match=r"Task index 2 is out of range: the cluster has 2 worker\(s\), indices 0\.\.1"):
    replicator.MultiWorkerReplicator.from_tf_config(config)
  process = subprocess.run([sys.executable, "-m", "replicator.worker", "--cluster", '{"worker": ["localhost:2222"]}',
                            "--task", "3"], capture_output=True, text=True, timeout=120)
  assert process.returncode != 0
  assert "Task index 3 is out of range: the cluster has 1 worker(s)" in process.stderr


def test_unreachable_worker_is_reported_before_training():
  (port,) = testing.free_ports(1)  # nothing listens there
  with pytest.raises(replicator.WorkerUnavailableError, match=rf"Worker 0 at localhost:{port} is unreachable \(.*\) after "
                     r"\d+\.\d s\. Fix: start it first \(python -m replicator.worker --cluster \.\.\. --task 0\)") as info:
    replicator.MultiWorkerReplicator(cluster={"worker": [f"localhost:{port}"]}, connect_timeout=1.0)
  assert info.value.task == 0 and info.value.address == f"localhost:{port}"


def test_a_port_that_answers_but_is_not_a_worker_fails_within_the_timeout():
  # Was: a hang in TensorFlow's set_server_def (still hung at 60 s).
  import socket  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  server = socket.socket()
  server.bind(("localhost", 0))
  server.listen(8)
  port = server.getsockname()[1]
  accepted = []

  def accept_and_stay_silent():
    while True:
      try:
        accepted.append(server.accept()[0])
      except OSError:
        return

  threading.Thread(target=accept_and_stay_silent, daemon=True).start()
  start = time.monotonic()
  try:
    with pytest.raises(replicator.WorkerUnavailableError,
                       match=rf"Worker 0 at localhost:{port} accepts TCP connections but is not a TensorFlow worker: it "
                             r"did not answer the gRPC \(HTTP/2\) handshake"):
      replicator.MultiWorkerReplicator(cluster={"worker": [f"localhost:{port}"]}, connect_timeout=2.0)
  finally:
    server.close()
  assert time.monotonic() - start < 10


def test_timeouts_and_task_indices_are_checked():
  with pytest.raises(replicator.ArgumentError, match=r"connect_timeout=-1: needs a number of seconds > 0\."):
    replicator.MultiWorkerReplicator(cluster={"worker": ["localhost:2222"]}, connect_timeout=-1)
  with pytest.raises(replicator.ArgumentError, match=r"collective_timeout='1': needs a number of seconds >= 0"):
    replicator.MultiWorkerReplicator(cluster={"worker": ["localhost:2222"]}, collective_timeout="1")
  config = json.dumps({"cluster": {"worker": ["localhost:2222"]}, "task": {"type": "worker", "index": "0"}})
  # Was: "Task index 0 is out of range" for the string "0".
  with pytest.raises(replicator.ClusterConfigError, match=r"Task index '0' is a str, not an integer\. Fix: write it as a "
                                                          r"number"):
    replicator.MultiWorkerReplicator.from_tf_config(config)


def test_a_lost_worker_is_reported_in_one_readable_line():
  from replicator.core import _errors  # pylint: disable=import-outside-toplevel
  message = ("Graph execution error:\n\nDetected at node x defined at (most recent call last):\n<stack traces unavailable>\n"
             "2 root error(s) found.\n  (0) UNAVAILABLE: Connection reset by peer\n\t [[{{node step/a}}]]\n"
             "  (1) CANCELLED: Function was cancelled\n0 successful operations.\n0 derived errors ignored.")
  assert _errors.root_cause(message) == "UNAVAILABLE: Connection reset by peer"
