"""A search for variables' layouts: candidates per variable, scored by the cost model, under a memory budget.

The search knows the variables only by name, global shape, bytes and a
*group* (variables that play the same part, such as every block's query
kernel, take the same choice), and the step only through ``evaluate``: a
callable that partitions the step with a given assignment of layouts and
returns its estimated seconds (``rewrite._cost``).

Candidates for one variable, from the rule families the partitioner knows:
replicated; one dimension split over one mesh axis that is not a batch axis
(Megatron's column and row splits, heads, the vocabulary, experts are all
"dimension d over the model axis" for some d); and the largest dimension
split over the batch axes (fully sharded data parallelism), alone or with a
model split of another dimension.

Joint moves by dimension size. A dimension's size names its part in most
models: in a transformer the hidden width, the heads, a head's width, the
feed-forward width and the vocabulary each have their own size, and the
layouts people write by hand are "this dimension over that axis" wherever
it occurs (Mesh TensorFlow's layouts map named dimensions to mesh axes the
same way): Megatron's attention is the heads split in the query, key, value
and output kernels together, its feed-forward the feed-forward width split
in both kernels, the vocabulary split the embedding's rows and the output
layer's columns. One group moved alone rarely gets there (the query's heads
split alone adds collectives the output kernel's split would have removed),
so the search also moves, for each size and model axis, every group with
one dimension of that size to that dimension over the axis, at once.

Why a greedy search by groups rather than an ILP over every op (Alpa): the
estimate of an assignment is the partitioner's own propagation plus the cost
model, which prices exactly what the expander will emit, and a group's choice
interacts with its neighbours' only through the relayouts between them, which
that evaluation sees. Coordinate descent: from a start, try each joint move
and then, for each group, largest first, each candidate with the others
fixed, keeping the best; where nothing improves, each joint move with one
other split group made replicated (a split taken early can block a joint
move: GPT-2's position embedding split over its positions kept the heads'
split from paying, 0.8% slower); sweep again until nothing changes (at most
``sweeps`` times). Two starts, the best end kept: every group replicated,
and every group split along its first dimension over the model axis (the
row split). From replicated alone the descent ended 7.7% above the best on
KerasHub's Qwen; a third start, every group split along its last dimension
(the column split), found nothing better on the five models of
``benchmarks/cost_model.py`` and took 40-60% of their evaluations.
Evaluations: about starts x (groups x candidates + sizes) x sweeps, each one
propagation of the step's graph (``rewrite._propagation.Propagator``: an op
whose inputs' layouts are unchanged is not decided again). Groups make the
count independent of the depth of a model: a 12-block transformer has as
many groups as a 2-block one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Variable:
  """What the search knows of one variable.

  Attributes:
    shape: its global shape.
    nbytes: its bytes, whole.
    group: variables of one group take the same choice.
    copies: how many variables of its bytes follow its layout (1 + an
      optimizer's slots: Adam's two moments make 3).
  """

  shape: tuple
  nbytes: int
  group: str
  copies: int = 1


@dataclasses.dataclass(frozen=True)
class Scored:
  """One evaluated assignment: the move tried, its estimate and memory.

  Attributes:
    group: the group whose choice changed; or a joint move's description
      (``dimensions of size 512 over 'model' (2 groups)``), or ``start``.
    layout: the group's layout tried (empty for a joint move or a start).
    remat: the blocks ``evaluate`` rematerialized for it to fit (their scopes).
  """

  group: str
  layout: tuple
  seconds: float
  bytes_per_device: int
  fits: bool
  remat: tuple = ()


@dataclasses.dataclass(frozen=True)
class Result:
  """The search's outcome.

  Attributes:
    layouts: variable name -> its chosen layout (mesh axes per dimension).
    seconds: the chosen assignment's estimate.
    bytes_per_device: its variables' (and their copies') bytes a device, and the step's tensors' at their peak
      (what ``evaluate`` adds).
    tried: every evaluated assignment, in order.
    search_seconds: how long the search took.
    activation_bytes: of ``bytes_per_device``, the step's tensors' (what ``evaluate`` adds).
    remat: the blocks rematerialized with the chosen layouts (what ``evaluate`` chose for them).
  """

  layouts: dict
  seconds: float
  bytes_per_device: int
  tried: tuple
  search_seconds: float
  activation_bytes: int = 0
  remat: tuple = ()


class BudgetError(ValueError):
  """No assignment found fits the memory budget."""


def _model_axes(mesh_shape: Mapping[str, int], batch_axes=()) -> list[str]:
  """The mesh axes a variable's dimension may be split over alone: more than one device, not a batch axis."""
  return [a for a, n in mesh_shape.items() if n > 1 and a not in batch_axes]


