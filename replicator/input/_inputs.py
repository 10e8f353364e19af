"""Per-replica inputs: datasets from ``input_fn`` and explicit ``inputs=``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
import tree

from replicator.core import _errors
from replicator.core import _values

NOT_A_DATASET = (
    "input_fn must return a tf.data.Dataset, but for replica {replica} it returned "
    "{found}. Fix: build the replica's data as a dataset, e.g. "
    "tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_replicas, ctx.replica_id)"
    ".batch(per_replica_batch)."
)
SPEC_MISMATCH = (
    "{source} gives per-replica elements that differ between replicas {a} and {b} "
    "({what}):\n  replica {a}: {spec_a}\n  replica {b}: {spec_b}\n"
    "Every replica runs the same step_fn, so every replica's dataset must yield "
    "elements of the same structure and dtypes (shapes may differ only where they "
    "are unknown). Fix: build every replica's dataset with the same pipeline, "
    "varying only which data it reads."
)
UNEVEN_END = (
    " If the replicas' datasets had different lengths, the elements left on the longer ones were "
    "not used: {spec} is not a batch of rows of a static shape, so a replica that ran out cannot "
    "run the step on an empty batch. Fix: batch the dataset (with rows of a static shape) to use "
    "every row, or pass Replicator(drop_remainder=True) to say that dropping them is intended."
)
WRONG_INPUT_COUNT = (
    "inputs= needs one value per replica ({n} replicas), but found {found}. Fix: "
    "pass replicator.PerReplica([value_for_replica_0, ..., value_for_replica_{last}])."
)


@dataclasses.dataclass(frozen=True)
class InputContext:
  """What ``input_fn`` knows about the replica it builds input for.

  On a mesh, a "replica" here is a data-parallel replica: one position along
  the batch axes (an input pipeline), whose elements every device that
  differs only along the other axes receives.

  Attributes:
    replica_id: the replica whose dataset is being built.
    num_replicas: total number of (data-parallel) replicas.
    input_pipeline_id: index of this input pipeline.
    num_input_pipelines: total number of input pipelines.
  """

  replica_id: int
  num_replicas: int
  input_pipeline_id: int = 0
  num_input_pipelines: int = 1

  def get_per_replica_batch_size(self, global_batch_size: int) -> int:
    """``global_batch_size // num_replicas``; an error if it does not divide evenly.

    Examples:
      >>> InputContext(replica_id=0, num_replicas=4).get_per_replica_batch_size(64)
      16
    """
    if global_batch_size % self.num_replicas:
      raise _errors.ArgumentError(
          f"The global batch size {global_batch_size} is not divisible by the number of "
          f"replicas {self.num_replicas}. Fix: use a global batch size that is a multiple "
          f"of {self.num_replicas}, e.g. {(global_batch_size // self.num_replicas + 1) * self.num_replicas}.")
    return global_batch_size // self.num_replicas


class Source:
  """Where a step's per-replica inputs come from.

  The traced step graph takes every input *slot*'s element as arguments
  (``element_specs``, slots concatenated); :meth:`fetch` produces them inside
  the executing function, once per step. A slot is one replica's input, or
  on a mesh one input pipeline's, shared by the replicas that ``slots`` maps
  to it.
  """

  key: Any = None
  stateful = False  # holds iterators: a new source means a new epoch
  # fetch() takes a step's elements with plain get_next (the end of the input fails the call, which then
  # ran nothing that stays: all or nothing); False: the elements exist only behind fetch_optional's check.
  fetches_plainly = False
  arg_specs: tuple = ()  # arguments of the executing function
  element_specs: tuple = ()  # flat step inputs, all replicas
  counts: tuple = ()  # flat inputs per replica
  structures: tuple = ()  # one nest per slot (leaves are replaced)
  slots: tuple | None = None  # which slot of inputs feeds each replica (None: its own)
  # Which input pipeline (job-wide id) feeds each replica this process runs; None: the slots say.
  pipelines: tuple | None = None

  def call_args(self) -> list[tf.Tensor]:
    """Flat tensors passed to the executing function on each call."""
    return []

  def end_note(self) -> str:
    """What to add to the end-of-input message (how uneven input was handled)."""
    return ""

  def end_message(self) -> str:
    """The end-of-input message: the input ran out."""
    return _errors.END_OF_INPUT + self.end_note()

  def varying_axes(self, mesh) -> frozenset[str]:
    """The mesh axes along which replicas get different inputs (replicas of one slot share theirs)."""
    feeds = next(f for f in (self.pipelines, self.slots, tuple(range(mesh.size))) if f is not None)
    if len(feeds) != mesh.size:  # one process of a multi-client job: the others' inputs are unknown here
      return frozenset(a for a in mesh.axis_names if mesh.shape[a] > 1)
    return frozenset(a for a in mesh.axis_names
                     if any(len({feeds[r] for r in group}) > 1 for group in mesh.groups(a)))

  def step_args(self, replica: int, flat_elements: Sequence[tf.Tensor]) -> tuple:
    """Positional arguments of ``step_fn`` for ``replica``, inside the trace."""
    if not self.counts:
      return ()
    slot = replica if self.slots is None else self.slots[replica]
    start = sum(self.counts[:slot])
    leaves = list(flat_elements[start:start + self.counts[slot]])
    return (tree.unflatten_as(self.structures[slot], leaves),)

  def fetch(self, flat_args: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """The flat step inputs of one step (graph code, in the executing function)."""
    return list(flat_args)

  def fetch_optional(self, flat_args: Sequence[tf.Tensor]):
    """``(has_value, get)``: whether another step's inputs exist, and a function returning them."""
    return tf.constant(True), lambda: self.fetch(flat_args)


