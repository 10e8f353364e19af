r"""``Replicator(layouts="auto")``: the global view chooses its variables' layouts by a search, on the first build.

The first step built (``repl.run`` or ``repl.explain``) is traced at global
shapes as any global-view step, with every variable replicated. Its variables
are then handed to ``rewrite._search``: each variable of some size is a
candidate (an optimizer's slots follow their variable and count towards its
bytes; small ones, such as biases and norms' scales, on-read metrics and
scalars stay replicated, but a bias takes its kernel's layout on the
dimensions they share), grouped by its path with the numbers taken out
(every block's query kernel is one choice), and every assignment the search
tries is priced by partitioning the traced step with it
(``rewrite._partition.propagate``) and the cost model
(``rewrite._cost``, on the machine ``replicator.calibrate`` measured). The
winner's layouts are given to the variables (their components replaced, the
objects kept) and to their slots, become :attr:`Replicator.layouts` (a
``mesh.LayoutMap`` with a key per group, its path with ``\d+`` for the
numbers: for variables made later, and to reuse as a hand-written map), and
the step is partitioned with them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import mesh as mesh_lib
from replicator.core import _errors
from replicator.core import _gc
from replicator.state import _variables
from rewrite import _cost
from rewrite import _partition
from rewrite import _recompute
from rewrite import _search

SMALL = 0.01  # variables below this fraction of the largest one's bytes stay replicated


@dataclasses.dataclass
class Auto:
  """The state of a Replicator whose layouts are chosen automatically."""

  memory_per_device: int | None
  machine: Callable  # devices -> rewrite._cost.Machine (the Replicator's calibration)
  result: _search.Result | None = None


def group_of(path: str) -> str:
  """Variables that take one choice: every block's (numbers in the path as ``#``), of any instance of a model.

  ``sequential_1/block0_attn/query/kernel`` -> ``sequential/block#_attn/query/kernel``; a functional model's
  ``block1_ff_in/kernel`` -> ``block#_ff_in/kernel``. The ``_<n>`` Keras adds to a second instance's name is
  dropped from the first part.
  """
  first, _, rest = path.partition("/")
  parts = [re.sub(r"_\d+$", "", first)] + ([rest] if rest else [])
  return re.sub(r"\d+", "#", "/".join(parts))


def key_of(path: str) -> str:
  r"""The layout-map key of ``path``'s group: ``^sequential(?:_\d+)?/block\d+_attn/query/kernel$``."""
  first, _, rest = path.partition("/")
  key = re.sub(r"\d+", lambda _: r"\d+", re.escape(re.sub(r"_\d+$", "", first))) + r"(?:_\d+)?"
  if rest:
    key += "/" + re.sub(r"\d+", lambda _: r"\d+", re.escape(rest))
  return "^" + key + "$"


def _path(v) -> str:
  """A variable's path, as its layout-map key is matched when it is made (``sequential/ff_in/kernel``)."""
  return _variables.variable_path(v.name)


def _companions(small: dict, searched: dict) -> dict:
  """A small variable (a bias) -> (the searched one it follows, its rank): of one layer, its shape the other's end.

  A kernel split along its output dimension makes outputs split there; its
  bias, replicated, would be sliced for the sum (free) but its gradient,
  computed split, gathered every step: a bias takes its kernel's layout on
  the dimensions it shares (a query kernel ``[hidden, heads, head]`` split over
  the heads splits its bias ``[heads, head]`` over them too).
  """
  parents: dict = {}
  for name, v in searched.items():
    parents.setdefault(_path(v).rpartition("/")[0], []).append((name, v))
  found = {}
  for name, v in small.items():
    shape = v.shape.as_list()
    for leader, kernel in parents.get(_path(v).rpartition("/")[0], ()):
      if kernel.shape.rank > len(shape) and kernel.shape.as_list()[-len(shape):] == shape:
        found[name] = (leader, len(shape))
        break
  return found


def _following(companions: dict, layouts: dict) -> dict:
  """The companions' layouts under ``layouts`` of their leaders: the leader's, on the dimensions they share."""
  return {name: layouts[leader][-rank:] for name, (leader, rank) in companions.items() if leader in layouts}


def remat_order(graph) -> list:
  """The blocks the search may rematerialize (``rewrite._recompute.blocks``), in the order it takes them.

  The most bytes saved first; of equal ones, the first in the step (every transformer block saves as much: the
  first ones are taken).
  """
  found = _recompute.blocks(graph)
  sizes = {}
  for block in found:
    total = 0
    for name in block.saved:
      t = graph.get_tensor_by_name(name)
      total += (t.shape.num_elements() or 0) * t.dtype.size if t.shape.is_fully_defined() else 0
    sizes[block.scope] = total
  return sorted(found, key=lambda b: -sizes[b.scope])


