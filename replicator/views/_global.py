"""The global view: ``step_fn`` is the single-device step, seeing global values (``view="global"``).

:class:`GlobalView` is what ``Replicator.run`` hands a step in the global
view. It takes the next global batch of the dataset (its iterator lives on
the dataset, and goes with it), finds or builds the step for its shapes
(``_global_step.build``: traced once at global shapes, partitioned by the
layouts, lowered; cached by step function, element shapes and accumulation
phases) and runs it through the Replicator's ``RunState``. The local view
(``_local.LocalView``) has the same interface.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf
import tree

import rewrite
from replicator.core import _errors
from replicator.core import _values
from replicator.core import _weak
from replicator.input import _distributed_dataset
from replicator.input import _process_shards
from replicator.views import _global_step
from replicator.views import _in_function
from replicator.views import _memory_report as _memory

ONE_BATCH = (
    "repl.run(step_fn, inputs=..., steps={steps}) in the global view: inputs= is one global batch, for one step. "
    "Fix: pass the dataset of global batches, repl.run(step_fn, dataset, steps={steps}), or call repl.run once a batch."
)
TWO_SOURCES = (
    "repl.run(step_fn, {what}, inputs=...) in the global view got two inputs for one step: {found} and inputs=. "
    "It takes one: a tf.data.Dataset of global batches (the next batch each call) or one global batch as inputs= "
    "(one step). Fix: pass one of them, repl.run(step_fn, dataset) or repl.run(step_fn, inputs=batch)."
)
STEPS_NOT_STATIC = (
    "repl.run(steps={steps}) in the global view loops over global batches of one static shape, but the dataset's "
    "elements are {spec}. Fix: batch it with drop_remainder=True."
)


class GlobalView:
  """Builds and runs a Replicator's steps in the global view; owns their cache and the owners' load.

  The same interface as ``_local.LocalView`` (``run``, ``run_in_function``,
  ``explain``), and ``step_for``: the built step for a global batch, which
  Keras's trainer calls from its own function (``_keras``).

  Args:
    replicator: the Replicator whose steps these are.
    config: its ``_config.Config``.
    state: its ``_run_state.RunState``.
    layouts: its ``_layout_state.LayoutState``.
    creator: its variable creator (``_variables.make_creator``).
  """

  name = "global"

  def __init__(self, replicator, config, state, layouts, creator: Callable):
    self._replicator = replicator
    self._config = config
    self._state = state
    self._layouts = layouts
    self._creator = creator
    # The built steps (what benchmarks and tests inspect): step_fn -> {element spec: {phases: GlobalStep}}.
    self.steps = _weak.CallableMap()
    self._owner_load: dict = {}  # batch axes -> bytes of optimizer state each position owns (sharded update)
    self._stages: _global_step.Stages | None = None  # repl.pipeline_stages's

  def set_stages(self, stages: "_global_step.Stages | None") -> None:
    """Runs the steps built from now on as a pipeline of ``stages`` (None: not); steps built before are built
    again."""
    self._stages = stages
    self.steps = _weak.CallableMap()

  def run(self, step_fn: Callable, dataset, inputs, steps: int, all_steps: bool):
    """``steps`` steps of ``step_fn`` on the next global batches of ``dataset`` (or on ``inputs``)."""
    replicator = self._replicator
    if isinstance(dataset, _distributed_dataset.DistributedDataset):
      dataset = dataset.source  # its global batches: the partitioner splits them
    if not _errors.positive_int(steps):
      raise _errors.ArgumentError(f"repl.run(steps={steps!r}): steps must be a positive integer.")
    shard = self.shard_for(dataset) if inputs is None else None
    if shard is not None:  # this process reads its own shard (a multi-client job, the dataset's sharding policy)
      return self._run_shard(step_fn, dataset, shard, steps, all_steps)
    if inputs is not None and dataset is None:  # one global batch, given: one step
      if steps > 1 or all_steps:
        raise _errors.ArgumentError(ONE_BATCH.format(steps=steps))
      element, iterator = global_batch(replicator, inputs), None
    else:
      element, iterator = _next_batch(replicator, dataset, inputs, steps)
    step = self.step_for(step_fn, element)
    if steps > 1 and step.accumulating:
      raise _errors.ArgumentError(_errors.ACCUMULATING_STEPS.format(steps=steps))
    if steps == 1 and not all_steps:
      return self._state.execute(step, lambda stop: (step(tree.flatten(element)), 1), loop=False)
    return self._state.execute(step, lambda stop: step.run_steps(iterator, element, steps, all_steps, stop),
                               loop=True)

  def shard_for(self, dataset, keep: bool = True) -> _process_shards.PaddedShard | None:
    """This process's shard of ``dataset``, if it is read in shards (a multi-client job, the dataset's policy).

    ``keep``: kept on the dataset for the epoch (``repl.run``'s), else a new one (Keras's, which iterates it).
    """
    config, replicator = self._config, self._replicator
    if not (config.multi_client and isinstance(dataset, tf.data.Dataset)):
      return None
    shards = _weak.attached(dataset, "_replicator_global_shard") if keep else {}  # goes with the dataset
    if replicator in shards:  # (None: read whole; the policy is read once an epoch, 34 us)
      return shards[replicator]
    shard = None
    if _process_shards.policy(dataset) in _process_shards.SHARDED:
      pipelines = [replicator.input_pipeline(r) for r in range(replicator.num_replicas)]
      own = [pipelines[r] for r in config.local_replicas]
      shard = _process_shards.PaddedShard(dataset, _process_shards.by_process(replicator.devices, pipelines), own,
                                          max(pipelines) + 1, config.agree)
    shards[replicator] = shard
    return shard

  def _run_shard(self, step_fn: Callable, dataset, shard: _process_shards.PaddedShard, steps: int, all_steps: bool):
    """Up to ``steps`` steps on this process's shard; every process's steps agree on the end of the input."""
    step = self.step_for(step_fn, shard.dataset.element_spec)
    if steps > 1 and step.accumulating:
      raise _errors.ArgumentError(_errors.ACCUMULATING_STEPS.format(steps=steps))
    flag = None if shard.agree is None else lambda has: shard.agree.job_flag(has, any_=False)
    result = self._state.execute(
        step, lambda stop: step.run_steps(shard.iterator, None, steps, all_steps, stop, job_flag=flag), loop=True)
    if self._state.steps_run == 0:  # a shard has ended: the epoch ends in every process (the next call: another)
      _weak.attached(dataset, "_replicator_global_shard").pop(self._replicator, None)
      raise _errors.EndOfInput(_errors.END_OF_DATASET)
    return result

  def run_in_function(self, step_fn: Callable, inputs):
    """One step of ``step_fn`` called from the ``tf.function`` being traced (``_in_function``)."""
    element = global_batch(self._replicator, inputs)
    flat = tree.flatten(element)
    if not all(t.shape.is_fully_defined() for t in flat):
      raise _errors.ArgumentError(_in_function.NOT_STATIC.format(
          spec=tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), element)))
    step = self.step_for(step_fn, element)
    if step.accumulating:
      raise _errors.UnsupportedError(_in_function.ACCUMULATING)
    self._state.check_replicas_agree()
    return step(flat)

  def explain(self, step_fn: Callable, dataset, inputs) -> rewrite.PartitionReport:
    """The partition report of the step for the dataset's global batches (a fresh iterator: run's is untouched)."""
    del inputs  # (the global view explains a dataset's step)
    if not isinstance(dataset, tf.data.Dataset):
      raise _errors.ArgumentError(_global_step.NOT_DATASET.format(what=type(dataset).__name__,
                                                                  axes=self._replicator.batch_axes))
    if self._config.multi_client and _process_shards.policy(dataset) in _process_shards.SHARDED:
      # Read in shards: the step of its global batches' shape, from the spec (a shard hint cannot be read unsharded).
      step = self.step_for(step_fn, dataset.element_spec)
    else:
      step = self.step_for(step_fn, next(iter(dataset)))
    if step.report.memory_report is None:
      step.report.memory_report = _memory.later(step, self._replicator, self._config, "global")
    return step.report

  def memory(self, step_fn: Callable, dataset, inputs):
    """The memory report of the step for the dataset's global batches (``rewrite.MemoryReport``)."""
    return self.explain(step_fn, dataset, inputs).memory

  def step_for(self, step_fn: Callable, element) -> _global_step.GlobalStep:
    """The global-view step of ``step_fn`` for global batches shaped like ``element`` (built once).

    Traced at static global shapes: the element's own (a partial last batch is
    a new trace); and, as in the local view, one variant per combination of
    accumulation phases of the wrapped optimizers it uses.
    """
    specs = tree.map_structure(lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype), element)
    variants = self.steps.setdefault(step_fn, {}).setdefault(str(specs), {})
    return self._state.variant(variants, lambda: _global_step.build(
        self._replicator, self._config, self._layouts, self._creator, self._owner_load, step_fn, specs,
        stages=self._stages))

  def restore_failed(self) -> None:
    """Writes back the values every built step kept before its last call (a failure in a caller's function)."""
    for by_spec in self.steps.values():
      for variants in by_spec.values():
        for variant in variants.values():
          if variant.snapshot is not None:
            variant.snapshot.restore()


