"""Per-replica inputs: datasets from ``input_fn`` and explicit ``inputs=``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
import tree

from replicator import _errors
from replicator import _values

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
WRONG_INPUT_COUNT = (
    "inputs= needs one value per replica ({n} replicas), but found {found}. Fix: "
    "pass replicator.PerReplica([value_for_replica_0, ..., value_for_replica_{last}])."
)


@dataclasses.dataclass(frozen=True)
class InputContext:
  """What ``input_fn`` knows about the replica it builds input for.

  Attributes:
    replica_id: the replica whose dataset is being built.
    num_replicas: total number of replicas.
    input_pipeline_id: index of this input pipeline.
    num_input_pipelines: total number of input pipelines.
  """

  replica_id: int
  num_replicas: int
  input_pipeline_id: int = 0
  num_input_pipelines: int = 1

  def get_per_replica_batch_size(self, global_batch_size: int) -> int:
    """``global_batch_size // num_replicas``; an error if it does not divide evenly.

    >>> InputContext(replica_id=0, num_replicas=4).get_per_replica_batch_size(64)
    16
    """
    if global_batch_size % self.num_replicas:
      raise ValueError(
          f"The global batch size {global_batch_size} is not divisible by the number of "
          f"replicas {self.num_replicas}. Fix: use a global batch size that is a multiple "
          f"of {self.num_replicas}, e.g. {(global_batch_size // self.num_replicas + 1) * self.num_replicas}.")
    return global_batch_size // self.num_replicas


class Source:
  """Where a step's per-replica arguments come from."""

  key: Any = None
  arg_specs: tuple = ()

  def call_args(self) -> list[tf.Tensor]:
    """Flat tensors passed to the compiled step on each call."""
    return []

  def replica_args(self, replica: int, flat_args: Sequence[tf.Tensor]) -> tuple:  # pylint: disable=unused-argument
    """Positional arguments of ``step_fn`` for ``replica``, built inside the trace."""
    return ()


class NoInputs(Source):
  key = ("none",)


class ExplicitInputs(Source):
  """``inputs=PerReplica([...])``: one nest of tensors per replica, fed on every call."""

  def __init__(self, inputs, num_replicas: int):
    values = _values.split(inputs, num_replicas)
    values = inputs if values is None else values
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)) or len(values) != num_replicas:
      found = f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__
      raise _errors.InputMismatchError(WRONG_INPUT_COUNT.format(n=num_replicas, found=found, last=num_replicas - 1))
    self._structures = []
    self._flat = []
    self._counts = []
    for value in values:
      leaves = [tf.convert_to_tensor(v) for v in tree.flatten(value)]
      self._structures.append(value)
      self._flat.extend(leaves)
      self._counts.append(len(leaves))
    _check_same_specs([tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                          tree.unflatten_as(s, self._leaves_of(r)))
                       for r, s in enumerate(self._structures)], "inputs=", check_shapes=False)
    self.arg_specs = tuple(tf.TensorSpec(t.shape, t.dtype) for t in self._flat)
    self.key = ("explicit", tuple(tree.flatten(tree.map_structure(lambda _: 0, self._structures[0]))),
                self.arg_specs, str(tree.map_structure(lambda _: 0, self._structures[0])))

  def _leaves_of(self, replica: int, flat=None):
    flat = self._flat if flat is None else flat
    start = sum(self._counts[:replica])
    return list(flat[start:start + self._counts[replica]])

  def call_args(self):
    return self._flat

  def replica_args(self, replica, flat_args):
    return (tree.unflatten_as(self._structures[replica], self._leaves_of(replica, flat_args)),)


class DatasetInputs(Source):
  """``input_fn(ctx)`` datasets, one iterator per replica, created once."""

  def __init__(self, input_fn: Callable[[InputContext], tf.data.Dataset], devices: Sequence[str],
               host_device: str):
    self.key = ("input_fn", input_fn)
    self._host = host_device
    datasets = []
    for replica in range(len(devices)):
      ds = input_fn(InputContext(replica_id=replica, num_replicas=len(devices),
                                 input_pipeline_id=replica, num_input_pipelines=len(devices)))
      if not isinstance(ds, tf.data.Dataset):
        raise _errors.InputMismatchError(NOT_A_DATASET.format(replica=replica, found=_describe(ds)))
      datasets.append(ds)
    _check_same_specs([ds.element_spec for ds in datasets], "input_fn's datasets", check_shapes=True)
    datasets = [_without_autotune_thread(ds) for ds in datasets]
    with tf.device(host_device):
      self._iterators = [iter(ds) for ds in datasets]
    self.element_spec = datasets[0].element_spec

  def replica_args(self, replica, flat_args):
    with tf.device(self._host):
      return (self._iterators[replica].get_next(),)


def _without_autotune_thread(ds: tf.data.Dataset) -> tf.data.Dataset:
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
