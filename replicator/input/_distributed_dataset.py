"""Datasets of global batches, split along the batch dimension across replicas."""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf
import tree

from replicator.core import _errors
from replicator.core import _tf_types
from replicator.core._values import PerReplica
from replicator.input import _inputs
from replicator.input import _process_shards

NO_BATCH_DIMENSION = (
    "distribute_dataset needs every element leaf to have a batch dimension (rank >= 1) to split "
    "across replicas, but found {spec}. Fix: batch the dataset (dataset.batch(global_batch_size)) "
    "before distributing it."
)


def split_sizes(batch: tf.Tensor, num_replicas: int) -> tf.Tensor:
  """Rows per replica for a global batch of ``batch`` rows: as even as possible.

  The first ``batch % n`` replicas get one extra row; with fewer rows than
  replicas, the last replicas get none (they still run the step, on an empty batch).

  Examples:
    >>> split_sizes(tf.constant(10), 4).numpy().tolist()
    [3, 3, 2, 2]
    >>> split_sizes(tf.constant(2), 4).numpy().tolist()
    [1, 1, 0, 0]
  """
  base = batch // num_replicas
  extra = tf.cast(tf.range(num_replicas, dtype=batch.dtype) < batch % num_replicas, batch.dtype)
  return base + extra


def _even_parts(shapes, num_replicas: int) -> bool:
  """Whether every leaf's batch dimension has the same static size, which ``num_replicas`` divides."""
  rows = {shape[0] if shape.rank else None for shape in shapes}
  return len(rows) == 1 and None not in rows and next(iter(rows)) % num_replicas == 0


def split(element: Any, num_replicas: int) -> list[Any]:
  """One global-batch nest -> a list of per-replica nests (split along axis 0).

  Batches of one static size that ``num_replicas`` divides are split into
  parts of static size (as the distributed dataset's ``element_spec`` says).
  """
  leaves = tree.flatten(element)
  if _even_parts([leaf.shape for leaf in leaves], num_replicas):
    parts = [tf.split(leaf, num_replicas, axis=0) for leaf in leaves]
  else:
    sizes = split_sizes(tf.shape(leaves[0], out_type=tf.int64)[0], num_replicas)
    parts = [tf.split(leaf, sizes, axis=0, num=num_replicas) for leaf in leaves]
  return [tree.unflatten_as(element, [p[r] for p in parts]) for r in range(num_replicas)]


def _replica_spec(spec: tf.TensorSpec, parts: int | None) -> tf.TensorSpec:
  """A part's spec: the batch dimension divided by ``parts``, or of unknown size (None)."""
  if spec.shape.rank is None or spec.shape.rank == 0:
    raise _errors.InputMismatchError(NO_BATCH_DIMENSION.format(spec=spec))
  rows = None if parts is None else spec.shape[0] // parts
  return tf.TensorSpec([rows] + spec.shape.as_list()[1:], spec.dtype)


class DistributedIterator(_tf_types.Iterator):
  """An iterator over a distributed dataset: each ``next`` is a ``PerReplica`` of the replicas' parts.

  Made by ``iter(repl.distribute_dataset(ds))``. From Python it ends with
  ``StopIteration``; inside a ``tf.function`` (passed as an argument or
  closed over) ``next(iterator)`` reads the next global batch when the
  function runs, split in the function's graph, and at the end of the
  dataset the function raises ``tf.errors.OutOfRangeError``, as
  ``tf.distribute``'s iterators do; ``get_next_as_optional()`` reads it
  without failing. AutoGraph stages ``for batch in iterator:`` as a loop.
  """

  def __init__(self, iterator, parts: tuple[int, ...], host_device: str, element_spec,
               num_parts: int | None = None):
    self._iterator = iterator  # a tf.data iterator over the global batches (or this process's shard's batches)
    self._parts_taken = parts  # which part of a batch each replica takes
    self._host = host_device
    self._element_spec = element_spec
    self._num_parts = max(parts) + 1 if num_parts is None else num_parts

  @property
  def element_spec(self):
    """The spec of one replica's part (its batch dimension unknown unless the batches split evenly)."""
    return self._element_spec

  def __iter__(self) -> DistributedIterator:
    return self

  def __next__(self) -> PerReplica:
    if not tf.executing_eagerly():  # (a Python loop over it, unrolled while tracing, is refused by tf.data)
      return self.get_next()  # OutOfRangeError at the end, when the function runs
    with tf.device(self._host):
      return self._parts(next(self._iterator))  # StopIteration at the end

  def get_next(self) -> PerReplica:
    """The next batch's parts; at the end of the dataset ``tf.errors.OutOfRangeError`` (as tf.distribute's)."""
    with tf.device(self._host):
      return self._parts(self._iterator.get_next())

  def get_next_as_optional(self) -> PerReplicaOptional:
    """The next batch's parts, if any: ``.has_value()`` (a bool tensor) and ``.get_value()``."""
    with tf.device(self._host):
      return PerReplicaOptional(self._iterator.get_next_as_optional(), self)

  def _parts(self, element) -> PerReplica:
    with tf.device(self._host):
      parts = split(element, self._num_parts)
    return PerReplica([parts[p] for p in self._parts_taken])

  # TensorFlow's nest protocol (public by duck type, TF 2.21's `CustomNestProtocol`): as a tf.function's argument
  # the iterator is its tf.data iterator (a resource), one trace for every iterator of the same dataset spec.
  def __tf_flatten__(self):
    return (self._parts_taken, self._host, self._element_spec, self._num_parts), (self._iterator,)

  @classmethod
  def __tf_unflatten__(cls, metadata, components):
    return cls(components[0], *metadata)


