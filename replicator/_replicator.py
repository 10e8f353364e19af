"""The Replicator: replicated variables, ``run``, collectives and reductions."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
import tree

import mesh as mesh_lib
import rewrite
from replicator import _context
from replicator import _distributed_dataset
from replicator import _errors
from replicator import _inputs
from replicator import _optimizer
from replicator import _primitives
from replicator import _step
from replicator import _values
from replicator import _variables
from replicator._values import PerReplica


@_context.no_autograph
class Replicator:
  """Runs a single-device training step on several devices, in one graph.

  Variables created in :meth:`context` get one identical component per
  device. :meth:`run` traces ``step_fn`` once per replica, each trace under its
  device; collectives called inside it (:meth:`all_reduce`, :meth:`broadcast`,
  :meth:`all_gather`, ``wrap_optimizer``'s gradient reduction) leave
  placeholders that a rewrite pass replaces with real cross-device
  communication. The result is cached: later calls run one graph.

  >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
  >>> with repl.context():
  ...   v = tf.Variable(1.0)
  >>> def step_fn():
  ...   v.assign_add(repl.all_sum(tf.cast(repl.replica_id, tf.float32)))
  ...   return v.read_value()
  >>> [float(x) for x in repl.run(step_fn)]  # 1 + (0 + 1) on both replicas
  [2.0, 2.0]

  Args:
    devices: device strings, or None for all local logical devices of the
      preferred type (GPUs if any, else CPUs).
    mesh: a :class:`mesh.Mesh` to run on instead of ``devices`` (one replica per
      mesh device). By default a one-dimensional mesh ``{"replica": N}``.
    implementation: collective implementation: ``"auto"`` (chosen per
      collective) or a registered lowering name (``"one_device"``,
      ``"collective_ops"``).
    autograph: convert ``step_fn`` with AutoGraph, as ``tf.function`` does.
    prefetch_to_device: elements of each ``input_fn`` dataset to prefetch onto
      its replica's device (0: iterate on the host). By default 2 on
      accelerators and 0 on CPUs, where device memory is host memory (on 4
      logical CPUs it made an overhead-bound step 1.37x slower).
  """

  def __init__(self, devices: Sequence[str] | None = None, *, mesh: mesh_lib.Mesh | None = None,
               implementation: str = "auto", autograph: bool = True, prefetch_to_device: int | None = None):
    if mesh is not None and devices is not None:
      raise ValueError("Pass either `devices` or `mesh` to Replicator, not both "
                       "(a mesh already lists its devices).")
    self._mesh = mesh if mesh is not None else mesh_lib.Mesh.from_devices(devices)
    if implementation != "auto":
      rewrite.get_lowering(implementation)  # raises a clear error if unknown
    self._implementation = implementation
    self._autograph = autograph
    self._creator = _variables.make_creator(self)
    self._steps: dict[Any, _step.CompiledStep] = {}
    self._sources: dict[Any, _inputs.Source] = {}
    # Weak keys: datasets passed once (say, a new one per call) are not kept alive.
    self._distributed: "weakref.WeakKeyDictionary[tf.data.Dataset, Any]" = weakref.WeakKeyDictionary()
    self._dataset_sources: "weakref.WeakKeyDictionary[Any, _inputs.Source]" = weakref.WeakKeyDictionary()
    self._converted: dict[Any, Callable] = {}
    self._accumulating: "weakref.WeakSet[_optimizer.ReplicatedOptimizer]" = weakref.WeakSet()
    self._host = mesh_lib.canonical_name("CPU:0")
    if prefetch_to_device is None:
      on_cpu = all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in self.devices)
      prefetch_to_device = 0 if on_cpu else 2
    self._prefetch_to_device = prefetch_to_device
    self.trace_count = 0
    self.steps_run = 0

  # -- placement ---------------------------------------------------------------

  @property
  def mesh(self) -> mesh_lib.Mesh:
    """The mesh the replicas run on."""
    return self._mesh

  @property
  def devices(self) -> tuple[str, ...]:
    """One device per replica, in replica order."""
    return self._mesh.devices

  @property
  def num_replicas(self) -> int:
    """The number of replicas."""
    return self._mesh.size

  @property
  def replica_id(self) -> int:
    """The replica being built (inside ``step_fn`` only), a Python int."""
    return _primitives.require_context(self, "replica_id").replica_id

  # -- variables ---------------------------------------------------------------

  @contextlib.contextmanager
  def context(self):
    """Replicates every variable created inside (Keras, tf.Module, Sonnet, tf.Variable).

    >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
    >>> with repl.context():
    ...   v = tf.Variable([1.0, 2.0])
    >>> len(v.components), v.components[1].device
    (2, '/job:localhost/replica:0/task:0/device:CPU:1')
    """
    with tf.variable_creator_scope(self._creator):
      yield self

  # -- running -------------------------------------------------------------------

  def run(self, step_fn: Callable, input_fn: Callable | None = None, *, inputs: Any = None,
          steps: int = 1, all_steps: bool = False):
    """Runs one step of ``step_fn`` on every replica.

    Args:
      step_fn: the per-replica step. Called with the replica's input element
        (from ``input_fn``'s dataset or ``inputs``), or with no argument.
      input_fn: ``input_fn(ctx: InputContext) -> tf.data.Dataset``, called once
        per replica per epoch; its iterators are reused on later calls until the
        input ends. Or a dataset of global batches (a ``tf.data.Dataset`` or
        ``repl.distribute_dataset(...)``), split across the replicas each step.
      inputs: explicit per-replica inputs: a ``PerReplica`` (or sequence) with
        one nest of tensors per replica.
      steps: run this many steps in one graph call (an in-graph loop), paying
        the per-call overhead once. With an ``input_fn`` each step takes the
        next elements; the loop stops early when the input ends.
      all_steps: return every step's results stacked along a new leading
        dimension (one entry per step run), instead of the last step's.

    Raises:
      EndOfInput: the input ended before any step ran (a ``StopIteration``).

    Returns:
      The nest ``step_fn`` returns, with a ``PerReplica`` (one value per
      replica) at each tensor leaf, as ``tf.distribute`` does: a step returning
      ``loss, accuracy`` can be unpacked as ``loss, accuracy = repl.run(...)``.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
      raise ValueError(f"repl.run(steps={steps!r}): steps must be a positive integer.")
    step, source = self._compiled(step_fn, input_fn, inputs)
    if steps > 1 and step.accumulating:
      raise ValueError(
          f"repl.run(steps={steps}) with an optimizer wrapped with accumulation_steps > 1 is not "
          "supported: each step needs its own phase (accumulate or apply). Fix: run one step per call.")
    try:
      results, self.steps_run = step(source.call_args(), steps, all_steps)
    except _errors.EndOfInput:
      self._forget(source)  # the epoch is over: the next run starts a new one
      raise
    for optimizer in step.accumulating:
      optimizer.advance(self.steps_run)
    return _values.combine(results)

  def distribute_dataset(self, dataset: tf.data.Dataset, prefetch: int = 2) -> _distributed_dataset.DistributedDataset:
    """Splits every global batch of ``dataset`` across the replicas.

    Pass the result as ``repl.run(step_fn, distributed)`` (split in the step's
    graph, no extra host round trip), or iterate it for ``inputs=``. A partial
    last batch is split as evenly as possible; replicas without rows run the
    step on an empty batch. Average a loss over the true global batch with
    ``tf.reduce_sum(per_example) / repl.all_sum(tf.shape(x)[0])`` and
    ``wrap_optimizer(..., reduction="sum")``.

    >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
    >>> ds = tf.data.Dataset.range(5).batch(5)
    >>> [b.numpy().tolist() for b in next(iter(repl.distribute_dataset(ds)))]
    [[0, 1, 2], [3, 4]]
    """
    return _distributed_dataset.DistributedDataset(dataset, self.num_replicas, self._host, prefetch)

  def explain(self, step_fn: Callable, input_fn: Callable | None = None, *, inputs: Any = None) -> rewrite.Plan:
    """Returns the rewrite plan of ``step_fn``: every collective, its size and implementation.

    Builds (and caches) the step like :meth:`run` but does not run it. ``print``
    the result for a table.
    """
    return self._compiled(step_fn, input_fn, inputs)[0].plan  # the variant the next run uses

  def _forget(self, source: _inputs.Source) -> None:
    """Drops an exhausted input source (and its iterators)."""
    for sources in (self._sources, self._dataset_sources):
      for key in [k for k, v in sources.items() if v is source]:
        del sources[key]

  def _compiled(self, step_fn, input_fn, inputs):
    if not callable(step_fn):
      raise TypeError(f"repl.run needs a callable step_fn, found {type(step_fn).__name__}.")
    if input_fn is not None and inputs is not None:
      raise ValueError("Pass either input_fn or inputs= to repl.run, not both.")
    if isinstance(input_fn, tf.data.Dataset):  # global batches: split them across replicas
      if input_fn not in self._distributed:
        self._distributed[input_fn] = self.distribute_dataset(input_fn)
      input_fn = self._distributed[input_fn]
    if isinstance(input_fn, _distributed_dataset.DistributedDataset):
      source = self._dataset_sources.get(input_fn)
      if source is None:
        source = self._dataset_sources[input_fn] = _distributed_dataset.GlobalBatchInputs(input_fn)
    elif input_fn is not None:
      if not callable(input_fn):
        raise TypeError(f"input_fn must be callable (input_fn(ctx) -> tf.data.Dataset), found "
                        f"{type(input_fn).__name__}. To pass per-replica values, use inputs=.")
      source = self._sources.get(input_fn)
      if source is None:
        source = _inputs.DatasetInputs(input_fn, self.devices, self._host, self._prefetch_to_device)
        self._sources[input_fn] = source
    elif inputs is not None:
      source = _inputs.ExplicitInputs(inputs, self.num_replicas)
    else:
      source = _inputs.NoInputs()
    # One traced variant per combination of accumulation phases of the
    # optimizers the step uses (accumulate-only steps have no collectives).
    variants = self._steps.setdefault((step_fn, source.key), {})
    used = next(iter(variants.values())).accumulating if variants else tuple(self._accumulating)
    for optimizer in used:
      optimizer.prepare_trace()
    phases = tuple(o.phase() for o in used) if variants else None
    step = variants.get(phases)
    if step is not None:
      step.use_source(source)
    else:
      step = _step.build(self, step_fn, source, self._choose)
      self.trace_count += 1
      variants[tuple(o.phase() for o in step.accumulating)] = step
    return step, source

  def _convert(self, fn: Callable) -> Callable:
    if not self._autograph:
      return fn
    converted = self._converted.get(fn)
    if converted is None:
      try:
        converted = tf.autograph.to_graph(fn)
        _primitives.register_source_map(converted)
      except Exception:  # pylint: disable=broad-except  # not convertible: run as written
        converted = fn
      self._converted[fn] = converted
    return converted

  def _choose(self, collective: rewrite.Collective) -> str:
    if self._implementation != "auto":
      return self._implementation
    return rewrite.auto_lowering(collective)

  # -- optimizers ------------------------------------------------------------------

  def wrap_optimizer(self, optimizer, reduction: str = "mean",
                     accumulation_steps: int = 1) -> _optimizer.ReplicatedOptimizer:
    """Wraps a Keras 3 or Sonnet 2 optimizer so updates use gradients reduced over replicas.

    Args:
      optimizer: the optimizer (create it inside :meth:`context`).
      reduction: ``"mean"`` (default: each replica's loss is a per-replica
        mean) or ``"sum"`` (the loss is already divided by the global batch).
      accumulation_steps: accumulate gradients locally for this many steps,
        then reduce them across replicas once and apply their mean: equal to
        one step on a ``accumulation_steps`` times larger batch. The step is
        traced twice (an accumulate-only variant without communication, and
        the applying one); run one step per call.
    """
    wrapped = _optimizer.ReplicatedOptimizer(self, optimizer, reduction, accumulation_steps)
    if accumulation_steps > 1:
      self._accumulating.add(wrapped)
    return wrapped

  # -- collectives (inside step_fn) -----------------------------------------------------

  def _axes(self, axis) -> tuple[str, ...]:
    return self._mesh.normalize_axes(axis)

  def all_reduce(self, x, op: str = "sum", *, axis=None):
    """Reduces ``x`` (any nest of tensors) elementwise across replicas; all get the result.

    Args:
      x: a tensor or nest of tensors.
      op: "sum", "mean", "max" or "min".
      axis: mesh axis name or tuple of names to reduce over (default: all).
    """
    ctx = _primitives.require_context(self, "all_reduce")
    return _primitives.all_reduce(ctx, x, op, self._axes(axis), _primitives.user_location())

  def all_sum(self, x, *, axis=None):
    """``all_reduce(x, "sum")``."""
    ctx = _primitives.require_context(self, "all_sum")
    return _primitives.all_reduce(ctx, x, "sum", self._axes(axis), _primitives.user_location())

  def broadcast(self, x, source: int = 0, *, axis=None):
    """Every replica gets replica ``source``'s value of ``x`` (any nest)."""
    ctx = _primitives.require_context(self, "broadcast")
    return _primitives.broadcast(ctx, x, source, self._axes(axis), _primitives.user_location())

  def all_gather(self, x, axis: int = 0):
    """Concatenates every replica's ``x`` (any nest) along tensor dimension ``axis``."""
    ctx = _primitives.require_context(self, "all_gather")
    return _primitives.all_gather(ctx, x, axis, self._axes(None), _primitives.user_location())

  # -- results (outside step_fn) --------------------------------------------------------

  def reduce(self, op: str, per_replica, axis: int | None = None):
    """Combines ``PerReplica`` values into ordinary tensors.

    Args:
      op: "sum", "mean", "max" or "min".
      per_replica: a ``PerReplica``, or a nest of them (what :meth:`run` returns).
      axis: None reduces across replicas only (elementwise); an int also
        reduces along that dimension of the values concatenated across
        replicas (e.g. the mean over a global batch of per-example losses).
    """
    if op not in _primitives.REDUCE_OPS:
      raise ValueError(f"repl.reduce(op={op!r}): op must be one of {_primitives.REDUCE_OPS}.")
    reducer = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max,
               "min": tf.reduce_min}[op]

    def one(leaves):
      with tf.device(self._host):
        tensors = [tf.convert_to_tensor(t) for t in leaves]
        if axis is None:
          return reducer(tf.stack(tensors), axis=0)
        return reducer(tf.concat(tensors, axis=axis), axis=axis)

    return self._map_per_replica(one, per_replica, "reduce")

  def gather(self, per_replica, axis: int = 0):
    """Concatenates ``PerReplica`` values (or a nest of them) along ``axis``."""

    def one(leaves):
      with tf.device(self._host):
        return tf.concat([tf.convert_to_tensor(t) for t in leaves], axis=axis)

    return self._map_per_replica(one, per_replica, "gather")

  def _map_per_replica(self, fn, per_replica, name):
    def leaf(value):
      if value is None:
        return None
      if not isinstance(value, PerReplica):
        raise TypeError(f"repl.{name}() takes the PerReplica values returned by repl.run (or a nest of "
                        f"them), found {type(value).__name__}.")
      if len(value) != self.num_replicas:
        raise ValueError(f"repl.{name}() got a PerReplica of {len(value)} values, but this "
                         f"Replicator has {self.num_replicas} replicas.")
      return fn(value.values)

    return tree.map_structure(leaf, per_replica)

  def __repr__(self):
    return f"Replicator(num_replicas={self.num_replicas}, mesh={self._mesh!r})"
