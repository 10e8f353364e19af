"""Keras's data with batches of unknown size, given to its step one concrete batch at a time.

Keras 3's TensorFlow trainer iterates a ``tf.data`` dataset inside its own
``tf.function``, so a dataset batched without ``drop_remainder`` (or arrays
whose rows ``batch_size`` does not divide: Keras's array adapter then adds a
short last batch) reaches the step with a batch dimension of unknown size.
The global view partitions a step traced at static global shapes; a batch of
unknown size can only be taken whole by every device, which would give up
data parallelism for every batch, not just the short one.

Keras on JAX iterates in Python and traces each concrete batch shape; this
does the same for Keras's steps. ``KerasStrategy``'s
``experimental_distribute_dataset`` (which Keras's epoch iterator calls for
its dataset) returns :class:`ConcreteBatches` for such a dataset: a Python
iterable of its eager batches. Keras's trainer calls its step function on each
batch (its path for Python iterables), so the step is traced at the batch's
shape: full batches at their static size, split over the batch axes; the
short last batch in the retrace TensorFlow relaxes to an unknown size
(``reduce_retracing``), taken whole by every device, once per epoch. Random
ops (Dropout) then draw as on one device in both.

Keras's loop calls its function once per ``steps_per_execution`` batches,
and the function steps through the iterator in a Python loop. The data's end
met at the start of a call is raised as ``tf.errors.OutOfRangeError``, as
Keras's in-graph iterator raises it (Keras's epoch iterator turns it into the
end of the epoch); met after some steps of a call, it ends that call's loop
(``StopIteration``), which returns those steps' results, as Keras's in-graph
loop returns a partial group's. Which call is which is told by
:meth:`Iterator.begin_call` (``_keras`` wraps Keras's function to say so).
"""

from __future__ import annotations

import tensorflow as tf
import tree


def static(element_spec) -> bool:
  """Whether every tensor of a dataset's elements has a fully defined shape (absent parts aside)."""
  specs = [spec for spec in tree.flatten(element_spec) if spec is not None]
  return all(isinstance(spec, tf.TensorSpec) and spec.shape.is_fully_defined() for spec in specs)


class ConcreteBatches:
  """A dataset whose batches Keras's trainer is given one at a time from Python, at their concrete shapes."""

  def __init__(self, dataset: tf.data.Dataset):
    self._dataset = dataset

  @property
  def element_spec(self):
    return self._dataset.element_spec

  def __iter__(self) -> "Iterator":
    return Iterator(iter(self._dataset))


class Iterator:
  """Eager batches; the data's end raised as Keras's loop expects it (see the module docstring)."""

  def __init__(self, iterator):
    self._iterator = iterator
    self._given = 0  # batches given since the current call of Keras's function began

  def begin_call(self) -> None:
    self._given = 0

  def __iter__(self) -> "Iterator":
    return self

  def __next__(self):
    try:
      batch = next(self._iterator)
    except StopIteration:
      if self._given:
        raise  # ends the call's loop after the steps it ran
      raise tf.errors.OutOfRangeError(None, None, "End of sequence") from None
    self._given += 1
    return batch
