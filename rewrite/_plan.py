"""The plan pass: match placeholders across replicas, check them, choose lowerings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

import mesh as mesh_lib
from rewrite import _errors
from rewrite._placeholders import Placeholder
from rewrite._placeholders import shape_str


@dataclasses.dataclass(frozen=True)
class Collective:
  """A matched group of placeholders: one collective of the step.

  Attributes:
    index: position in call order.
    kind: one of ``rewrite.KINDS`` ("all_reduce", "broadcast", "all_gather",
      "reduce_scatter", "all_to_all", "permute").
    params: kind-specific parameters.
    axes: mesh axes communicated over.
    dtype: dtype of the payload.
    shape: input shape agreed by all replicas (dimensions may be None).
    members: one placeholder per replica, indexed by replica id; None for a
      replica this process does not run (a multi-client job's other processes').
    groups: replica ids partitioned into the device groups that communicate.
    implementation: name of the lowering that will implement it.
    devices: every replica's device, indexed by replica id (this process's
      and the others').
  """

  index: int
  kind: str
  params: tuple[tuple[str, Any], ...]
  axes: tuple[str, ...]
  dtype: tf.DType
  shape: tf.TensorShape
  members: tuple[Placeholder, ...]
  groups: tuple[tuple[int, ...], ...]
  implementation: str
  devices: tuple[str, ...] = ()

  @property
  def all_devices(self) -> tuple[str, ...]:
    """Every replica's device by replica id (``devices``; a Collective made without them: its members')."""
    return self.devices or tuple(m.device for m in self.members)

  @property
  def present(self) -> tuple[Placeholder, ...]:
    """The members this process traced (every member, unless other processes run some replicas)."""
    return tuple(m for m in self.members if m is not None)

  @property
  def param_dict(self) -> dict[str, Any]:
    return dict(self.params)

  @property
  def group_size(self) -> int:
    return len(self.groups[0])

  @property
  def ragged(self) -> bool:
    """Whether members may differ in size along the concatenated dimension (an all_gather)."""
    return bool(self.param_dict.get("ragged"))

  @property
  def nbytes(self) -> int | None:
    """Bytes of one replica's input, or None if the shape is not fully known."""
    if not self.shape.is_fully_defined():
      return None
    return self.shape.num_elements() * self.dtype.size

  @property
  def member_nbytes(self) -> tuple[int | None, ...]:
    """Bytes of each member's input (None where its static shape is not fully known)."""
    return tuple(m.input_shape.num_elements() * self.dtype.size if m.input_shape.is_fully_defined() else None
                 for m in self.present)

  def bytes_str(self) -> str:
    """One replica's input bytes for tables: "4,096", "3,072-4,096" (members differ), "?" (unknown)."""
    if self.nbytes is not None:
      return f"{self.nbytes:,}"
    sizes = self.member_nbytes
    if None in sizes:
      return "?"
    return f"{min(sizes):,}-{max(sizes):,}"

  @property
  def location(self) -> str:
    return self.present[0].location

  def describe(self) -> str:
    params = ", ".join(f"{k}={v!r}" for k, v in self.params)
    return f"{self.kind}({params})"


@dataclasses.dataclass(frozen=True)
class Plan:
  """The rewrite plan of one step: every collective, in call order."""

  collectives: tuple[Collective, ...]
  devices: tuple[str, ...]
  # repl.explain's: a callable giving the step's memory report (:class:`rewrite.MemoryReport`), made on first use.
  memory_report: Callable[[], Any] | None = dataclasses.field(default=None, compare=False, repr=False)

  @property
  def memory(self):
    """The step's memory report (:class:`rewrite.MemoryReport`) if ``repl.explain`` made the plan, else None."""
    return None if self.memory_report is None else self.memory_report()

  @property
  def num_replicas(self) -> int:
    return len(self.devices)

  @property
  def bytes_per_step(self) -> int:
    """Payload bytes entering collectives per step, summed over replicas (known shapes only)."""
    return sum(b or 0 for c in self.collectives for b in c.member_nbytes)

  def summary(self) -> list[dict[str, Any]]:
    """One dict per collective (for programs and JSON)."""
    return [dict(index=c.index, kind=c.kind, params=dict(c.params), axes=c.axes,
                 dtype=c.dtype.name, shape=shape_str(c.shape), group_size=c.group_size,
                 bytes_per_replica=c.nbytes, implementation=c.implementation,
                 location=c.location) for c in self.collectives]

  def __str__(self) -> str:
    header = ("#", "collective", "axes", "dtype", "shape", "bytes/replica", "implementation", "called at")
    rows = [header]
    for c in self.collectives:
      rows.append((str(c.index), c.describe(), ",".join(c.axes), c.dtype.name,
                   shape_str(c.shape), c.bytes_str(),
                   c.implementation, c.location))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"Rewrite plan: {len(self.collectives)} collective(s) over "
             f"{self.num_replicas} replica(s), {self.bytes_per_step:,} bytes/step"]
    for j, r in enumerate(rows):
      lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
      if j == 0:
        lines.append("  ".join("-" * w for w in widths))
    if self.memory_report is not None:
      lines += ["", str(self.memory)]
    return "\n".join(lines)


