"""A named-axis mesh of devices."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence

from mesh import _devices
from mesh import _errors

AxisNames = str | Sequence[str] | None

BAD_AXES = (
    "Mesh axes must be a non-empty mapping of axis name (str) to size (int >= 1), "
    "but found {axes!r}. Example: mesh.Mesh({{'batch': 2, 'model': 2}})."
)
WRONG_DEVICE_COUNT = (
    "Mesh {shape} needs {size} devices, but {found} were given{source}. Fix: pass "
    "exactly {size} devices, change the axis sizes, or call "
    "replicator.virtual_cpus({size}) at program start to get {size} CPU devices."
)
AXIS_NOT_A_NAME = (
    "Mesh axes are named: expected an axis name (str), a tuple of names, or None for every axis, but found "
    "{axes!r} ({type}). The mesh has axes {names} (shape {shape}). Fix: name the axis, e.g. axis={first!r}."
)
UNKNOWN_AXIS = (
    "Unknown mesh axis {axis!r}. This mesh has axes {names} (shape {shape}). "
    "Fix: use one of those names, or a tuple of them."
)


class Mesh:
  """An n-dimensional array of devices with named axes.

  Devices are laid out row-major: the last axis varies fastest. The mesh is only
  a naming of devices; it says nothing about the physical network.

  Examples:
    >>> m = Mesh({"batch": 2, "model": 2},
    ...          devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    >>> m.shape
    {'batch': 2, 'model': 2}
    >>> m.coords(3)
    {'batch': 1, 'model': 1}
    >>> m.groups("model")
    ((0, 1), (2, 3))
  """

  def __init__(self, axes: Mapping[str, int], devices: Sequence[str] | None = None):
    """Creates a mesh.

    Args:
      axes: ordered mapping from axis name to axis size.
      devices: ``prod(sizes)`` device strings in row-major order; by default the
        first devices of the preferred local type.

    Raises:
      MeshError: malformed axes, or the wrong number of devices.
      DeviceError: an unknown or duplicated device.
    """
    if not isinstance(axes, Mapping) or not axes or not all(
        isinstance(k, str) and k and isinstance(v, int) and not isinstance(v, bool)
        and v >= 1 for k, v in axes.items()):
      raise _errors.MeshError(BAD_AXES.format(axes=axes))
    self._shape = dict(axes)
    size = math.prod(self._shape.values())
    if devices is None:
      available = _devices.local_devices()
      if len(available) < size:
        raise _errors.MeshError(WRONG_DEVICE_COUNT.format(
            shape=self._shape, size=size, found=len(available),
            source=" (all local logical devices)"))
      devices = available[:size]
    devices = _devices.resolve(devices)
    if len(devices) != size:
      raise _errors.MeshError(WRONG_DEVICE_COUNT.format(
          shape=self._shape, size=size, found=len(devices), source=""))
    self._devices = tuple(devices)
    self._strides = _strides(self._shape)
    self._repeated: tuple[str, ...] = ()

  def with_repeats(self, axis: str, count: int) -> "Mesh":
    """This mesh with one more axis, last, whose ``count`` positions are each device again.

    Device ``i`` of this mesh is devices ``i * count`` to ``i * count + count - 1`` of the new one, which
    differ only along ``axis``. The global view's pipelines split each device's rows over such an axis, a
    microbatch a position: its groups are one device's, their collectives local to it.

    Examples:
      >>> Mesh({"stage": 2}, devices=["cpu:0", "cpu:1"]).with_repeats("microbatch", 2).devices[:2]
      ('/device:CPU:0', '/device:CPU:0')
    """
    if not isinstance(axis, str) or not axis or axis in self._shape or not isinstance(count, int) or count < 1:
      raise _errors.MeshError(f"Mesh.with_repeats({axis!r}, {count!r}): expected a new axis name (this mesh has "
                              f"{self.axis_names}) and a positive int.")
    repeated = object.__new__(Mesh)
    repeated._shape = {**self._shape, axis: count}
    repeated._devices = tuple(d for d in self._devices for _ in range(count))
    repeated._strides = _strides(repeated._shape)
    repeated._repeated = self._repeated + (axis,)
    return repeated

  @property
  def repeated_axes(self) -> tuple[str, ...]:
    """The axes whose positions are one device (:meth:`with_repeats`); empty for a mesh of distinct devices."""
    return self._repeated

  @classmethod
  def from_devices(cls, devices: Sequence[str] | None = None, axis_name: str = "replica") -> "Mesh":
    """A one-dimensional mesh over ``devices`` (default: all local devices)."""
    devices = _devices.resolve(devices)
    return cls({axis_name: len(devices)}, devices)

  @property
  def shape(self) -> dict[str, int]:
    """Axis name to size, in axis order."""
    return dict(self._shape)

  @property
  def axis_names(self) -> tuple[str, ...]:
    """The axis names, in order."""
    return tuple(self._shape)

  @property
  def size(self) -> int:
    """The number of devices."""
    return len(self._devices)

  @property
  def devices(self) -> tuple[str, ...]:
    """The devices, flattened in row-major order."""
    return self._devices

  def axis_size(self, axes: AxisNames = None) -> int:
    """The number of devices along ``axes`` (a name, a tuple of names, or None for all)."""
    return math.prod(self._shape[a] for a in self.normalize_axes(axes))

  def normalize_axes(self, axes: AxisNames = None) -> tuple[str, ...]:
    """Returns ``axes`` as a tuple of known axis names (None means all axes)."""
    if axes is None:
      return self.axis_names
    names = (axes,) if isinstance(axes, str) else tuple(axes) if isinstance(axes, Iterable) else None
    if names is None or not all(isinstance(name, str) for name in names):
      raise _errors.ArgumentTypeError(AXIS_NOT_A_NAME.format(
          axes=axes, type=type(axes).__name__, names=self.axis_names, shape=self._shape, first=self.axis_names[0]))
    for name in names:
      if name not in self._shape:
        raise _errors.MeshError(UNKNOWN_AXIS.format(
            axis=name, names=self.axis_names, shape=self._shape))
    if len(set(names)) != len(names):
      raise _errors.MeshError(f"Mesh axes {names} name an axis twice; name each axis once.")
    return names

  def coords(self, index: int) -> dict[str, int]:
    """The coordinates of the device at flat ``index``."""
    if not 0 <= index < self.size:
      raise IndexError(f"Device index {index} is out of range for a mesh of {self.size} devices.")
    return {a: (index // self._strides[a]) % self._shape[a] for a in self.axis_names}

  def index(self, coords: Mapping[str, int]) -> int:
    """The flat index of the device at ``coords`` (every axis must be given)."""
    return sum(coords[a] * self._strides[a] for a in self.axis_names)

  def device_index(self, device: str) -> int:
    """The flat index of ``device`` in this mesh."""
    return self._devices.index(_devices.canonical_name(device))

  def axis_index(self, index: int, axes: AxisNames = None) -> int:
    """Position of device ``index`` within its group along ``axes`` (row-major over ``axes``)."""
    c = self.coords(index)
    position = 0
    for a in self.normalize_axes(axes):
      position = position * self._shape[a] + c[a]
    return position

  def groups(self, axes: AxisNames = None) -> tuple[tuple[int, ...], ...]:
    """Partitions the devices into groups that differ only along ``axes``.

    Each group lists flat device indices ordered by :meth:`axis_index`; groups
    are ordered by the smallest index they contain.
    """
    names = self.normalize_axes(axes)
    others = [a for a in self.axis_names if a not in names]
    groups = []
    for fixed in itertools.product(*(range(self._shape[a]) for a in others)):
      base = dict(zip(others, fixed))
      members = []
      for varying in itertools.product(*(range(self._shape[a]) for a in names)):
        members.append(self.index({**base, **dict(zip(names, varying))}))
      groups.append(tuple(members))
    return tuple(sorted(groups))

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, Mesh) and self._shape == other._shape
            and self._devices == other._devices)

  def __hash__(self) -> int:
    return hash((tuple(self._shape.items()), self._devices))

  def __repr__(self) -> str:
    axes = ", ".join(f"{k!r}: {v}" for k, v in self._shape.items())
    return f"Mesh({{{axes}}}, devices={list(self._devices)})"


def _strides(shape: Mapping[str, int]) -> dict[str, int]:
  """Each axis's stride in the row-major flat index (the last axis varies fastest)."""
  strides, stride = {}, 1
  for name in reversed(tuple(shape)):
    strides[name] = stride
    stride *= shape[name]
  return strides


def as_axis_tuple(axes: Iterable[str] | str | None) -> tuple[str, ...] | None:
  """Normalises an axis argument to a tuple (None stays None)."""
  if axes is None:
    return None
  return (axes,) if isinstance(axes, str) else tuple(axes)
