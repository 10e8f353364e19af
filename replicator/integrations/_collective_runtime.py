"""TensorFlow's collective runtime in this process, as one worker of a job that runs one program per worker.

In a multi-client job every worker process runs the same script. Collectives
whose groups span several processes meet through TensorFlow's own runtime:
each process serves gRPC on its cluster address, worker 0 is the collective
group leader (every group is resolved there: its size, device type and
members), and the coordination service lets the processes know each other's
devices. :func:`start` turns that on through
``tf.experimental.dtensor.initialize_accelerator_system``, TensorFlow's public
entry to the multi-client runtime (``MultiWorkerMirroredStrategy`` does the
same through private calls): it configures the leader, the coordination
service and the server from ``DTENSOR_*`` variables, which :func:`start` sets
from the cluster, and initializes TensorFlow's context. So it must run before
any TensorFlow op.

DTensor's own heartbeat (a periodic all-reduce that aborts the process on a
missed beat) is turned off: a worker that does not come to a step is named
by this library's watchdog (``_watchdog``, over the coordination service's
key-value store) after ``collective_timeout`` (tested).

Checked on TensorFlow 2.21: logical CPUs of several processes form one group
(2 processes x 2 CPUs: an all-reduce of 4 values in 2.2 ms a call).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random

import tensorflow as tf

import rewrite
from mesh import _devices  # the intra-op threads of logical CPUs, as virtual_cpus and worker servers set them
from replicator.core import _errors
from replicator.integrations import _rendezvous
from replicator.integrations import _watchdog

JOB = "worker"

TF_ALREADY_STARTED = (
    "TensorFlow was already initialized in this process when its multi-worker runtime was asked to start: the "
    "runtime (its gRPC server, the collective group leader) can only be set up before TensorFlow runs its first op "
    "or lists its devices. Fix: make the multi-worker Replicator first thing in the script, before any model, "
    "dataset or tensor."
)
ALREADY_STARTED = (
    "The multi-worker runtime was already started in this process as worker {task} of {workers} ({devices} "
    "device(s) each), and now asked for worker {new_task} of {new_workers} ({new_devices} each): one process is "
    "one worker of one job. Fix: give every multi-worker Replicator of the process the same cluster, task and "
    "devices_per_worker (from_tf_config() reads them from TF_CONFIG)."
)

START_WATCH = 10.0  # seconds TensorFlow's start may take once the workers met, at least (0.5-2 s seen)
_started: tuple | None = None  # (addresses, task, devices per worker) once started
_counts: dict = {}  # group key -> the agreements made in it so far (shared by every Agreement of the process)


def environment(addresses, task: int) -> dict[str, str]:
  """The ``DTENSOR_*`` variables that make this process worker ``task`` of the job at ``addresses``."""
  return {"DTENSOR_JOBS": ",".join(addresses), "DTENSOR_CLIENT_ID": str(task), "DTENSOR_JOB_NAME": JOB,
          "DTENSOR_ENABLE_HEARTBEAT": "false"}


def devices_per_worker_from_environment() -> int:
  """``REPLICATOR_DEVICES_PER_WORKER`` (``python -m replicator.launch --devices-per-worker`` sets it), else 1."""
  return int(os.environ.get("REPLICATOR_DEVICES_PER_WORKER", "1"))


def device_names(workers: int, devices_per_worker: int) -> tuple[str, ...]:
  """Every device of the job, worker by worker: ``/job:worker/replica:0/task:t/device:CPU:d``."""
  return tuple(f"/job:{JOB}/replica:0/task:{t}/device:CPU:{d}"
               for t in range(workers) for d in range(devices_per_worker))


def start(addresses, task: int, devices_per_worker: int, connect_timeout: float = 30.0) -> tuple[str, ...]:
  """Starts this process as worker ``task`` of the job whose workers serve at ``addresses``; every device of the job.

  Each worker gets ``devices_per_worker`` logical CPUs. The processes first meet (``_rendezvous.meet``): every
  worker must come within ``connect_timeout`` seconds, with the same cluster and device count, each task once.

  Started once a process: later calls for the same job (another Replicator of the program) return its devices.

  Raises:
    ClusterConfigError: TensorFlow already ran in this process, the runtime was started for another job or task, or
      the job's set-up is wrong (a task claimed twice, an address not this machine's or its port taken, another
      cluster or device count in another process): in every process that came.
    WorkerUnavailableError: a worker did not come within ``connect_timeout``.
  """
  global _started
  addresses = list(addresses)
  if _started is not None:
    if _started == (tuple(addresses), task, devices_per_worker):
      return device_names(len(addresses), devices_per_worker)
    old, old_task, old_devices = _started
    raise _errors.ClusterConfigError(ALREADY_STARTED.format(
        task=old_task, workers=len(old), devices=old_devices, new_task=task, new_workers=len(addresses),
        new_devices=devices_per_worker))
  failure = None
  try:  # TensorFlow not started yet (else this raises), checked before the meeting: the others are told too
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * devices_per_worker)
  except RuntimeError:
    failure = TF_ALREADY_STARTED
  _rendezvous.meet(addresses, task, devices_per_worker, connect_timeout, failure)  # (raises the failure, if any)
  os.environ.update(environment(addresses, task))
  # Logical CPUs share the host's cores: a pool of cores // devices threads a kernel, as in one process. The wide
  # MLP on 2 workers x 2 devices (2 cores): 64.0-68.1 ms a step against 81.9-86.2 with TensorFlow's default.
  threads = _devices.intra_op_threads_for(devices_per_worker)
  if threads and not tf.config.threading.get_intra_op_parallelism_threads():
    tf.config.threading.set_intra_op_parallelism_threads(threads)  # (TensorFlow has not started: checked above)
  watch = _rendezvous.StartWatch(addresses, task, max(connect_timeout, START_WATCH))
  try:
    tf.experimental.dtensor.initialize_accelerator_system("CPU", num_logical_cpu_devices=devices_per_worker)
  finally:
    watch.done()
  _started = (tuple(addresses), task, devices_per_worker)
  return device_names(len(addresses), devices_per_worker)


def job_devices() -> tuple[str, ...]:
  """Every device of the job this process was started in (``start``), worker by worker."""
  if _started is None:
    raise _errors.ClusterConfigError("The multi-worker runtime was not started in this process (a bug: ask after "
                                     "start()).")
  addresses, _, devices_per_worker = _started
  return device_names(len(addresses), devices_per_worker)


class Agreement:
  """Worker 0's values in every process, by eager broadcasts over each worker's first device.

  Used for initial values: a variable's initializer draws different random
  numbers in each process, and replicas must start equal (as
  MultiWorkerMirroredStrategy broadcasts them from worker 0). Every process
  creates its variables in the same order (the same program), so the k-th
  agreement of each process is the same broadcast; its keys are hashed from
  that count (``rewrite.AgreedKeys``), one count for every Agreement of the
  process over the same workers.

  Args:
    leaders: each worker's first device, worker by worker.
    task: this process's worker.
    timeout_seconds: how long an agreement waits for the other workers.
    watchdog: this process's ``_watchdog.Watchdog``, or None. With one, an
      agreement made eagerly is a call it watches (a worker late to it is
      named: ``WorkerUnavailableError``), and the collectives' own timeout is
      its later one (``_watchdog.backstop``), also for agreements in a step.
  """

  _DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)
  _BROADCAST_DTYPES = (tf.bool, tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)

  def __init__(self, leaders, task: int, timeout_seconds: float, watchdog: _watchdog.Watchdog | None = None):
    self._leaders = tuple(leaders)
    self._task = task
    self._timeout = timeout_seconds
    self._watchdog = watchdog
    self._keys = rewrite.AgreedKeys()
    self._group_key = self._keys.group_key(self._leaders)
    # One count per group for the whole process: two Replicators' agreements never take one key.
    self._count = _counts.setdefault(self._group_key, itertools.count())
    self._token = rewrite.ordering_token(self._leaders[task])  # (a handle no variable creator sees)

  def any(self, flag: bool, name: str) -> bool:
    """Whether ``flag`` is True in any process (every process calls it, in the same order, with the same ``name``)."""
    if len(self._leaders) < 2:
      return bool(flag)
    return bool(self._reduce(lambda: tf.constant(int(bool(flag))), "Max", name).numpy())

  def __call__(self, value: tf.Tensor, name: str = "initial value") -> tf.Tensor:
    """``value`` as worker 0 has it (eager; the same shape in every process).

    A broadcast from worker 0, which TensorFlow runs as a tree over the
    workers (log2 W hops; an all-reduce's ring takes 2 (W - 1)).
    """
    if len(self._leaders) < 2:
      return value
    dtype = value.dtype
    if dtype == tf.bfloat16:  # (the broadcast ops take 16-bit floats as half)
      return tf.bitcast(self(tf.bitcast(value, tf.float16), name), tf.bfloat16)
    if dtype not in self._BROADCAST_DTYPES:
      return value  # strings and the like: left as each process made them

    def broadcast(key, timeout):
      common = dict(group_size=len(self._leaders), group_key=self._group_key, instance_key=key,
                    timeout_seconds=timeout)
      if self._task == 0:
        return tf.raw_ops.CollectiveBcastSendV2(input=value, **common)
      return tf.raw_ops.CollectiveBcastRecvV2(shape=tf.shape(value), T=dtype, **common)

    return self._collective(broadcast, name)

  def total(self, value: tf.Tensor, name: str) -> tf.Tensor:
    """The sum of every process's ``value`` (an on-read variable's read; every process reads it at the same point).

    Eager, or an op of the function being traced (each call of the function
    sums again, under the key its trace took).
    """
    if len(self._leaders) < 2:
      return value
    if value.dtype not in self._DTYPES:
      raise TypeError(f"Agreement.total sums numbers, not {value.dtype.name}.")
    return self._reduce(lambda: value, "Add", name, eager=tf.executing_eagerly())

  def job_flag(self, flag: tf.Tensor, any_: bool) -> tf.Tensor:
    """In the function being traced: whether ``flag`` holds in any process (``any_``) or in all of them.

    One op of the step, under one key for every call (calls of a step never
    overlap): every process's step computes it at the same point, so all take
    the same branch after it (the end of uneven input, say).
    """
    if len(self._leaders) < 2:
      return flag
    total = self._reduce(lambda: tf.cast(flag, tf.int32), "Max" if any_ else "Min", "job flag", eager=False,
                         counted=False)
    return tf.cast(total, tf.bool)

  def _reduce(self, mine, merge_op: str, name: str, eager: bool = True, counted: bool = True) -> tf.Tensor:
    """One all-reduce (``merge_op``) of ``mine()`` over the workers' first devices, the ``name``'s next instance."""

    def reduce(key, timeout):
      return tf.raw_ops.CollectiveReduceV2(
          input=mine(), group_size=len(self._leaders), group_key=self._group_key, instance_key=key,
          ordering_token=[self._token], merge_op=merge_op, final_op="Id", timeout_seconds=timeout)

    return self._collective(reduce, name, eager, counted)

  def _collective(self, op, name: str, eager: bool = True, counted: bool = True) -> tf.Tensor:
    """``op(key, timeout)``, a collective over the workers' first devices under the ``name``'s next instance key.

    ``eager``: run now, outside any function being traced (else an op of it).
    ``counted``: the key of the ``name``'s next instance (else of ``name`` itself: the same op every time).
    """
    watched = self._watchdog is not None
    timeout = _watchdog.backstop(self._timeout) if watched else self._timeout
    with (tf.init_scope() if eager else contextlib.nullcontext()), tf.device(self._leaders[self._task]):
      key = self._keys.named_key(self._group_key, f"{name} #{next(self._count)}" if counted else name)
      if not (eager and watched):
        return op(key, timeout)
      with self.watched(f"the workers' agreement on {name!r}"):
        return op(key, timeout)

  @contextlib.contextmanager
  def watched(self, what: str):
    """The body is a call every process makes, meeting the others (a step): a worker late to it is named.

    With a watchdog (see the constructor), after the timeout a late worker
    fails the call with ``WorkerUnavailableError`` naming it (``what``: the
    call, in the message); without one, the body runs as it is.
    """
    if self._watchdog is None:
      yield
      return
    with self._watchdog.watching(self._timeout, what):
      try:
        yield
      except tf.errors.OpError as e:
        verdict = self._watchdog.verdict
        if verdict is None:
          raise
        raise _errors.WorkerUnavailableError(verdict.message, verdict.task, verdict.address) from e


def seed_alike(agree: Agreement) -> int | None:
  """Gives TensorFlow's global random seed worker 0's fresh draw in every process, unless the program set one.

  Every process reads a dataset of global batches whole and keeps its
  replicas' rows, so every process must read the same batches: an unseeded
  shuffle (``dataset.shuffle(n)``, Keras's ``fit(x, y)`` with its default
  ``shuffle=True``) would draw another order in each process, and a step
  would train on some rows twice and others never, silently. With one global
  seed, a random op without its own seed takes its seeds from it and its
  position in the program, alike in every process; a fresh draw a job keeps
  runs different from each other. A seed the program set (before the
  Replicator: ``keras.utils.set_random_seed``) is left as it is. The seed
  (None: left) is returned. Every process calls it, at the same point.
  """
  draw = tf.constant(random.SystemRandom().randrange(1, 2**31), tf.int64)
  seed = int(agree(draw, "random seed"))  # (always: every process makes the same agreements)
  if tf.compat.v1.random.get_seed(None) != (None, None):
    return None
  tf.random.set_seed(seed)
  return seed