class NoInputs(Source):
  key = ("none",)


NOT_A_TENSOR = (
    "repl.run(step_fn, inputs=...): replica {replica}'s input at {path} is {found}, which is not a tensor nor a "
    "value TensorFlow converts to one (numbers, NumPy arrays). Fix: give every replica a tensor there (a "
    "PerReplica of one tensor a replica), or leave that part out of inputs=."
)


def _input_tensor(value, path, replica: int) -> tf.Tensor:
  try:
    return tf.convert_to_tensor(value)
  except (TypeError, ValueError):
    where = "/".join(str(p) for p in path) or "its top level"
    found = "None" if value is None else f"a value of type {type(value).__name__}"
    raise _errors.ArgumentTypeError(NOT_A_TENSOR.format(replica=replica, path=where, found=found)) from None


class ExplicitInputs(Source):
  """``inputs=``: one nest of tensors per replica, fed on every call.

  A ``PerReplica`` (or a nest with ``PerReplica`` leaves) gives each replica
  its own value; any other value is given to every replica, as
  ``strategy.run(fn, args=...)`` does.
  """

  def __init__(self, inputs, num_replicas: int):
    values = _values.split(inputs, num_replicas)
    if values is None:  # one value, for every replica
      values = [inputs]
      self.slots = (0,) * num_replicas
    elif len(values) != num_replicas:
      raise _errors.InputMismatchError(WRONG_INPUT_COUNT.format(
          n=num_replicas, found=f"{len(values)} values", last=num_replicas - 1))
    self._flat = []
    counts = []
    for replica, value in enumerate(values):
      leaves = [_input_tensor(v, path, replica) for path, v in tree.flatten_with_path(value)]
      self._flat.extend(leaves)
      counts.append(len(leaves))
    self.structures = tuple(values)
    self.counts = tuple(counts)
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in self._flat]
    _check_same_specs([self.step_args(r, specs)[0] for r in range(len(values))], "inputs=", check_shapes=False)
    self.arg_specs = self.element_specs = tuple(specs)
    self.key = ("explicit", self.arg_specs, str(tree.map_structure(lambda _: 0, values[0])))

  def call_args(self):
    return self._flat


