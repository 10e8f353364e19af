"""The local view: ``step_fn`` sees each device's piece and calls collectives itself.

:class:`LocalView` is what ``Replicator.run`` hands a step in the local view
(``view="local"``, the default). It finds the step's input source (an
``input_fn``'s per-replica datasets, a dataset of global batches split in the
step's graph, explicit ``inputs=``), finds or builds the step for that source
(``_local_step.build``: traced once per replica, planned and rewritten; cached by
step function, source and accumulation phases) and runs it through the
Replicator's ``RunState``. The global view (``_global.GlobalView``) has
the same interface: ``run``, ``run_in_function``, ``explain``.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from replicator.core import _callables
from replicator.core import _errors
from replicator.core import _primitives
from replicator.core import _values
from replicator.core import _weak
from replicator.input import _distributed_dataset
from replicator.input import _inputs
from replicator.views import _in_function
from replicator.views import _local_step
from replicator.views import _memory_report as _memory

NEW_STEP_OBJECTS = (
    "repl.run has built a step for {count} different objects of the same step function {name} "
    "({where}): each new object (a lambda, a nested def or a functools.partial made anew for each call) "
    "is a new step, traced on every replica, rewritten and compiled again, which costs far more than "
    "running it. Fix: create the step function once, outside the loop, and pass the same object to "
    "every repl.run call; pass values that change from call to call as inputs (input_fn, a dataset or "
    "inputs=), not as closure variables."
)
NEW_STEP_WARNING_AFTER = 5  # new objects of one step function, as tf.function's retracing warning


class LocalView:
  """Builds and runs a Replicator's steps in the local view; owns their cache and the input sources.

  Args:
    replicator: the Replicator whose steps these are (what the steps' code calls).
    config: its ``_config.Config``.
    state: its ``_run_state.RunState``.
    creator: its variable creator (``_variables.make_creator``).
  """

  name = "local"

  def __init__(self, replicator, config, state, creator: Callable):
    self._replicator = replicator
    self._config = config
    self._state = state
    self._creator = creator
    # The built steps (what benchmarks and tests inspect): step_fn -> {source key: {phases: step}}, an entry
    # released when the caller drops its step_fn.
    self.steps = _weak.CallableMap()
    self._step_objects: dict[Any, int] = {}  # step function code -> objects built for it
    self._warned_new_steps = False
    # Input sources (their iterators) by input_fn, released when the caller drops the input_fn.
    self._sources = _weak.CallableMap()
    self._last_distributed = None  # weakrefs to the last dataset run on and its DistributedDataset

  def run(self, step_fn: Callable, input_fn, inputs, steps: int, all_steps: bool):
    """``steps`` steps of ``step_fn`` on every replica, from Python; their results as ``PerReplica`` values."""
    if not _errors.positive_int(steps):
      raise _errors.ArgumentError(f"repl.run(steps={steps!r}): steps must be a positive integer.")
    step, source = self.step(step_fn, input_fn, inputs)
    if steps > 1 and step.accumulating:
      raise _errors.ArgumentError(_errors.ACCUMULATING_STEPS.format(steps=steps))
    try:
      results = self._state.execute(step, lambda stop: step(source.call_args(), steps, all_steps, stop),
                                    loop=steps > 1)
    except _errors.EndOfInput:
      self._forget(source)  # the epoch is over: the next run starts a new one
      raise
    return _values.combine(results)

  def run_in_function(self, step_fn: Callable, inputs):
    """One step of ``step_fn`` called from the ``tf.function`` being traced (``_in_function``)."""
    step, source = self.step(step_fn, None, inputs)  # its own graph (tf.init_scope would stop tapes)
    if step.accumulating:
      raise _errors.UnsupportedError(_in_function.ACCUMULATING)
    self._state.check_replicas_agree()
    return _values.combine(step.call_in_graph(source.call_args()))

  def explain(self, step_fn: Callable, input_fn, inputs):
    """The rewrite plan of the step the next ``run`` would call (its ``memory``: the step's memory report)."""
    step = self.step(step_fn, input_fn, inputs)[0]
    if step.plan.memory_report is None:
      step.plan = dataclasses.replace(step.plan, memory_report=_memory.later(step, self._replicator, self._config,
                                                                               "local"))
    return step.plan

  def memory(self, step_fn: Callable, input_fn, inputs):
    """The memory report of the step the next ``run`` would call (``rewrite.MemoryReport``)."""
    return self.explain(step_fn, input_fn, inputs).memory

  def step(self, step_fn: Callable, input_fn, inputs):
    """The built step of ``step_fn`` for this input source and the next accumulation phases, and the source."""
    if not callable(step_fn):
      raise _errors.ArgumentTypeError(f"repl.run needs a callable step_fn, found {type(step_fn).__name__}.")
    if input_fn is not None and inputs is not None:
      raise _errors.ArgumentError("Pass either input_fn or inputs= to repl.run, not both.")
    source = self._source(input_fn, inputs)
    # One traced variant per combination of accumulation phases of the
    # optimizers the step uses (accumulate-only steps have no collectives).
    by_source = self.steps.get(step_fn)
    if by_source is None:
      by_source = {}
      self.steps.set(step_fn, by_source)
      self._count_step_object(step_fn)
    step = self._state.variant(by_source.setdefault(source.key, {}),
                               lambda: _local_step.build(self._replicator, self._config, self._creator, step_fn, source))
    step.use_source(source)  # a step built before may have run on another source (its last epoch's)
    return step, source

  def _source(self, input_fn, inputs) -> _inputs.Source:
    replicator = self._replicator
    if isinstance(input_fn, tf.data.Dataset):  # global batches: split them across replicas
      input_fn = self._distributed_for(input_fn)
    if isinstance(input_fn, _distributed_dataset.DistributedDataset):
      sources = _weak.attached(input_fn, "_replicator_sources")  # on the dataset: goes with it
      source = sources.get(replicator)
      if source is None:
        source = sources[replicator] = _distributed_dataset.GlobalBatchInputs(input_fn)
      return source
    if input_fn is not None:
      if not callable(input_fn):
        raise _errors.ArgumentTypeError(f"input_fn must be callable (input_fn(ctx) -> tf.data.Dataset), found "
                                        f"{type(input_fn).__name__}. To pass per-replica values, use inputs=.")
      source = self._sources.get(input_fn)
      if source is None:
        pipelines = [replicator.input_pipeline(r) for r in range(replicator.num_replicas)]
        hosts = self._config.input_hosts or (self._config.host,) * (max(pipelines) + 1)
        source = _inputs.DatasetInputs(input_fn, replicator.devices, list(hosts), self._config.prefetch_to_device,
                                       pipelines, self._config.drop_remainder, self._config.local_replicas,
                                       agree=self._config.agree)
        self._sources.set(input_fn, source)
      return source
    if inputs is not None:
      return _inputs.ExplicitInputs(inputs, len(self._config.local_replicas))
    return _inputs.NoInputs()

  def _distributed_for(self, dataset: tf.data.Dataset) -> _distributed_dataset.DistributedDataset:
    """The Replicator's distributed version of ``dataset``, made once and kept on the dataset itself.

    Kept there (not in a map of this view's) so that it goes with the
    dataset: a map from the dataset to it would keep the dataset alive, since
    the distributed dataset reads it.
    """
    last = self._last_distributed
    if last is not None and last[0]() is dataset and last[1]() is not None:  # as the last call: no lookup
      return last[1]()
    per_replicator = _weak.attached(dataset, "_replicator_distributed")
    distributed = per_replicator.get(self._replicator)
    if distributed is None:
      distributed = per_replicator[self._replicator] = self._replicator.distribute_dataset(dataset)
    self._last_distributed = (weakref.ref(dataset), weakref.ref(distributed))
    return distributed

  def _forget(self, source: _inputs.Source) -> None:
    """Drops an exhausted input source (and its iterators)."""
    self._sources.discard(source)
    _weak.attached(source.distributed() if isinstance(source, _distributed_dataset.GlobalBatchInputs) else None,
                   "_replicator_sources").pop(self._replicator, None)

  def _count_step_object(self, step_fn: Callable) -> None:
    """Warns (once) when many objects of one step function were built: a new lambda per call."""
    code = _callables.code_of(step_fn)
    if code is None:
      return
    count = self._step_objects[code] = self._step_objects.get(code, 0) + 1
    if count >= NEW_STEP_WARNING_AFTER and not self._warned_new_steps:
      self._warned_new_steps = True
      warnings.warn(NEW_STEP_OBJECTS.format(count=count, name=code.co_name,
                                            where=f"{code.co_filename}:{code.co_firstlineno}"),
                    stacklevel=_primitives.user_stacklevel())