def candidates(shape, mesh_shape: Mapping[str, int], batch_axes=()) -> list[tuple]:
  """The layouts the search tries for a variable of ``shape``: replicated first."""
  rank = len(shape)
  replicated = ((),) * rank
  found = [replicated]
  model_axes = _model_axes(mesh_shape, batch_axes)
  batch = tuple(a for a in batch_axes if mesh_shape.get(a, 1) > 1)

  def split(layout, d, axes):
    n = math.prod(mesh_shape[a] for a in axes)
    if shape[d] is None or shape[d] < n or shape[d] % n or layout[d]:
      return None
    out = list(layout)
    out[d] = tuple(axes)
    return tuple(out)

  for axis, d in itertools.product(model_axes, range(rank)):
    layout = split(replicated, d, (axis,))
    if layout is not None and layout not in found:
      found.append(layout)
  if batch and rank:
    by_size = sorted(range(rank), key=lambda d: -(shape[d] or 0))
    for base in list(found):
      for d in by_size:
        layout = split(base, d, batch)
        if layout is not None:
          if layout not in found:
            found.append(layout)
          break
  return found


def _seeds(options: dict, mesh_shape, batch_axes) -> list[dict]:
  """Where the descent starts: every group replicated; each split along its first dimension over a model axis
  (row-parallel). Descents from two starts escape some local optima (see the module)."""
  seeds = [{g: found[0] for g, found in options.items()}]
  model = _model_axes(mesh_shape, batch_axes)
  seed = {}
  for g, found in options.items():
    rank = len(found[0])
    wanted = [tuple((a,) if e == d else () for e in range(rank)) for d in range(rank) for a in model[:1]]
    seed[g] = next((w for w in wanted if w in found), found[0])
  if seed not in seeds:
    seeds.append(seed)
  return seeds


def joint_moves(shapes: Mapping[str, tuple], options: Mapping[str, list], mesh_shape: Mapping[str, int],
                batch_axes=()) -> list[tuple[str, dict]]:
  """For each dimension size and model axis, every group with one dimension of that size split along it.

  Args:
    shapes: group -> its variables' shape.
    options: group -> its candidates.

  Returns:
    ``(label, {group: layout})`` for each move of two groups or more, largest sizes first.
  """
  moves = []
  sizes = sorted({n for shape in shapes.values() for n in shape if n}, reverse=True)
  for axis in _model_axes(mesh_shape, batch_axes):
    for size in sizes:
      move = {}
      for group, shape in shapes.items():
        dims = [d for d, n in enumerate(shape) if n == size]
        layout = tuple((axis,) if d == dims[0] else () for d in range(len(shape))) if len(dims) == 1 else None
        if layout in options[group]:
          move[group] = layout
      if len(move) > 1:
        moves.append((f"dimensions of size {size} over {axis!r} ({len(move)} groups)", move))
  return moves


def bytes_per_device(variables: Mapping[str, Variable], layouts: Mapping[str, tuple],
                     mesh_shape: Mapping[str, int]) -> int:
  """The bytes a device holds of ``variables`` (and their copies) under ``layouts``."""
  total = 0
  for name, v in variables.items():
    layout = layouts.get(name) or ()
    pieces = math.prod(math.prod(mesh_shape[a] for a in axes) for axes in layout)
    total += v.nbytes * v.copies // pieces
  return total