class DatasetInputs(Source):
  """``input_fn(ctx)`` datasets, one iterator per input pipeline, created once per epoch.

  Without a mesh every replica is its own pipeline. On a mesh, ``pipelines``
  maps each replica to its position along the batch axes; ``input_fn`` is
  called once per pipeline, and the replicas of a pipeline share its
  elements.

  With ``prefetch_to_device > 0`` each pipeline's iterator lives on its first
  replica's device and prefetches that many elements onto it, so the step
  does not wait for host-to-device copies; otherwise iterators live on the
  host CPU.
  """

  stateful = True
  pads_with_empty_batches = False

  def __init__(self, input_fn: Callable[[InputContext], tf.data.Dataset], devices: Sequence[str],
               host_device: str | Sequence[str], prefetch_to_device: int = 0,
               pipelines: Sequence[int] | None = None, drop_remainder: bool = False,
               replicas: Sequence[int] | None = None, agree=None):
    """``devices`` and ``pipelines``: every replica's; ``replicas``: the ones this process runs (default: all).

    ``agree``: in a multi-client job, the ``_collective_runtime.Agreement`` by
    which every process's steps see the end of the input at the same step
    (each process's pipelines may end at different steps); None: one process.
    """
    self._drop_remainder = drop_remainder
    self._agree = agree
    pipelines = tuple(range(len(devices)) if pipelines is None else pipelines)
    replicas = tuple(range(len(pipelines)) if replicas is None else replicas)
    n = max(pipelines) + 1
    self.pipelines = tuple(pipelines[r] for r in replicas)
    mine, self.slots = own_pipelines(self.pipelines)
    self._devices = tuple(devices[pipelines.index(p)] for p in mine)
    # One host per pipeline: where its dataset is built and iterated (a
    # worker's own CPU in a multi-worker run, so data never passes the client).
    hosts = (host_device,) * n if isinstance(host_device, str) else tuple(host_device)
    hosts = tuple(hosts[p] for p in mine)
    datasets = []
    for pipeline, host in zip(mine, hosts):
      with tf.device(host):
        ds = input_fn(InputContext(replica_id=pipeline, num_replicas=n,
                                   input_pipeline_id=pipeline, num_input_pipelines=n))
      if not isinstance(ds, tf.data.Dataset):
        raise _errors.InputMismatchError(NOT_A_DATASET.format(replica=pipeline, found=_describe(ds)))
      datasets.append(ds)
    _check_same_specs([ds.element_spec for ds in datasets], "input_fn's datasets", check_shapes=True)
    if agree is not None:  # no agreement a step if no process's input can end (every dataset repeated forever)
      finite = any(int(ds.cardinality()) != int(tf.data.INFINITE_CARDINALITY) for ds in datasets)
      self._agree = agree if agree.any(finite, "input may end") else None
    for leaf in tree.flatten(datasets[0].element_spec):
      if not isinstance(leaf, tf.TensorSpec):
        raise _errors.InputMismatchError(
            f"input_fn's datasets yield a {type(leaf).__name__}; the replicator feeds dense tensors only. "
            "Fix: convert it in the pipeline (e.g. .map(lambda x: x.to_tensor()) for ragged tensors).")
    self.structures = tuple(ds.element_spec for ds in datasets)
    if not prefetch_to_device:
      self._devices = hosts
    self._iterators = []
    for ds, host, device in zip(datasets, hosts, self._devices):
      with tf.device(host):  # dataset ops run where the dataset lives
        ds = without_autotune_thread(ds)  # also the device copy's inner iterator over it
        if prefetch_to_device:
          ds = without_autotune_thread(ds.apply(tf.data.experimental.prefetch_to_device(device, prefetch_to_device)))
      with tf.device(device):
        self._iterators.append(iter(ds))
    self.counts = tuple(len(tree.flatten(s)) for s in self.structures)
    self.element_specs = tuple(spec for s in self.structures for spec in tree.flatten(s))
    # Steps are keyed by what they are traced for, not by the function: a new
    # input_fn (a fresh evaluation set each epoch) reuses the step.
    self.key = ("input_fn", self.element_specs, str(self.structures[0]), pipelines, drop_remainder)
    # Elements that are not batches of rows of a static shape cannot be padded
    # with an empty batch: such an epoch ends when the first dataset does.
    self.pads_with_empty_batches = not drop_remainder and all(
        spec.shape.rank and spec.shape[1:].is_fully_defined() for spec in tree.flatten(self.structures[0]))

  @property
  def fetches_plainly(self) -> bool:
    # An uneven end runs steps on empty batches, and other processes' inputs may end first: both need the check.
    return not self.pads_with_empty_batches and self._agree is None

  def fetch(self, flat_args):
    values = []
    for it, device in zip(self._iterators, self._devices):
      with tf.device(device):
        values.extend(tree.flatten(it.get_next()))
    return values

  def end_note(self) -> str:
    if self.pads_with_empty_batches or self._drop_remainder or len(self._iterators) < 2:
      return ""
    spec = next(s for s in tree.flatten(self.structures[0])
                if not (s.shape.rank and s.shape[1:].is_fully_defined()))
    return UNEVEN_END.format(spec=spec)

  def fetch_optional(self, flat_args):
    optionals = []
    for it, device in zip(self._iterators, self._devices):
      with tf.device(device):
        optionals.append(it.get_next_as_optional())
    has = tf.stack([o.has_value() for o in optionals])
    # Uneven input: until every pipeline has run out, one that has runs the
    # step on an empty batch (as tf.distribute does), so no row is dropped.
    has_value = tf.reduce_any(has) if self.pads_with_empty_batches else tf.reduce_all(has)
    if self._agree is not None:  # and across processes: every process's step ends at the same step
      has_value = self._agree.job_flag(has_value, any_=self.pads_with_empty_batches)

    def get():
      values = []
      for o, structure, device in zip(optionals, self.structures, self._devices):
        with tf.device(device):
          specs = tree.flatten(structure)
          if not self.pads_with_empty_batches:
            values.extend(tree.flatten(o.get_value()))
          else:
            values.extend(tf.cond(o.has_value(), lambda o=o: tree.flatten(o.get_value()),
                                  lambda specs=specs: [empty(spec) for spec in specs]))
      return values

    return has_value, get