def _mismatch(a: Placeholder, b: Placeholder, what: str) -> _errors.CollectiveMismatchError:
  message = (
      f"Replicas {a.replica} and {b.replica} disagree on collective #{a.index} "
      f"(its {what} differs):\n"
      f"  replica {a.replica}: {a.describe()}\n"
      f"  replica {b.replica}: {b.describe()}\n" + _errors.MISMATCH_FOOTER)
  return _errors.CollectiveMismatchError(message, (a.replica, b.replica), a.index)


def _count_mismatch(placeholders: Sequence[Sequence[Placeholder] | None], first: int,
                    r: int) -> _errors.CollectiveMismatchError:
  n0, nr = len(placeholders[first]), len(placeholders[r])
  longer, shorter = (first, r) if n0 > nr else (r, first)
  extra = placeholders[longer][min(n0, nr)]
  message = (
      f"Replica {longer} made {max(n0, nr)} collective call(s) but replica {shorter} "
      f"made {min(n0, nr)}. Replica {longer}'s collective #{extra.index} has no "
      f"counterpart in replica {shorter}:\n"
      f"  replica {longer}: {extra.describe()}\n"
      f"  replica {shorter}: (none)\n" + _errors.MISMATCH_FOOTER)
  return _errors.CollectiveMismatchError(message, (longer, shorter), extra.index)


def _checked_shape(member: Placeholder) -> tf.TensorShape:
  """The part of a member's input shape that must agree across its group."""
  params = member.param_dict
  if member.kind != "all_gather" or not params.get("ragged") or member.input_shape.rank is None:
    return member.input_shape
  dim = params["concat_dimension"]
  return tf.TensorShape([None if d == dim else n for d, n in enumerate(member.input_shape.as_list())])


def plan(placeholders: Sequence[Sequence[Placeholder] | None], mesh: mesh_lib.Mesh,
         choose: Callable[[Collective], str]) -> Plan:
  """Matches placeholders across replicas into collectives.

  Args:
    placeholders: for each replica (mesh device order), its placeholders in
      call order; None for a replica that another process of a multi-client
      job traces (its members are None, and its process plans its own part:
      every process must make the same calls).
    mesh: the mesh the replicas run on.
    choose: picks the lowering name for a matched collective.

  Returns:
    The plan.

  Raises:
    CollectiveMismatchError: replicas made different calls (count, order, kind,
      op, axes, dtype or shape).
  """
  if len(placeholders) != mesh.size:
    raise _errors.RewriteError(
        f"Expected placeholders for {mesh.size} replicas, found {len(placeholders)}.")
  present = [r for r, p in enumerate(placeholders) if p is not None]
  if not present:
    raise _errors.RewriteError("Expected the placeholders of at least one replica, found none.")
  collectives = []
  for index, traced in enumerate(zip(*(placeholders[r] for r in present))):
    members = [None] * mesh.size
    for r, m in zip(present, traced):
      members[r] = m
    first = traced[0]
    for other in traced[1:]:
      if (first.kind, first.params) != (other.kind, other.params):
        raise _mismatch(first, other, "kind or parameters")
      if first.axes != other.axes:
        raise _mismatch(first, other, "axes")
      if first.dtype != other.dtype:
        raise _mismatch(first, other, "dtype")
      if first.call != other.call:  # the same kind and shape from another call: matched by order, silently wrong
        raise _mismatch(first, other, "call (which of the step's calls made it)")
    # Shapes must agree within each device group; different groups (say, batch
    # shards of different sizes) may differ, which the plan shows as unknown.
    # A ragged gather's members may differ along the concatenated dimension.
    groups = mesh.groups(first.axes)
    shape = None
    for group in groups:
      group = [r for r in group if members[r] is not None]
      if not group:
        continue  # another process's group
      lead = members[group[0]]
      group_shape = _checked_shape(lead)
      for r in group[1:]:
        if not group_shape.is_compatible_with(_checked_shape(members[r])):
          raise _mismatch(lead, members[r], "shape")
        group_shape = group_shape.merge_with(_checked_shape(members[r]))
      if shape is None:
        shape = group_shape
      elif shape.rank != group_shape.rank:
        raise _mismatch(first, lead, "rank")
      else:
        shape = shape.most_specific_compatible_shape(group_shape)
    if len({tuple(m.input_shape.as_list()) if m.input_shape.rank is not None else None for m in traced}) == 1:
      shape = first.input_shape  # a ragged gather whose members agree after all
    draft = Collective(index=index, kind=first.kind, params=first.params, axes=first.axes,
                       dtype=first.dtype, shape=shape, members=tuple(members),
                       groups=groups, implementation="", devices=tuple(mesh.devices))
    collectives.append(dataclasses.replace(draft, implementation=choose(draft)))
  # The lengths differ but every shared position matched: report the extra call.
  for r in present[1:]:
    if len(placeholders[r]) != len(placeholders[present[0]]):
      raise _count_mismatch(placeholders, present[0], r)
  return Plan(collectives=tuple(collectives), devices=mesh.devices)