class PerReplicaOptional:
  """The next element of a :class:`DistributedIterator`, if there is one."""

  def __init__(self, optional, iterator: DistributedIterator):
    self._optional = optional
    self._iterator = iterator

  def has_value(self) -> tf.Tensor:
    """A bool tensor: whether there is a next batch."""
    return self._optional.has_value()

  def get_value(self) -> PerReplica:
    """The next batch's parts (fails at run time if there is none)."""
    return self._iterator._parts(self._optional.get_value())  # pylint: disable=protected-access


class DistributedDataset(_tf_types.Iterable):
  """A dataset of global batches whose every batch is split across the replicas.

  Made by ``repl.distribute_dataset(dataset)``. Pass it to ``repl.run(step_fn,
  distributed)`` (the split happens in the step's graph; each replica gets its
  rows), or iterate it to get per-replica inputs for ``repl.run(step_fn,
  inputs=...)``. A last batch smaller than the others (even smaller than the
  number of replicas) is split as evenly as possible; replicas without rows
  run the step on an empty batch, so nothing is dropped.

  On a mesh, each global batch is split into one part per input pipeline
  (position along the replicator's ``batch_axes``); devices that differ only
  along the other mesh axes get the same part.

  In one process of a multi-client job, every process reads the global
  batches and keeps its own replicas' parts; or, if the dataset's options
  ask for it (``auto_shard_policy`` ``FILE`` or ``HINT``), reads its own
  shard of the dataset in batches of its share of the global batch, split
  over its own replicas (``_process_shards``).

  Attributes:
    num_replicas: how many replicas take a part (in this process).
    pipelines: for each of those replicas, which part of the global batch it takes.
    num_pipelines: how many parts each global batch is split into.
    host_device: where the global batches are read and split.
    shard: ``(shards, index)``: this process reads shard ``index`` of ``shards``
      (batches of its own rows only); None: every global batch.
    source: the dataset of global batches given (the global view partitions it).
  """

  def __init__(self, dataset: tf.data.Dataset, pipelines, host_device: str, prefetch: int = 2,
               num_pipelines: int | None = None, shard: tuple[int, int] | None = None, agree=None):
    if not isinstance(dataset, tf.data.Dataset):
      raise _errors.ArgumentTypeError(f"distribute_dataset needs a tf.data.Dataset of global batches, found {type(dataset).__name__}.")
    self.pipelines = tuple(range(pipelines)) if isinstance(pipelines, int) else tuple(pipelines)
    self.num_replicas = len(self.pipelines)
    self.num_pipelines = max(self.pipelines) + 1 if num_pipelines is None else num_pipelines
    self.host_device = host_device
    for leaf in tree.flatten(dataset.element_spec):
      if not isinstance(leaf, tf.TensorSpec):
        raise _errors.InputMismatchError(
            f"distribute_dataset feeds dense tensors only, found {type(leaf).__name__}.")
    self.shard = shard
    self.source = dataset  # the dataset of global batches given
    self.agree = None  # with a shard: the agreement on the end repl.run's steps make (the shards may end apart)
    if shard is None:  # every global batch, split into one part a pipeline
      self.num_parts, self.parts = self.num_pipelines, self.pipelines
    else:  # this process's batches, split into one part for each of its pipelines
      mine, self.parts = _inputs.own_pipelines(self.pipelines)
      self.num_parts = len(mine)
      dataset = _process_shards.process_dataset(dataset, *shard, parts=self.num_pipelines, own=mine)
      self.agree = _process_shards.end_agreement(self.source, agree)  # (after what may refuse the dataset)
    self._dataset = _inputs.without_autotune_thread(dataset.prefetch(prefetch))
    flat = tree.flatten(dataset.element_spec)
    parts = self.num_parts if _even_parts([leaf.shape for leaf in flat], self.num_parts) else None
    self.element_spec = tree.map_structure(lambda spec: _replica_spec(spec, parts), dataset.element_spec)

  @property
  def dataset(self) -> tf.data.Dataset:
    """The dataset of global batches (with ``shard``: of this process's batches)."""
    return self._dataset

  def __iter__(self) -> DistributedIterator:
    """An iterator giving a ``PerReplica`` of per-replica batches for each global batch (Python or tf.function)."""
    with tf.device(self.host_device):
      return DistributedIterator(iter(self._dataset), self.parts, self.host_device, self.element_spec,
                                 self.num_parts)

  def reduce(self, initial_state, reduce_fn):
    """``reduce_fn(state, batch)`` over every batch, in a ``tf.while_loop``: how AutoGraph stages a ``for`` loop.

    ``for batch in dist:`` in a ``tf.function`` becomes this call (as for a
    ``tf.distribute`` distributed dataset); ``state`` holds the loop's variables.
    """
    iterator = iter(self)
    with tf.device(self.host_device):
      optional = iterator._iterator.get_next_as_optional()  # pylint: disable=protected-access

    def cond(optional, state):
      del state
      return optional.has_value()

    def body(optional, state):
      state = reduce_fn(state, iterator._parts(optional.get_value()))  # pylint: disable=protected-access
      with tf.device(self.host_device):
        optional = iterator._iterator.get_next_as_optional()  # pylint: disable=protected-access
      return optional, state

    _, state = tf.while_loop(cond, body, (optional, initial_state), parallel_iterations=1)
    return state


