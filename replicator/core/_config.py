"""A Replicator's configuration: one immutable object, made once and passed to what builds and runs steps.

The Replicator checks its arguments and makes a :class:`Config`; the modules
below it (a view's step building, the step's lowering, all or nothing) take
the parts they need from it, never from the Replicator's attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import rewrite


@dataclasses.dataclass(frozen=True)
class Config:
  """How a Replicator builds and runs its steps (see ``Replicator``'s arguments).

  Attributes:
    mesh: the devices and their named axes.
    view: ``"local"`` or ``"global"``.
    strict: refuse fallbacks (global view) and layout keys that match nothing.
    atomic: a failed call writes no variable.
    update: the global view's optimizer update (``"auto"``, ``"sharded"``, ``"replicated"``).
    batch_axes: the mesh axes the batch is split over, or None (none given, and no axis named so).
    autograph: convert steps with AutoGraph.
    implementation: the collectives' lowering by name, or ``"auto"``.
    prefetch_to_device: input elements prefetched onto each device.
    drop_remainder: drop a last batch that does not divide over the replicas.
    host: the host's CPU: input pipelines are built and results combined there.
    lowerings: this Replicator's own lowering instances by name (a multi-worker
      Replicator's carry its collective timeout); others come from the registry.
    input_hosts: the device each input pipeline's dataset is built and
      iterated on, by pipeline (a multi-worker Replicator's: each pipeline's
      worker's CPU); empty: ``host`` for every pipeline.
    replicas: the replicas this process runs, by id (a multi-client job's
      process: its own devices'); empty: every replica.
    agree: in a multi-client job, ``agree(value)`` returns worker 0's
      ``value`` in every process (variables' initial values); None: one process.
    workers: the cluster's worker addresses by task (a multi-worker
      Replicator's), which name a failing device's worker; empty: none.
    input_layouts: the global view's layouts of a step's inputs beyond the
      batch split: a ``mesh.Layout`` spec for every input of its rank, or a
      function ``(index, tf.TensorSpec) -> spec or None``; None: the batch
      split alone.
    context_parallel: how the global view's Keras attention over a split
      sequence exchanges it: ``"all_gather"`` (keys and values), ``"ring"``
      (keys and values passed around a ring of permutes) or
      ``"ulysses"`` (queries, keys and values all-to-all from tokens to heads).
  """

  mesh: Any
  view: str
  strict: bool
  atomic: bool
  update: str
  batch_axes: tuple[str, ...] | None
  autograph: bool
  implementation: str
  prefetch_to_device: int
  drop_remainder: bool
  host: str = "/device:CPU:0"
  lowerings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  input_hosts: tuple[str, ...] = ()
  replicas: tuple[int, ...] = ()
  agree: Any = None
  workers: tuple[str, ...] = ()
  input_layouts: Any = None
  context_parallel: str = "all_gather"

  @property
  def local_replicas(self) -> tuple[int, ...]:
    """The replicas this process runs (every replica, unless it is one process of a multi-client job)."""
    return self.replicas or tuple(range(self.mesh.size))

  @property
  def multi_client(self) -> bool:
    """Whether other processes run some of the replicas (one process of a multi-client job)."""
    return len(self.local_replicas) < self.mesh.size

  def lowering_for(self, collective) -> str:
    """The lowering (by name) of one matched collective: the one asked for, or the rewrite's choice."""
    if self.implementation != "auto":
      return self.implementation
    return rewrite.auto_lowering(collective)