def choose(replicator, layouts, graph, mesh, given: dict, handle_shapes: dict, summed, data, axes,
           variables: dict, pinned: dict | None = None) -> None:
  """Searches the layouts of ``variables`` (placeholder name -> ReplicatedVariable) and applies the winner.

  ``layouts``: the Replicator's ``_layout_state.LayoutState`` (its ``auto`` the search's state); it records
  the chosen map. ``pinned``: the layouts the step states for values it computes (kept by every candidate).
  """
  auto = layouts.auto
  machine = auto.machine(list(mesh.devices))
  slots: dict[int, int] = {}
  for v in variables.values():
    reference = _variables.slot_reference(v)
    if reference is not None:
      slots[id(reference)] = slots.get(id(reference), 0) + 1
  sizes = {name: v.shape.num_elements() * v.dtype.size for name, v in variables.items()
           if v.shape.is_fully_defined()}
  largest = max(sizes.values(), default=0)
  searched, fixed_bytes, small = {}, 0, {}
  for name, v in variables.items():
    if _variables.slot_reference(v) is not None:  # a slot: follows its variable
      continue
    nbytes = sizes.get(name, 0) * (1 + slots.get(id(v), 0))
    if (_variables.per_replica_by_design(v) or v.shape.rank == 0 or not v.dtype.is_floating
        or name not in sizes or sizes[name] < SMALL * largest):
      fixed_bytes += nbytes
      if name in sizes and v.shape.rank and v.dtype.is_floating and not _variables.per_replica_by_design(v):
        small[name] = v
      continue
    path = _path(v)
    searched[name] = _search.Variable(tuple(v.shape.as_list()), sizes[name], group_of(path),
                                      copies=1 + slots.get(id(v), 0))
  shapes: dict[str, set] = {}
  for v in searched.values():
    shapes.setdefault(v.group, set()).add(v.shape)
  for name, v in searched.items():  # one path for variables of several shapes (a block's two Dense kernels,
    if len(shapes[v.group]) > 1:    # when the path keeps the block's name only): a group per shape
      searched[name] = dataclasses.replace(v, group=f"{v.group} {list(v.shape)}")
  companions = _companions(small, {name: variables[name] for name in searched})  # (in the budget: counted whole)

  propagate, memo = _partition.propagator(graph, mesh, handle_shapes, summed, data, axes, alike=True,
                                          pinned=pinned), {}
  budget = auto.memory_per_device
  blocks = remat_order(graph) if budget is not None else []

  def evaluate(layouts: dict) -> tuple[float, int, tuple]:
    """(seconds, the step's tensors' bytes at their peak, the blocks rematerialized for them to fit)."""
    partition = propagate({**given, **layouts, **_following(companions, layouts)})
    priced = {}

    def priced_with(k: int):  # the first k blocks rematerialized
      if k not in priced:
        work = _cost.work(graph, partition, mesh.shape, graph.outputs, memo=memo, recomputed=blocks[:k])
        priced[k] = (work.estimate(machine).seconds, int(work.peak_bytes))
      return priced[k]

    seconds, peak = priced_with(0)
    room = None if budget is None else budget - fixed_bytes - _search.bytes_per_device(searched, layouts, mesh.shape)
    if room is None or peak <= room or not blocks:
      return seconds, peak, ()
    low, high = 1, len(blocks)  # the fewest blocks that fit (the peak falls as blocks are added)
    if priced_with(high)[1] > room:
      return (*priced_with(high), tuple(b.scope for b in blocks))
    while low < high:
      middle = (low + high) // 2
      if priced_with(middle)[1] <= room:
        high = middle
      else:
        low = middle + 1
    return (*priced_with(low), tuple(b.scope for b in blocks[:low]))

  if budget is not None and budget < fixed_bytes:
    raise _errors.ArgumentError(
        f"Replicator(layouts='auto', memory_per_device={budget:,}): the variables that stay replicated (small "
        f"ones, metrics, counters) alone take {fixed_bytes:,} bytes a device. Fix: raise memory_per_device.")
  try:
    with _gc.paused():  # the remembered decisions are millions of small tuples: collections took a third of the time
      result = _search.search(searched, mesh.shape, evaluate, batch_axes=axes, memory_per_device=budget,
                              held_besides=fixed_bytes)
  except _search.BudgetError as e:
    raise _errors.ArgumentError(f"Replicator(layouts='auto', memory_per_device={budget:,}): {e}") from None
  chosen, relaid, ambiguous = {}, {}, set()
  for name, layout in result.layouts.items():
    v = variables[name]
    path = _path(v)
    layout = mesh_lib.Layout(layout, mesh)  # (a Layout takes the partition's tuples of axes as they are)
    v.relayout(layout, chosen_by=f"auto ({searched[name].group})")
    relaid[id(v)] = v
    if not layout.is_fully_replicated:  # one key per group: any number where the path has one (every block)
      key = key_of(path)
      if chosen.get(key, layout.spec) != layout.spec:  # variables of several shapes and layouts: not by path
        ambiguous.add(key)
      chosen[key] = layout.spec
  for name, layout in _following(companions, result.layouts).items():  # biases as their kernels
    v, leader = variables[name], variables[companions[name][0]]
    layout = mesh_lib.Layout(layout, mesh)
    if not layout.is_fully_replicated:
      v.relayout(layout, chosen_by=f"as {_path(leader)}")
      relaid[id(v)] = v
      chosen[key_of(_path(v))] = layout.spec
  for v in _variables.variables_of(replicator):  # the slots take their variable's layout
    reference = _variables.slot_reference(v)
    if reference is not None and id(reference) in relaid and v.shape == reference.shape:
      v.relayout(reference.sharding, chosen_by=f"as {reference.name.split(':')[0]} (a slot)")
  chosen = {key: spec for key, spec in chosen.items() if key not in ambiguous}
  layouts.chosen(mesh_lib.LayoutMap(chosen) if chosen else None)
  followed = {name: _search.Variable(tuple(variables[name].shape.as_list()), sizes[name], "",
                                     copies=1 + slots.get(id(variables[name]), 0)) for name in companions}
  split_off = (_search.bytes_per_device(followed, {}, mesh.shape)  # (counted whole in fixed_bytes)
               - _search.bytes_per_device(followed, _following(companions, result.layouts), mesh.shape))
  auto.result = dataclasses.replace(result, bytes_per_device=result.bytes_per_device + fixed_bytes - split_off)