def _next_batch(replicator, dataset, inputs, steps: int):
  """The next global batch of ``dataset`` and its iterator (kept on the dataset, and going with it)."""
  if inputs is not None:
    what = "dataset" if isinstance(dataset, tf.data.Dataset) else type(dataset).__name__
    article = "an" if what[:1].lower() in "aeiou" else "a"
    raise _errors.ArgumentError(TWO_SOURCES.format(what=what, found=f"{article} {what}"))
  if not isinstance(dataset, tf.data.Dataset):
    raise _errors.ArgumentError(_global_step.NOT_DATASET.format(what=type(dataset).__name__,
                                                                axes=replicator.batch_axes))
  if steps > 1 and not all(s.shape.is_fully_defined() for s in tree.flatten(dataset.element_spec)):
    raise _errors.ArgumentError(STEPS_NOT_STATIC.format(steps=steps, spec=dataset.element_spec))
  iterators = _weak.attached(dataset, "_replicator_global_iterator")  # goes with the dataset
  iterator = iterators.get(replicator)
  if iterator is None:
    iterator = iterators[replicator] = iter(dataset)
  try:
    return next(iterator), iterator
  except StopIteration:
    del iterators[replicator]
    raise _errors.EndOfInput(_errors.END_OF_DATASET) from None


def global_batch(replicator, inputs):
  """The global batch ``inputs`` stands for: itself, or a ``PerReplica``'s parts (one per input pipeline) joined.

  A ``PerReplica`` is what iterating ``repl.distribute_dataset(...)`` gives:
  each replica's part of a global batch, the replicas of one input pipeline
  sharing theirs. The global view takes the batch whole and splits it itself.
  """
  parts = _values.split(inputs, replicator.num_replicas)
  if parts is None:
    return tree.map_structure(tf.convert_to_tensor, inputs)
  if len(parts) != replicator.num_replicas:
    raise _errors.InputMismatchError(f"inputs= has {len(parts)} values per replica, but this Replicator has "
                                     f"{replicator.num_replicas} replicas.")
  first = {}
  for replica, part in enumerate(parts):
    first.setdefault(replicator.input_pipeline(replica), part)
  ordered = [first[p] for p in sorted(first)]
  return tree.map_structure(lambda *leaves: tf.concat([tf.convert_to_tensor(x) for x in leaves], axis=0), *ordered)
