"""Layouts: how each dimension of a tensor is split over the axes of a mesh.

A layout spec has one entry per tensor dimension: a mesh axis name (the
dimension is split over that axis), a tuple of axis names (split over their
product, row-major), or None (not split). Mesh axes that no dimension uses
hold identical copies: the tensor is *replicated* along them.

Examples:
  >>> import mesh
  >>> m = mesh.Mesh({"batch": 2, "model": 2}, devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
  >>> layout = mesh.Layout((None, "model"), m)
  >>> layout.shard_shape([6, 8])
  [6, 4]
  >>> layout.replicated_axes, layout.sharded_axes
  (('batch',), ('model',))
  >>> [layout.shard_index(d) for d in range(4)]  # device (b, k) holds column block k
  [(0, 0), (0, 1), (0, 0), (0, 1)]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Union

from mesh import _errors
from mesh._mesh import Mesh

SpecEntry = Union[str, Sequence[str], None]
Spec = Sequence[SpecEntry]

UNKNOWN_AXIS = (
    "Layout {spec} names mesh axis {axis!r} (for tensor dimension {dim}), but the mesh has "
    "axes {names} (shape {shape}). Fix: use one of those axis names, or None to replicate "
    "the dimension."
)
AXIS_USED_TWICE = (
    "Layout {spec} uses mesh axis {axis!r} for tensor dimensions {first} and {second}; a "
    "mesh axis can split only one dimension of a tensor. Fix: replicate one of them (None) or "
    "split it over another axis."
)
BAD_ENTRY = (
    "Layout {spec}: entry {dim} is {entry!r}; each entry must be a mesh axis name (str), a "
    "tuple of axis names, or None (replicated)."
)
RANK_MISMATCH = (
    "Layout {spec} has {entries} entries, but {what} has rank {rank} (shape {shape}). Fix: "
    "give one entry per tensor dimension (None for dimensions that are not split)."
)
NOT_DIVISIBLE = (
    "Cannot split {what} of shape {shape} with layout {spec}: dimension {dim} has size "
    "{size}, which is not divisible by {parts}, the size of mesh {axes_word} {axes}. Fix: "
    "make dimension {dim} a multiple of {parts} (e.g. {suggest}), or do not split it (None)."
)
UNKNOWN_SIZE = (
    "Cannot split {what} of shape {shape} with layout {spec}: dimension {dim} has unknown "
    "size. Fix: give the tensor a static shape, or do not split that dimension (None)."
)
AMBIGUOUS_PATH = (
    "{what} {path!r} matches {count} LayoutMap patterns: {patterns}. Each must "
    "match exactly one pattern (or an exact key). Fix: make the patterns more specific, "
    "e.g. anchor them (r'^dense_1/kernel$')."
)


def _spec_str(spec) -> str:
  return "(" + ", ".join(repr(e) for e in spec) + ("," if len(spec) == 1 else "") + ")"


class Layout:
  """How a tensor is split over a mesh.

  Args:
    spec: one entry per tensor dimension: a mesh axis name, a tuple of axis
      names (split over their product, the last varying fastest), or None.
    mesh: the mesh.

  Raises:
    LayoutError: an entry names an unknown axis, or one axis splits two
      dimensions.
  """

  def __init__(self, spec: Spec, mesh: Mesh):
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Iterable):
      raise _errors.LayoutError(
          f"A layout spec is a tuple with one entry per tensor dimension, found {spec!r}. "
          f"Fix: e.g. (None, 'model') for a matrix split by columns over axis 'model'.")
    spec = tuple(spec)
    self._mesh = mesh
    self._axes: list[tuple[str, ...]] = []
    used: dict[str, int] = {}
    for dim, entry in enumerate(spec):
      if entry is None:
        axes = ()
      elif isinstance(entry, str):
        axes = (entry,)
      elif isinstance(entry, Sequence) and all(isinstance(a, str) for a in entry):
        axes = tuple(entry)
      else:
        raise _errors.LayoutError(BAD_ENTRY.format(spec=_spec_str(spec), dim=dim, entry=entry))
      for axis in axes:
        if axis not in mesh.shape:
          raise _errors.LayoutError(UNKNOWN_AXIS.format(
              spec=_spec_str(spec), axis=axis, dim=dim, names=mesh.axis_names, shape=mesh.shape))
        if axis in used:
          raise _errors.LayoutError(AXIS_USED_TWICE.format(
              spec=_spec_str(spec), axis=axis, first=used[axis], second=dim))
        used[axis] = dim
      self._axes.append(axes)
    self._spec = tuple(None if not a else a[0] if len(a) == 1 else a for a in self._axes)

  @classmethod
  def replicated(cls, mesh: Mesh, rank: int) -> "Layout":
    """The layout that keeps a whole copy of a rank-``rank`` tensor on every device."""
    return cls((None,) * rank, mesh)

  @property
  def spec(self) -> tuple:
    """The normalised spec: None, an axis name or a tuple of names per dimension."""
    return self._spec

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def rank(self) -> int:
    return len(self._axes)

  def axes(self, dim: int) -> tuple[str, ...]:
    """The mesh axes that split tensor dimension ``dim`` (empty if none)."""
    return self._axes[dim]

  @property
  def sharded_axes(self) -> tuple[str, ...]:
    """Mesh axes that split some dimension, in mesh order."""
    used = {a for axes in self._axes for a in axes}
    return tuple(a for a in self._mesh.axis_names if a in used)

  @property
  def replicated_axes(self) -> tuple[str, ...]:
    """Mesh axes along which the tensor is copied, in mesh order."""
    used = set(self.sharded_axes)
    return tuple(a for a in self._mesh.axis_names if a not in used)

  @property
  def is_fully_replicated(self) -> bool:
    """Whether every device holds the whole tensor (no axis, or only size-1 axes, split it)."""
    return all(self.num_shards(d) == 1 for d in range(self.rank))

  def num_shards(self, dim: int) -> int:
    """Into how many pieces tensor dimension ``dim`` is split."""
    return math.prod(self._mesh.shape[a] for a in self._axes[dim])

  @property
  def shards_per_device(self) -> int:
    """The fraction 1/k of the tensor each device holds, as k."""
    return math.prod(self.num_shards(d) for d in range(self.rank))

  def check(self, shape: Sequence[int | None], what: str = "a tensor") -> None:
    """Raises LayoutError unless a tensor of ``shape`` can be split by this layout."""
    shape = list(shape)
    if len(shape) != self.rank:
      raise _errors.LayoutError(RANK_MISMATCH.format(
          spec=_spec_str(self._spec), entries=self.rank, what=what, rank=len(shape), shape=shape))
    for dim, size in enumerate(shape):
      parts = self.num_shards(dim)
      if parts == 1:
        continue
      if size is None:
        raise _errors.LayoutError(UNKNOWN_SIZE.format(what=what, shape=shape, spec=_spec_str(self._spec), dim=dim))
      if size % parts:
        axes = self._axes[dim]
        raise _errors.LayoutError(NOT_DIVISIBLE.format(
            what=what, shape=shape, spec=_spec_str(self._spec), dim=dim, size=size, parts=parts,
            axes_word="axis" if len(axes) == 1 else "axes",
            axes=repr(axes[0]) if len(axes) == 1 else axes, suggest=(size // parts + 1) * parts))

  def shard_shape(self, shape: Sequence[int]) -> list[int]:
    """The shape of each device's piece of a tensor of global ``shape``."""
    self.check(shape)
    return [size // self.num_shards(d) for d, size in enumerate(shape)]

  def shard_index(self, device: int) -> tuple[int, ...]:
    """Which piece (per dimension) the device at flat mesh index ``device`` holds."""
    return tuple(self._mesh.axis_index(device, axes) if axes else 0 for axes in self._axes)

  def shard_slices(self, device: int, shape: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(begin, size)`` of the device's piece of a tensor of global ``shape``."""
    size = self.shard_shape(shape)
    begin = [i * s for i, s in zip(self.shard_index(device), size)]
    return begin, size

  def __eq__(self, other) -> bool:
    return isinstance(other, Layout) and self._spec == other._spec and self._mesh == other._mesh

  def __hash__(self) -> int:
    return hash((self._spec, self._mesh))

  def __repr__(self) -> str:
    return f"Layout({_spec_str(self._spec)}, mesh={self._mesh.shape})"


class LayoutMap:
  """Layout specs for variables, chosen by variable path.

  Keys are exact variable paths or regular expressions over the path
  (``"dense_1/kernel"`` for a Keras layer's kernel, the variable's name for a
  ``tf.Variable`` or ``tf.Module``); values are layout specs. An exact key
  wins; otherwise exactly one pattern may match. Variables that match nothing
  are replicated. A pattern matches if it is found anywhere in the path
  (``re.search``, the default), or, with ``match="fullmatch"``, only if it
  matches the whole path (as ``keras.distribution.LayoutMap`` does since Keras
  3.15: ``"d1/kernel"`` then does not match ``sequential/d1/kernel``).

  A key ending in ``/output`` (Keras's convention: ``"<layer path>/output"``)
  lays out a layer's output, not a variable: in a global-view step the
  output of each Keras layer whose path it matches is laid out so
  (``Replicator.with_layout``), matched as variables' keys are.

  Examples:
    >>> layouts = LayoutMap({r"dense_1/kernel": (None, "model"), r"dense_1/bias": ("model",)})
    >>> layouts.lookup("dense_1/kernel"), layouts.lookup("dense_2/kernel")
    ((None, 'model'), None)
    >>> LayoutMap({"d1/kernel": (None, "model")}, match="fullmatch").lookup("sequential/d1/kernel") is None
    True

  Args:
    mapping: path or pattern -> layout spec.
    match: ``"search"`` or ``"fullmatch"``: how a pattern matches a path.
    pad: a spec shorter than the variable's rank is completed with ``None``
      (not split) for its last dimensions, as Keras on JAX does; by default
      the spec must have one entry per dimension.
  """

  MATCHES = ("search", "fullmatch")

  def __init__(self, mapping: Mapping[str, Spec] | None = None, *, match: str = "search", pad: bool = False):
    if match not in self.MATCHES:
      raise _errors.ArgumentError(f"LayoutMap(match={match!r}): expected one of {self.MATCHES} (how a key's regular "
                                  f"expression matches a variable path).")
    self._matches = re.search if match == "search" else re.fullmatch
    self.match_mode = match
    self.pad = bool(pad)
    self._entries: dict[str, tuple] = {}
    for key, spec in (mapping or {}).items():
      self[key] = spec

  def __setitem__(self, key: str, spec: Spec) -> None:
    if not isinstance(key, str):
      raise _errors.ArgumentTypeError(f"LayoutMap keys are variable paths or regular expressions (str), found {key!r}.")
    re.compile(key)  # a malformed pattern fails here, not at lookup
    self._entries[key] = tuple(spec)

  def __getitem__(self, key: str) -> tuple:
    return self._entries[key]

  def __iter__(self):
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)

  def items(self):
    return self._entries.items()

  def lookup(self, path: str) -> tuple | None:
    """The spec for the variable at ``path``, or None if no key matches."""
    found = self.match(path)
    return None if found is None else found[1]

  @staticmethod
  def is_output_key(key: str) -> bool:
    """Whether ``key`` lays out a layer's output (it ends in ``/output``), not a variable."""
    return key.rstrip("$").endswith("/output")

  def output_keys(self) -> list[str]:
    """The keys for layers' outputs (``"<layer path>/output"``), in key order."""
    return [k for k in self._entries if self.is_output_key(k)]

  def output_match(self, layer_path: str) -> tuple[str, tuple] | None:
    """``(key, spec)`` of the output key that matches the output of the layer at ``layer_path``, or None.

    Examples:
      >>> LayoutMap({"block_0/attention/output": ("batch", "seq", None)}).output_match("model/block_0/attention")
      ('block_0/attention/output', ('batch', 'seq', None))
    """
    return self._match(layer_path + "/output", self.output_keys(), "The layer output")

  def spec_for(self, spec: tuple, rank: int) -> tuple:
    """``spec`` for a variable of ``rank`` dimensions: padded with ``None`` if this map pads."""
    return spec + (None,) * (rank - len(spec)) if self.pad and len(spec) < rank else spec

  def match(self, path: str) -> tuple[str, tuple] | None:
    """``(key, spec)`` of the key that matches ``path`` (exactly, else by its pattern), or None.

    Examples:
      >>> LayoutMap({"dense/kernel$": (None, "model")}).match("model/dense/kernel")
      ('dense/kernel$', (None, 'model'))
    """
    return self._match(path, [k for k in self._entries if not self.is_output_key(k)])

  def _match(self, path: str, keys: list[str], what: str = "Variable") -> tuple[str, tuple] | None:
    if path in keys:
      return path, self._entries[path]
    matches = [k for k in keys if self._matches(k, path)]
    if len(matches) > 1:
      raise _errors.LayoutError(AMBIGUOUS_PATH.format(what=what, path=path, count=len(matches), patterns=matches))
    return (matches[0], self._entries[matches[0]]) if matches else None

  def unmatched(self, paths: Sequence[str], outputs: bool = False) -> list[str]:
    """The variables' keys (with ``outputs``, the layer outputs' keys) that match none of ``paths``, in key order.

    A key matches a path exactly or by its pattern; layers' paths are given without ``/output``.
    """
    if outputs:
      return [k for k in self.output_keys() if not any(k == p + "/output" or self._matches(k, p + "/output")
                                                       for p in paths)]
    return [k for k in self._entries if not self.is_output_key(k) and not any(k == p or self._matches(k, p)
                                                                             for p in paths)]

  def __repr__(self) -> str:
    options = "" if self.match_mode == "search" else f", match={self.match_mode!r}"
    options += ", pad=True" if self.pad else ""
    return f"LayoutMap({self._entries!r}{options})"


class LayoutRules:
  """Mesh-TensorFlow-style rules: named tensor dimensions -> mesh axes.

  Name the dimensions of each tensor once (``("batch", "hidden")``) and say
  once, in the rules, how each name is split. Changing the parallelism of a
  model is then a change of rules only.

  Examples:
    >>> rules = LayoutRules([("batch", "batch"), ("hidden", "model")])
    >>> rules.spec(("rows", "cols", "hidden"))
    (None, None, 'model')
    >>> rules.mesh_axes("batch")
    ('batch',)

  Args:
    rules: ``(dimension name, mesh axis | tuple of axes | None)`` pairs. A
      dimension without a rule is not split. Several dimensions may map to
      one mesh axis (Megatron: "heads" and "ff" both over "model") as long as
      no single tensor has two of them; :class:`Layout` rejects one that does.
  """

  def __init__(self, rules: Iterable[tuple[str, SpecEntry]] | Mapping[str, SpecEntry]):
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    self._rules: dict[str, SpecEntry] = {}
    for pair in pairs:
      if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
        raise _errors.LayoutError(
            f"LayoutRules takes (dimension name, mesh axis) pairs, found {pair!r}. "
            f"Fix: e.g. LayoutRules([('batch', 'batch'), ('hidden', 'model')]).")
      name, axes = pair
      if name in self._rules:
        raise _errors.LayoutError(f"LayoutRules has two rules for dimension {name!r}; give one.")
      self._rules[name] = tuple(axes) if isinstance(axes, (list, tuple)) else axes

  @property
  def rules(self) -> dict[str, SpecEntry]:
    return dict(self._rules)

  def mesh_axes(self, name: str) -> tuple[str, ...]:
    """The mesh axes dimension ``name`` is split over (empty if not split)."""
    axes = self._rules.get(name)
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)

  def spec(self, dims: Sequence[str]) -> tuple:
    """The layout spec of a tensor whose dimensions are named ``dims``."""
    if isinstance(dims, str):
      dims = (dims,)
    return tuple(self._rules.get(d) for d in dims)

  def layout(self, dims: Sequence[str], mesh: Mesh) -> Layout:
    """The :class:`Layout` of a tensor whose dimensions are named ``dims``."""
    return Layout(self.spec(dims), mesh)

  def layout_map(self, dimensions: Mapping[str, Sequence[str]]) -> LayoutMap:
    """A :class:`LayoutMap` from variable path patterns to named dimensions.

    Examples:
      >>> rules = LayoutRules([("hidden", "model")])
      >>> rules.layout_map({"w1": ("rows", "cols", "hidden"), "b1": ("hidden",)})["w1"]
      (None, None, 'model')
    """
    return LayoutMap({key: self.spec(dims) for key, dims in dimensions.items()})

  def __repr__(self) -> str:
    return f"LayoutRules({list(self._rules.items())!r})"
