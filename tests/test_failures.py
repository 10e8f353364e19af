"""How a failed step names where it failed (replicator/guarantees/_failures.py); real failures: test_atomic.py."""

import tensorflow as tf

from replicator.guarantees import _failures

WORKERS = ("localhost:1234", "localhost:1235")
ON_WORKERS = ("/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0")


def test_a_device_of_this_process_is_named_by_its_type_and_index():
  assert _failures.device_name("/job:localhost/replica:0/task:0/device:CPU:1") == "device:CPU:1"
  assert _failures.device_name("/device:CPU:1", WORKERS) == "device:CPU:1"


def test_a_workers_device_is_named_whole_with_its_worker_and_address():
  assert _failures.device_name(ON_WORKERS[1], WORKERS) == (
      "/job:worker/replica:0/task:1/device:CPU:0 (worker 1 at localhost:1235)")
  assert _failures.device_name(ON_WORKERS[1]) == "/job:worker/replica:0/task:1/device:CPU:0 (worker 1)"  # unknown


def test_a_failed_step_names_the_failing_replicas_worker():
  # As a multi-client process sees it too: the devices of every replica, its own failing (replica 1, worker 1).
  error = tf.errors.InvalidArgumentError(None, None, (
      "Graph execution error:\n\nmade on replica 1 : Tensor had NaN values\n"
      "\t [[{{node step/replica_1/CheckNumerics}}]] [Op:__inference_call_12]"))
  failed = _failures.step_failed(error, None, ON_WORKERS, True, WORKERS)
  assert str(failed).startswith(
      "The step failed on /job:worker/replica:0/task:1/device:CPU:0 (worker 1 at localhost:1235) (node "
      "'step/replica_1/CheckNumerics'): made on replica 1 : Tensor had NaN values. No variable was written")
  assert failed.devices == (ON_WORKERS[1],) and isinstance(failed, tf.errors.InvalidArgumentError)


def test_a_root_error_that_waited_for_the_failed_device_is_not_named():
  # Across workers, the device waiting in a collective for the failed one reports a root error of its own.
  message = ("2 root error(s) found.\n"
             "  (0) CANCELLED: Collective ops is aborted by: made on replica 1 : Tensor had NaN values\n"
             "The error could be from a previous operation. Restart your program to reset.\n"
             "\t [[{{node step/replica_0/replicator_rewrite/0_all_reduce/CollectiveReduceV2}}]]\n"
             "  (1) INVALID_ARGUMENT: made on replica 1 : Tensor had NaN values\n"
             "\t [[{{node step/replica_1/CheckNumerics}}]]\n"
             "0 successful operations.")
  first, nodes = _failures.parse(message)
  assert first == "INVALID_ARGUMENT: made on replica 1 : Tensor had NaN values"
  assert nodes == ["step/replica_1/CheckNumerics"] and _failures.failing_replicas(nodes) == [1]
  # Only derived errors: they are what there is.
  only = "1 root error(s) found.\n  (0) CANCELLED: cancelled\n\t [[{{node step/replica_0/x}}]]"
  assert _failures.parse(only)[1] == ["step/replica_0/x"]
