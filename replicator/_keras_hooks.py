"""Keras's distribution API on TensorFlow, made to distribute: ``replicator.enable_keras_distribution()``.

Keras 3's distribution API (``keras.distribution.set_distribution``,
``Distribution.scope()``, ``DataParallel``, ``ModelParallel`` with a
``LayoutMap``) lays out variables and data on JAX; on TensorFlow, Keras 3.15
accepts every call and trains on one device. After
``enable_keras_distribution()``, setting a distribution also makes current the
Keras strategy of a global-view Replicator for it (one per distribution
object, made on first use): with that mesh, the batch split over the
distribution's batch axis and, for ``ModelParallel``, the variables laid out
by its layout map (matched as Keras matches them: ``re.fullmatch``, a shorter
layout padded with ``None``). Models made while it is set are the
Replicator's, as if made in ``repl.context()``: their ``fit``, ``evaluate``
and ``predict`` run distributed, and custom loops run with
``distribution_replicator().run(step_fn, dataset)``. Unsetting the
distribution (or leaving its ``scope()``) unsets the strategy.

Keras's distribution state is per thread (``keras.src.backend.common.
global_state``), and so is TensorFlow's current strategy: a distribution set
in one thread distributes the models made in that thread.

Private Keras API, in this module only (checked on Keras 3.15.1 and
TensorFlow 2.21.0; tests/test_keras_distribution.py fails if it changes):

* ``set_distribution`` is replaced, where Keras defines it
  (``keras.src.distribution.distribution_lib``, which ``Distribution.scope()``
  calls) and where it is exported (``keras.distribution``), by a function that
  calls it and then sets TensorFlow's current strategy
  (``tf.distribute.experimental_set_strategy``, public);
* the functions Keras's front end calls and its TensorFlow backend lacks are
  added to that backend's ``distribution_lib``: ``get_device_count``,
  ``distribute_tensor`` (inside a global-view step, ``Replicator.with_layout``:
  a ``LayoutMap`` key for a layer's output lays it out; elsewhere the value
  itself: ``_keras_outputs``)
  and ``initialize`` (refused: several processes are
  ``replicator.MultiWorkerReplicator``'s);
* ``ModelParallel``'s layout map is read from its ``_layout_map``.
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf

from replicator.core import _errors
from replicator.integrations import _cluster
from replicator.integrations import _collective_runtime
from replicator.integrations import _keras_distribution
from replicator.integrations import _keras_outputs
from replicator.integrations import _remat

UNSUPPORTED_DISTRIBUTION = (
    "keras.distribution.set_distribution({found}): replicator distributes keras.distribution.DataParallel and "
    "ModelParallel; a {kind} has no counterpart here. Fix: use one of those two, or a replicator.Replicator directly."
)
INITIALIZE_ADDRESSES = (
    "keras.distribution.initialize(job_addresses={addresses!r}, num_processes={processes!r}, process_id={task!r}): "
    "on TensorFlow every process serves the job at its own address, so job_addresses must list every process's "
    "host:port, comma separated, one per process (JAX needs only the first). Fix: pass all {processes} addresses "
    "(or set KERAS_DISTRIBUTION_JOB_ADDRESSES; `python -m replicator.launch` sets it), and a process_id below "
    "num_processes."
)
INITIALIZED_TWICE = (
    "keras.distribution.initialize(...) was called again with {new}, after {old}: one process is one worker of "
    "one job. Fix: call it once, first thing in the script."
)
IN_STRATEGY_SCOPE = (
    "keras.distribution.set_distribution(...) was called inside the scope of a {strategy} (a tf.distribute "
    "strategy's `with strategy.scope():`, or a Replicator's `with repl.context():`): after "
    "replicator.enable_keras_distribution() a Keras distribution makes its own Replicator's strategy current, and "
    "TensorFlow allows one. Fix: set the distribution outside that scope, or use the Replicator's context alone."
)
NOT_ENABLED = (
    "replicator.distribution_replicator() needs a Keras distribution set after replicator.enable_keras_distribution() "
    "(found {found}). Fix: call replicator.enable_keras_distribution() once, then "
    "keras.distribution.set_distribution(...) (or enter its scope()) before asking for its Replicator."
)

_lock = threading.Lock()
_installed = False  # Keras patched (enable_keras_distribution)
_job: tuple | None = None  # (addresses, process id) once keras.distribution.initialize started the runtime
_connect_timeout = 30.0  # seconds keras.distribution.initialize waits for the other workers (enable_keras_distribution)
_replicators: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # distribution -> its Replicator


def enable_keras_distribution(connect_timeout: float = 30.0) -> None:
  """Makes Keras's distribution API distribute on TensorFlow: one added line for code written for it.

  After this call, a ``keras.distribution.DataParallel`` or ``ModelParallel``
  set with ``keras.distribution.set_distribution`` (or entered with its
  ``scope()``) is carried out by a global-view :class:`Replicator` with the
  distribution's mesh, batch axis and layout map: the Keras models (and other
  variables) created while it is set are that Replicator's, and their ``fit``,
  ``evaluate`` and ``predict`` run on every device of the mesh. A custom loop
  runs its step with ``distribution_replicator().run(step_fn, dataset)``.
  Layout map keys are matched as Keras 3.15 matches them (``re.fullmatch``),
  a shorter layout padded with ``None``. ``keras.RematScope`` and
  ``keras.remat`` rematerialize as :func:`replicator.remat` does (on
  TensorFlow Keras's own fails inside ``fit``). ``keras.distribution.get_device_count``
  and ``distribute_tensor`` work; ``keras.distribution.initialize()`` makes
  this process one worker of a multi-client job (every worker runs the
  script), waiting ``connect_timeout`` seconds at most for the other workers
  to come (else ``replicator.WorkerUnavailableError``, naming them).
  Call it once, before setting a distribution; later calls do nothing but
  take the new ``connect_timeout``. On a
  Keras backend other than TensorFlow it does nothing (Keras distributes).
  See the guide "From Keras's distribution API on JAX".

  Examples:
    >>> import keras
    >>> replicator.enable_keras_distribution()
    >>> dp = keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"])
    >>> with dp.scope():
    ...   layer = keras.layers.Dense(2)
    ...   layer.build((None, 3))
    >>> len(layer.kernel.value.components)  # one copy a device
    2
  """
  global _installed, _connect_timeout
  _connect_timeout = _cluster.check_timeout("connect_timeout", connect_timeout, allow_zero=False)
  with _lock:
    if _installed:
      return
    import keras  # pylint: disable=import-outside-toplevel
    from keras.src import backend as keras_backend  # pylint: disable=import-outside-toplevel
    from keras.src.distribution import distribution_lib  # pylint: disable=import-outside-toplevel

    if keras.backend.backend() != "tensorflow":
      return  # Keras on JAX (or torch) distributes itself
    _remat.install()  # keras.RematScope / keras.remat: replicator.remat (integrations/_remat.py)
    original = distribution_lib.set_distribution

    def set_distribution(value):
      previous = distribution_lib.distribution()
      original(value)
      try:
        _make_current(value)
      except BaseException:
        original(previous)  # as before the call: Keras's state and TensorFlow's agree
        raise

    set_distribution.__doc__ = original.__doc__
    distribution_lib.set_distribution = set_distribution
    keras.distribution.set_distribution = set_distribution
    backend = keras_backend.distribution_lib  # the TensorFlow backend's module
    listed = backend.list_devices

    def list_devices(device_type=None):
      return listed(device_type) if _job is None else list(_collective_runtime.job_devices())

    list_devices.__doc__ = listed.__doc__
    for name, fn in (("get_device_count", _get_device_count), ("distribute_tensor", _keras_outputs.distribute_tensor),
                     ("initialize", _initialize), ("list_devices", list_devices)):
      setattr(backend, name, fn)
    _installed = True
    _make_current(distribution_lib.distribution())  # one set before enabling


def replicator_for(distribution):
  """The global-view Replicator that carries out ``distribution`` (made once per distribution object)."""
  found = _replicators.get(distribution)
  if found is None:
    found = _replicators[distribution] = _make(distribution)
  return found


def distribution_replicator():
  """The :class:`Replicator` that carries out the Keras distribution set now (after ``enable_keras_distribution``).

  For a custom training loop: ``distribution_replicator().run(step_fn,
  dataset)`` runs a one-device step on the distribution's mesh, partitioned by
  its layouts (the global view). One Replicator per distribution object.

  Raises:
    ReplicaContextError: no distribution is set, or distributions are not enabled.
  """
  import keras  # pylint: disable=import-outside-toplevel
  distribution = keras.distribution.distribution()
  if not _installed or distribution is None:
    found = "no distribution set" if _installed else "not enabled"
    raise _errors.ReplicaContextError(NOT_ENABLED.format(found=found))
  return replicator_for(distribution)


def _make(distribution):
  import keras  # pylint: disable=import-outside-toplevel

  from replicator import _replicator  # pylint: disable=import-outside-toplevel  (it imports this module's users)

  kind = type(distribution).__name__
  if not isinstance(distribution, (keras.distribution.DataParallel, keras.distribution.ModelParallel)):
    raise _errors.UnsupportedError(UNSUPPORTED_DISTRIBUTION.format(found=kind, kind=kind))
  mesh = _keras_distribution.as_mesh(distribution.device_mesh)
  layouts = None
  if isinstance(distribution, keras.distribution.ModelParallel):
    layouts = _keras_distribution.as_layout_map(distribution._layout_map)  # pylint: disable=protected-access
  settings = dict(mesh=mesh, layouts=layouts, view="global", batch_axes=(distribution.batch_dim_name,))
  if _job is not None:  # one process of a job: keras.distribution.initialize(...) was called
    from replicator import _multiworker  # pylint: disable=import-outside-toplevel  (as _replicator)
    addresses, task = _job
    return _multiworker.MultiWorkerReplicator({"worker": list(addresses)}, task=task, **settings)
  return _replicator.Replicator(**settings)


def _make_current(distribution) -> None:
  """TensorFlow's current strategy: the Keras strategy of ``distribution``'s Replicator, or none."""
  strategy = None if distribution is None else replicator_for(distribution).keras_strategy
  current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
  if current is strategy:
    return
  try:
    tf.distribute.experimental_set_strategy(strategy)
  except RuntimeError as e:  # "Must not be called inside a `tf.distribute.Strategy` scope."
    raise _errors.ArgumentError(IN_STRATEGY_SCOPE.format(strategy=type(current).__name__)) from e


def _get_device_count(device_type=None) -> int:
  """As Keras's other backends: the devices of ``device_type`` (by default accelerators if any, else CPUs)."""
  device_type = device_type.upper() if device_type else None
  if device_type is None:
    accelerators = [d for d in tf.config.list_logical_devices() if d.device_type != "CPU"]
    return len(accelerators) or len(tf.config.list_logical_devices("CPU"))
  return len(tf.config.list_logical_devices(device_type))


def _initialize(job_addresses=None, num_processes=None, process_id=None):
  """``keras.distribution.initialize``: this process as worker ``process_id`` of the job at ``job_addresses``.

  Starts TensorFlow's collective runtime (as ``MultiWorkerReplicator.from_tf_config()`` does) with
  ``REPLICATOR_DEVICES_PER_WORKER`` logical CPUs a process (default 1); ``list_devices()`` then lists every
  process's devices, and a distribution over them is carried out by a multi-client ``MultiWorkerReplicator``.
  """
  global _job
  addresses = [a.strip() for a in (job_addresses or "").split(",") if a.strip()]
  processes = len(addresses) if num_processes is None else num_processes
  if (not addresses or processes != len(addresses) or not isinstance(process_id, int)
      or not 0 <= process_id < len(addresses)):
    raise _errors.ClusterConfigError(INITIALIZE_ADDRESSES.format(addresses=job_addresses, processes=num_processes,
                                                                 task=process_id))
  job = (tuple(addresses), process_id)
  if _job is not None and _job != job:
    raise _errors.ClusterConfigError(INITIALIZED_TWICE.format(new=job, old=_job))
  devices_per_worker = _collective_runtime.devices_per_worker_from_environment()
  _collective_runtime.start(addresses, process_id, devices_per_worker, _connect_timeout)
  _job = job
