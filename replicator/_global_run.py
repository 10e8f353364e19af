"""The global view's run path: ``repl.run(step_fn, dataset)`` with ``view="global"``.

Takes the next global batch of the dataset (its iterator lives on the
dataset, and goes with it), finds or builds the step for its shapes
(``_global_view.build``, cached by step function, element shapes and
accumulation phases), refuses to start while a failed step has left
replicated copies different (``atomic=False``), and runs one step or a loop
of them in one call (interruptible between steps: ``_interrupt``).
"""

from __future__ import annotations

import tensorflow as tf
import tree

from replicator import _distributed_dataset
from replicator import _errors
from replicator import _global_view
from replicator import _interrupt
from replicator import _values
from replicator import _weak

ONE_BATCH = (
    "repl.run(step_fn, inputs=..., steps={steps}) in the global view: inputs= is one global batch, for one step. "
    "Fix: pass the dataset of global batches, repl.run(step_fn, dataset, steps={steps}), or call repl.run once a batch."
)
STEPS_NOT_STATIC = (
    "repl.run(steps={steps}) in the global view loops over global batches of one static shape, but the dataset's "
    "elements are {spec}. Fix: batch it with drop_remainder=True."
)


def run(replicator, config, step_fn, dataset, inputs, steps: int, all_steps: bool):
  """``steps`` steps of ``step_fn`` in the global view on the next global batches of ``dataset``."""
  # pylint: disable=protected-access  (the Replicator's own state, run on its behalf)
  if isinstance(dataset, _distributed_dataset.DistributedDataset):
    dataset = dataset.dataset  # its global batches: the partitioner splits them
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
    raise _errors.ArgumentError(f"repl.run(steps={steps!r}): steps must be a positive integer.")
  if inputs is not None and dataset is None:  # one global batch, given: one step
    if steps > 1 or all_steps:
      raise _errors.ArgumentError(ONE_BATCH.format(steps=steps))
    element, iterator = global_batch(replicator, inputs), None
  else:
    element, iterator = _next_batch(replicator, dataset, inputs, steps)
  step = step_for(replicator, config, step_fn, element)
  if steps > 1 and step.accumulating:
    raise _errors.ArgumentError(_errors.ACCUMULATING_STEPS.format(steps=steps))
  replicator._check_replicas_agree()
  try:
    if steps == 1 and not all_steps:
      results, replicator.steps_run = step(tree.flatten(element)), 1
    else:
      results, replicator.steps_run = replicator._stop.run(
          lambda: step.run_steps(iterator, element, steps, all_steps, replicator._stop))
  except _interrupt.Interrupted as e:  # Ctrl-C: the steps run so far are kept and counted
    replicator.steps_run = e.result[1]
    raise
  except _errors.ReplicasDivergedError as e:  # Replicator(atomic=False)
    replicator._diverged = (step.written, str(e.__cause__ and _errors.root_cause(e.__cause__.message)))
    raise
  for optimizer in step.accumulating:
    optimizer.advance(replicator.steps_run)
  return results


def _next_batch(replicator, dataset, inputs, steps: int):
  """The next global batch of ``dataset`` and its iterator (kept on the dataset, and going with it)."""
  if inputs is not None or not isinstance(dataset, tf.data.Dataset):
    what = "inputs=..." if inputs is not None else type(dataset).__name__
    raise _errors.ArgumentError(_global_view.NOT_DATASET.format(what=what, axes=replicator.batch_axes))
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


def step_for(replicator, config, step_fn, element) -> _global_view.GlobalStep:
  """The global-view step of ``step_fn`` for global batches shaped like ``element`` (built once).

  Traced at static global shapes: the element's own (a partial last batch is
  a new trace); and, as in the local view, one variant per combination of
  accumulation phases of the wrapped optimizers it uses.
  """
  # pylint: disable=protected-access
  specs = tree.map_structure(lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype), element)
  variants = replicator._global_steps.setdefault(step_fn, {}).setdefault(str(specs), {})
  return replicator._variant(variants, lambda: _global_view.build(replicator, config, step_fn, specs,
                                                                            replicator._choose))