def own_pipelines(pipelines) -> tuple[list[int], tuple[int, ...]]:
  """For the pipeline of each replica a process runs: its pipelines (in order of first use), each replica's slot."""
  mine = list(dict.fromkeys(pipelines))
  return mine, tuple(mine.index(p) for p in pipelines)


def empty(spec: tf.TensorSpec) -> tf.Tensor:
  """An empty batch (no rows) of elements of ``spec``."""
  return tf.zeros([0] + spec.shape[1:].as_list(), spec.dtype)


def without_autotune_thread(ds: tf.data.Dataset) -> tf.data.Dataset:
  """Turns off tf.data autotuning unless the user set it explicitly.

  On TF 2.21 (checked with 2.21.0, 2-core CPU), destroying one of many
  autotuned iterators whose elements feed several logical devices can hang
  forever: the iterator's destructor waits for its autotuning thread, which
  never wakes (seen with 36 iterators over 1-8 devices; 3 of 3 runs hung at
  exit, 0 of 3 with autotuning off). Without autotuning, AUTOTUNE
  parallelism falls back to the number of cores. A dataset whose options set
  ``autotune.enabled`` explicitly is left as it is.
  """
  if ds.options().autotune.enabled is not None:
    return ds
  options = tf.data.Options()
  options.autotune.enabled = False
  return ds.with_options(options)


def _describe(value) -> str:
  return f"a {type(value).__module__}.{type(value).__qualname__}"


def _check_same_specs(specs: Sequence[Any], what: str, check_shapes: bool) -> None:
  mismatch = _values.first_mismatch(specs, check_shapes=check_shapes)
  if mismatch is not None:
    r, difference = mismatch
    raise _errors.InputMismatchError(SPEC_MISMATCH.format(
        source=what, a=0, b=r, what=difference, spec_a=specs[0], spec_b=specs[r]))