def search(variables: Mapping[str, Variable], mesh_shape: Mapping[str, int], evaluate: Callable[[dict], float],
           batch_axes=(), memory_per_device: int | None = None, sweeps: int = 3, held_besides: int = 0) -> Result:
  """The assignment of layouts with the lowest estimate that fits ``memory_per_device`` (see the module).

  Args:
    variables: name -> :class:`Variable`.
    mesh_shape: axis name -> size.
    evaluate: an assignment (name -> layout, every variable) -> its estimated seconds, or (its estimated
      seconds, the bytes of the step's tensors a device holds besides the variables), or (those, and the
      blocks it rematerialized to get there).
    batch_axes: the mesh axes the batch is split over.
    memory_per_device: the bytes a device may hold: variables (and their copies), what ``evaluate`` adds and
      ``held_besides``; None: no limit.
    sweeps: at most this many passes over the groups.
    held_besides: bytes a device holds whatever the layouts (variables left out of the search), counted in the
      budget and in the refusal's figures (not in the result's ``bytes_per_device``).

  Raises:
    BudgetError: nothing found fits the budget (the message names the smallest footprint found).
  """
  start = time.perf_counter()
  mesh_shape = dict(mesh_shape)
  groups: dict[str, list[str]] = {}
  for name, v in variables.items():
    groups.setdefault(v.group, []).append(name)
  options = {}
  for group, names in groups.items():  # a choice valid for every member
    shapes = {variables[n].shape for n in names}
    common = [layout for layout in candidates(next(iter(shapes)), mesh_shape, batch_axes)
              if all(layout in candidates(s, mesh_shape, batch_axes) for s in shapes)]
    options[group] = common or [((),) * len(next(iter(shapes)))]
  order = sorted(groups, key=lambda g: -sum(variables[n].nbytes * variables[n].copies for n in groups[g]))
  joint = joint_moves({g: variables[names[0]].shape for g, names in groups.items()}, options, mesh_shape, batch_axes)
  moves = joint + [(g, {g: layout}) for g in order for layout in options[g]]
  tried, cache = [], {}

  def assignment(choice):
    return {n: choice[g] for g, names in groups.items() for n in names}

  def score(choice, label, layout):
    key = tuple(sorted(choice.items()))
    if key not in cache:
      layouts = assignment(choice)
      seconds, activations, remat = _evaluated(evaluate(layouts))
      memory = bytes_per_device(variables, layouts, mesh_shape) + activations
      fits = memory_per_device is None or memory + held_besides <= memory_per_device
      cache[key] = (seconds, memory, fits, activations, remat)
      tried.append(Scored(label, layout, *cache[key][:3], remat))
    return cache[key]

  def rank(r):  # fitting ones by time (then bytes); the others by bytes, to move towards the budget
    seconds, memory, fits = r[:3]
    return (0, seconds, memory) if fits else (1, memory, seconds)

  def better(a, b):
    return rank(a) < rank(b)

  def descend(choice):
    best = score(choice, "start", ())
    for _ in range(sweeps):
      changed = False
      for label, move in moves:
        if all(choice[g] == layout for g, layout in move.items()):
          continue
        trial = {**choice, **move}
        result = score(trial, label, move[label] if label in move else ())
        if better(result, best):
          choice, best, changed = trial, result, True
      if not changed:  # a joint move that another group's split blocks: with that group replicated
        for (label, move), g in itertools.product(joint, order):
          if g in move or choice[g] == options[g][0] or all(choice[h] == layout for h, layout in move.items()):
            continue
          trial = {**choice, **move, g: options[g][0]}
          result = score(trial, f"{label}, {g} replicated", ())
          if better(result, best):
            choice, best, changed = trial, result, True
            break
      if not changed:
        break
    return choice, best

  if not order:
    seconds, activations, remat = _evaluated(evaluate({}))
    if memory_per_device is not None and activations + held_besides > memory_per_device:
      raise BudgetError(f"The step's tensors take {activations:,} bytes a device (and the variables "
                        f"{held_besides:,}), above memory_per_device={memory_per_device:,}, and it has no variable "
                        "large enough to split. Fix: raise memory_per_device or use a smaller batch.")
    return Result({}, seconds, activations, (), time.perf_counter() - start, activations, remat)
  choice, best = None, None
  for seed in _seeds(options, mesh_shape, batch_axes):
    found, result = descend(seed)
    if best is None or better(result, best):
      choice, best = found, result
  if not best[2]:  # ``choice`` is the smallest found: say what takes its bytes
    layouts = assignment(choice)
    held = bytes_per_device(variables, layouts, mesh_shape) + held_besides
    smallest = best[1] + held_besides
    by_group = sorted(((bytes_per_device({n: variables[n] for n in names}, layouts, mesh_shape), g)
                       for g, names in groups.items()), key=lambda bg: (-bg[0], bg[1]))
    largest = ", ".join(f"{g} ({len(groups[g])} variable(s), {b:,} bytes)" for b, g in by_group[:3])
    raise BudgetError(
        f"No layout found keeps a device within memory_per_device={memory_per_device:,} bytes: the smallest "
        f"footprint found is {smallest:,} bytes ({held:,} of variables and their optimizer slots, {smallest - held:,} "
        f"of the step's tensors at their peak{_with_remat(best[4])}), the largest variables {largest}. Fix: raise "
        "memory_per_device, "
        "use a larger mesh or a smaller batch, or split the variables over more axes.")
  return Result(assignment(choice), best[0], best[1], tuple(tried), time.perf_counter() - start, best[3], best[4])


def _evaluated(found) -> tuple[float, int, tuple]:
  """(seconds, the step's tensors' bytes, the blocks rematerialized) of what ``evaluate`` returned."""
  if not isinstance(found, tuple):
    return found, 0, ()
  return (found + (0, ()))[:2] + ((found[2] if len(found) > 2 else ()),)


def _with_remat(remat: tuple) -> str:
  return f", with {len(remat)} block(s) rematerialized" if remat else ""