class GlobalBatchInputs(_inputs.Source):
  """In-graph source for ``repl.run(step_fn, distributed_dataset)``: one iterator, split per step."""

  stateful = True

  def __init__(self, distributed: DistributedDataset):
    self.distributed = weakref.ref(distributed)
    self.key = ("dataset", tuple(tree.flatten(distributed.element_spec)), str(distributed.element_spec))
    self._n = distributed.num_parts
    self.pipelines = distributed.pipelines
    self._mine, self.slots = _inputs.own_pipelines(distributed.parts)  # the parts this process's replicas take
    self._agree = distributed.agree  # this process reads its own shard: the job agrees on the end
    # Batches of rows of static shapes: a process whose shard has ended runs its replicas on empty batches.
    self._pads = self._agree is not None and all(spec.shape[1:].is_fully_defined()
                                                 for spec in tree.flatten(distributed.element_spec))
    self._host = distributed.host_device
    with tf.device(self._host):
      self._iterator = iter(distributed.dataset)
    n = len(self._mine)
    self.structures = (distributed.element_spec,) * n
    flat = tree.flatten(distributed.element_spec)
    self.counts = (len(flat),) * n
    self.element_specs = tuple(flat) * n
    if self._pads:  # (an empty batch has no rows: the step takes batches of any size)
      self.element_specs = tuple(tf.TensorSpec([None] + spec.shape[1:].as_list(), spec.dtype)
                                 for spec in self.element_specs)

  def end_message(self) -> str:
    return _errors.END_OF_DATASET  # a dataset of global batches, not an input_fn

  def _split_flat(self, element):
    parts = split(element, self._n)
    return [t for p in self._mine for t in tree.flatten(parts[p])]

  @property
  def fetches_plainly(self) -> bool:
    return self._agree is None  # every process reads the same batches: their ends come at the same step

  def fetch(self, flat_args):
    with tf.device(self._host):
      return self._split_flat(self._iterator.get_next())

  def fetch_optional(self, flat_args):
    host = self._host
    with tf.device(host):
      optional = self._iterator.get_next_as_optional()
    has_value = optional.has_value()
    if self._agree is not None:  # this process's shard may end before or after the others'
      has_value = self._agree.job_flag(has_value, any_=self._pads)

    def get():
      with tf.device(host):
        if not self._pads:
          return self._split_flat(optional.get_value())
        specs = [spec for _ in self._mine for spec in tree.flatten(self.structures[0])]
        return tf.cond(optional.has_value(), lambda: self._split_flat(optional.get_value()),
                       lambda: [_inputs.empty(spec) for spec in specs])

    return has_value, get
