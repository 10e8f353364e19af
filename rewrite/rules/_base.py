"""Layout rules for the global view: what one op needs of its inputs and gives its outputs.

A tensor's layout is a tuple with one entry per dimension: the mesh axes that
dimension is split over (``()``: whole on every device). A rule sees one op of
the traced global graph and its inputs' current layouts, and returns a
:class:`Decision`: the layout each input must be in (the expander relayouts
it: a local slice is free, a gather is a collective), the layout of each
output, and the all-reduce each output needs (a contraction or a reduction
over a split dimension leaves partial sums on each device).

Rules register per op type (:func:`register`); one module per rule family.
This package knows nothing about Keras.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

import numpy as np
import tensorflow as tf

from rewrite import _op_kinds

TensorLayout = tuple  # tuple[tuple[str, ...], ...]: mesh axes per dimension


UNKNOWN = -1  # a dimension of unknown size (a batch of any size, taken whole): no mesh axis divides it


class UnknownRank(Exception):
  """A rule asked for the shape of a tensor of unknown rank: it cannot reason about it (the op falls back)."""


def _sizes(shape) -> list:
  if shape.rank is None:
    raise UnknownRank()
  return [UNKNOWN if n is None else n for n in shape.as_list()]


@dataclasses.dataclass
class Decision:
  """What one op of the global graph becomes on every device.

  Attributes:
    inputs: per input, the layout it must be in; None: used as it is (a
      resource handle, or a shape operand replaced through ``consts``).
    outputs: per output, its layout (None for resource or unknown rank).
    reduce: per output, ``(op, axes)`` of the all-reduce that completes it, or None.
    consts: input index -> the local value that replaces a constant shape operand.
    fallback: True if the op had no rule and runs replicated on gathered inputs.
    why: for a fallback of an op with a rule, why the rule could not partition it (a loop's body that would
      communicate: the op that would).
    values: output index -> the constant value that output has on every device
      (a shape query answers with the global shape).
    unsupported: why the op cannot run partitioned at all ("" if it can).
    lower: if set, ``lower(r, inputs) -> outputs`` computes device ``r``'s
      outputs from its (relayouted) inputs, instead of a copy of the op (a
      lookup in a table split along its rows, say). With ``communicates``,
      it is called as ``lower(r, inputs, comm)``: ``comm.all_reduce(x, op,
      axes)`` sums (or takes the max of) ``x`` over ``axes`` in between, and
      ``comm.all_gather(x, dim, axes)`` concatenates the pieces (every device
      must ask for the same collectives in the same order).
    communicates: ``(kind, axes, why)`` of each collective ``lower`` asks
      ``comm`` for, in order (empty: ``lower`` takes no ``comm``); ``why``
      is what ``repl.explain`` says of it. A fourth entry, if given, is the
      bytes each device sends (a ``permute`` of a halo's rows; without it
      the cost model counts the size of the op's first output's piece).
    once: the op runs on the first device only (an effect that happens once
      per step on one device: a summary written, a line printed, a delta
      added to a variable whose value is the sum of the devices' copies);
      its inputs are still relayouted on every device (the collectives of a
      gather need every device of the group). Nothing may read its outputs.
    attrs: integer attributes to set on every device's copy (a stateful
      random op's seeds, so that every copy draws the same numbers).
    scatter: output index -> ``((dimension, axes), ...)`` (empty: none): of that output's
      partial sums (``reduce``), the ``axes`` are reduce-scattered along
      ``dimension`` instead of all-reduced (its layout splits the dimension
      over them): each device sums only its piece, half the bytes of an
      all-reduce, and the ops after it run on the piece (see
      :func:`scatter_partials`).
    reasons: input index -> why the rule takes that input gathered along a
      dimension it is split over, where it could not keep the split (a
      convolution's halo wider than a tile); ``repl.explain`` adds it to
      the gather's ``why``.
    inside: the collectives placed inside the functions the op calls (a
      loop's condition and body, a branch: each device's copy lowers its
      own, a loop's once per iteration), which the step's plan does not
      hold: ``(where, placeholder record, why)`` of the first device's,
      filled as the op is lowered (``repl.explain`` lists them).
  """

  inputs: list
  outputs: list
  reduce: list = dataclasses.field(default_factory=list)
  consts: dict = dataclasses.field(default_factory=dict)
  fallback: bool = False
  why: str = ""
  values: dict = dataclasses.field(default_factory=dict)
  unsupported: str = ""
  lower: Callable | None = None
  communicates: tuple = ()
  once: bool = False
  attrs: dict = dataclasses.field(default_factory=dict)
  scatter: dict = dataclasses.field(default_factory=dict)
  reasons: dict = dataclasses.field(default_factory=dict)
  inside: list = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if not self.reduce:
      self.reduce = [None] * len(self.outputs)

  def computed(self, index: int):
    """Output ``index``'s layout as the op's copies compute it (before any reduce-scatter).

    A dimension the partial sums are scattered along is split, before the scatter, over the axes before the
    scattered ones (after them, if any: a local slice of the scattered piece, ``scattered``).
    """
    layout = self.outputs[index]
    scattered = dict(self.scatter.get(index, ()))
    if not scattered or layout is None:
      return layout
    return tuple(split[:_start(split, scattered[d])] if d in scattered else split for d, split in enumerate(layout))

  def scattered(self, index: int):
    """Output ``index``'s layout right after its reduce-scatters (the output's, or one it refines by a slice)."""
    layout = self.outputs[index]
    scattered = dict(self.scatter.get(index, ()))
    if not scattered or layout is None:
      return layout
    return tuple(split[:_start(split, scattered[d]) + len(scattered[d])] if d in scattered else split
                 for d, split in enumerate(layout))


def _start(split: tuple, over: tuple) -> int:
  """Where the axes ``over`` start in ``split`` (their run; its length if absent)."""
  split, over = tuple(split), tuple(over)
  return next((i for i in range(len(split)) if split[i:i + len(over)] == over), len(split))


def scatter_partials(view, out: tuple, summed: tuple, index: int = 0) -> tuple[tuple, tuple]:
  """Output layout ``out`` with the axes of its partial sums placed where the consumers want them.

  An op whose output holds partial sums over ``summed`` (a contraction over a
  split dimension) all-reduces them, and every device has the whole result.
  Where the consumers want a dimension of it split over some of those axes
  (the heads of an attention whose output projection takes them split, a
  gradient whose variable is split so), the partials are reduce-scattered
  along it instead: half the bytes, and the ops in between run on a piece.

  Returns:
    ``(layout, scatter)``: the output's layout and ``Decision.scatter``'s
    entry for it (empty: all-reduced as before).
  """
  want = view.want(index)
  if want is None or not summed or len(want) != len(out) or not view.op.outputs[index].dtype.is_floating:
    return out, ()  # integer partials (counts) stay all-reduced
  free = set(summed)
  shape = view.out_shape(index)
  out, scatter = list(out), []
  for d, (have, wanted) in enumerate(zip(out, want)):
    if isinstance(wanted, Merged) or isinstance(have, Merged) or not wanted:
      continue
    extra = tuple(wanted[len(have):])  # a dimension split over the leading axes already: each piece scattered
    # (over the leading ones of the rest that are summed: the others split the pieces further, a local slice)
    extra = extra[:next((i for i, a in enumerate(extra) if a not in free), len(extra))]
    if (tuple(wanted[:len(have)]) == tuple(have) and extra and shape[d] > 0
        and shape[d] % view.shards(tuple(have) + extra) == 0):
      out[d] = tuple(have) + extra
      scatter.append((d, extra))
      free -= set(extra)
  return tuple(out), tuple(scatter)


@dataclasses.dataclass(frozen=True)
class Bodies:
  """How a rule partitions the body of a function its op calls (an ``If``'s branches) and expands it per device.

  The partitioner's own ``propagate`` and ``expand_on_device``
  (``_partition.BODIES``), handed to the rules with each op
  (:attr:`OpView.bodies`): the propagation imports the rules, so the rules do
  not import the partitioner.
  """

  propagate: Callable
  expand_on_device: Callable


@dataclasses.dataclass
class OpView:
  """One op of the global graph, as a rule sees it."""

  op: tf.Operation
  mesh: Any
  wants: list = dataclasses.field(default_factory=list)  # per output: the layout its consumers want, or None
  handle_shapes: dict = dataclasses.field(default_factory=dict)  # resource tensor name -> its variable's shape
  values: Callable = tf.get_static_value  # a tensor's constant value (shape arithmetic folded), or None
  summed: frozenset = frozenset()  # resource tensor names of variables whose value is the sum of their copies
  bodies: Bodies | None = None  # for rules of ops that call functions
  merged_axes: frozenset = frozenset()  # axes of Merged dimensions this position-blind rule sees as plain splits

  def want(self, index: int = 0):
    """The layout all consumers of output ``index`` require (None: no common wish)."""
    return self.wants[index] if index < len(self.wants) else None

  def const(self, index: int) -> np.ndarray | None:
    """The constant value of input ``index`` (a shape operand), or None if not constant."""
    return self.values(self.op.inputs[index])

  def handle_shape(self, index: int) -> list:
    """The global shape of the variable whose handle is input ``index``."""
    return list(self.handle_shapes[self.op.inputs[index].name])

  def is_summed(self, index: int) -> bool:
    """Whether input ``index`` is the handle of a variable whose value is the sum of the devices' copies.

    A ``tf.VariableSynchronization.ON_READ`` variable with ``SUM`` aggregation
    (a metric's total and count, say): each device holds a part, a read sums
    them, and a delta is added to one copy.
    """
    return self.op.inputs[index].name in self.summed

  def in_shape(self, index: int) -> list:
    """Input ``index``'s global shape; a dimension of unknown size is ``UNKNOWN`` (never split)."""
    return _sizes(self.op.inputs[index].shape)

  def out_shape(self, index: int = 0) -> list:
    """Output ``index``'s global shape, as :meth:`in_shape`."""
    return _sizes(self.op.outputs[index].shape)

  def attr(self, name: str):
    return self.op.get_attr(name)

  def shards(self, axes: tuple) -> int:
    return self.mesh.axis_size(axes) if axes else 1

  def local_shape(self, shape, layout, dtype) -> np.ndarray:
    """``shape`` (a global shape) as each device's piece of it in ``layout`` (for a shape operand)."""
    return np.asarray([int(n) // self.shards(axes) for n, axes in zip(shape, layout)], dtype=dtype)

  def offset(self, r: int, axes: tuple, size: int) -> int:
    """Where device ``r``'s piece starts along a dimension of ``size`` split over ``axes``."""
    if self.merged_axes.intersection(axes or ()):
      raise RuntimeError(f"The rule for {self.op.type} asked where a piece of a merged dimension (split over {axes}) "
                         "starts; it has no single offset (a bug: the rule is registered position_blind).")
    return self.mesh.axis_index(r, axes) * (size // self.shards(axes)) if axes else 0


Rule = Callable[[OpView, list], Decision]
_RULES: dict[str, Rule] = {}
_POSITION_BLIND: set = set()


def register(*op_types: str, position_blind: bool = False):
  """Decorator: ``rule`` gives the layouts of ops of ``op_types``.

  ``position_blind``: the rule decides from which axes split which
  dimension, never from where a device's piece sits in the global order (no
  offsets, no positions), and its op treats the rows of a split dimension
  alike (elementwise, a contraction, a sum). Such a rule also sees a
  :class:`Merged` dimension, as split over its axes; other rules see it whole
  (its pieces gathered first).
  """
  def decorate(rule: Rule) -> Rule:
    for t in op_types:
      _RULES[t] = rule
      if position_blind:
        _POSITION_BLIND.add(t)
    return rule
  return decorate


def get(op_type: str) -> Rule | None:
  return _RULES.get(op_type)


def position_blind(op_type: str) -> bool:
  """Whether the rule for ``op_type`` was registered ``position_blind`` (see :func:`register`)."""
  return op_type in _POSITION_BLIND


class Merged(tuple):
  """A dimension merged from several by a reshape (``[batch, seq, d]`` into rows ``[batch * seq, d]``), split as they were.

  As a layout entry it is the mesh axes the dimension is split over (every
  part's, in order), like any split; ``parts`` are the merged dimensions'
  ``(size, axes)``. A device holds, of each part, its block, so its piece of
  the merged dimension is those blocks merged: not one contiguous block of
  the dimension, as a plain split's piece is, unless only the first part is
  split (then the reshape gives a plain split). Rows of tokens split over a
  ``"seq"`` axis stay split through a ``Dense`` layer (reshape, matmul,
  reshape back) this way, instead of being gathered.

  Position-blind rules (:func:`register`) see it as its axes; a reshape
  that splits the parts out again gives them back their axes; anything else
  gathers it (all-gather, then the blocks put in order).
  """

  def __new__(cls, parts):
    parts = tuple((int(n), tuple(axes)) for n, axes in parts)
    self = super().__new__(cls, tuple(a for _, axes in parts for a in axes))
    self.parts = parts
    return self

  def __eq__(self, other):
    return isinstance(other, Merged) and self.parts == other.parts

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    return hash(("merged", self.parts))

  def __reduce__(self):
    return (Merged, (self.parts,))

  def __repr__(self):
    return "merged(" + " x ".join(f"{n}/{'*'.join(axes)}" if axes else str(n) for n, axes in self.parts) + ")"

  @property
  def size(self) -> int:
    """The merged dimension's global size."""
    return int(np.prod([n for n, _ in self.parts]))


def merge(parts, shards: Callable) -> tuple:
  """The split of a dimension merged from ``parts`` (``(size, axes)`` each): a :class:`Merged`, or plain axes.

  Plain where each device's piece is one contiguous block, in the order of
  its axes: no split part after a part whose blocks hold more than one row
  (``[batch, seq]`` with the batch alone split; a leading dimension of size
  1). ``shards(axes)``: the number of devices along ``axes``.
  """
  parts = [(int(n), tuple(axes)) for n, axes in parts]
  wide = False  # a part before this one has blocks of more than one row
  for n, axes in parts:
    if axes and wide:
      return Merged(parts)
    if n // (shards(axes) if axes else 1) > 1:
      wide = True
  return tuple(a for _, axes in parts for a in axes)


class Pending(tuple):
  """The layout of partial sums not summed yet: each device's copy holds its part, over the axes ``summed``.

  A contraction over a split dimension whose only reader is a ``Sum`` (a
  kernel's gradient broadcast over the batch, ``[batch, in, out]``, its
  sequence split) leaves its partial sums to that sum, which sums them with
  its own: one all-reduce of the sum's result, not one of the contraction's
  (a batch of them) first.
  """

  def __new__(cls, layout, summed):
    self = super().__new__(cls, tuple(layout))
    self.summed = tuple(summed)
    return self

  def __eq__(self, other):
    return isinstance(other, Pending) and tuple(self) == tuple(other) and self.summed == other.summed

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    return hash(("pending", tuple(self), self.summed))

  def __reduce__(self):
    return (Pending, (tuple(self), self.summed))


def unmerged(layout):
  """``layout`` with each :class:`Merged` dimension whole (what a rule that is not position-blind sees)."""
  if layout is None or isinstance(layout, Contents) or not any(isinstance(e, Merged) for e in layout):
    return layout
  return tuple(() if isinstance(e, Merged) else e for e in layout)


def merged_in(layouts) -> list:
  """The :class:`Merged` entries of ``layouts`` (layouts or None)."""
  return [e for layout in layouts if layout is not None and not isinstance(layout, Contents)
          for e in layout if isinstance(e, Merged)]


def covered() -> tuple[str, ...]:
  """The op types with a rule, sorted."""
  return tuple(sorted(_RULES))


def with_wanted(layout: TensorLayout, want: TensorLayout | None) -> TensorLayout:
  """``layout``, with the dimensions it leaves whole split as ``want`` splits them (axes used once).

  A dimension ``want`` splits further than ``layout`` (``("batch",)`` wanted ``("batch", "model")``) is split so
  too: each piece is a part of the block held (a local slice).
  """
  if want is None or len(want) != len(layout):
    return layout
  used = {a for axes in layout for a in axes}
  out = []
  for have, wish in zip(layout, want):
    extra = tuple(wish[len(have):]) if wish and not isinstance(wish, Merged) and not isinstance(have, Merged) and (
        tuple(wish[:len(have)]) == tuple(have)) else ()
    if extra and used.isdisjoint(extra):
      out.append(tuple(wish))
      used.update(extra)
    else:
      out.append(have)
  return tuple(out)


def axes_in(layout) -> set:
  """The mesh axes ``layout`` splits any dimension over."""
  return {a for axes in layout for a in axes} if layout else set()


def keep(layout: TensorLayout, dims) -> TensorLayout:
  """``layout`` with every dimension not in ``dims`` made whole."""
  return tuple(axes if d in dims else () for d, axes in enumerate(layout))


class Contents(tuple):
  """The layout of a variant tensor: the layouts of the tensors it holds (an ``Optional``'s components).

  ``Contents(())``: holds nothing known (``OptionalNone``). A ``tf.cond`` under a
  gradient tape returns its branches' intermediates as optionals.
  """


def holds_split(contents) -> bool:
  for layout in contents:
    if isinstance(layout, Contents):
      if holds_split(layout):
        return True
    elif layout is not None and any(layout):
      return True
  return False


def replicated(rank: int | None) -> TensorLayout | None:
  return None if rank is None else ((),) * rank


def rank_of(t: tf.Tensor) -> int | None:
  if t.dtype == tf.resource or t.dtype == tf.variant:
    return None
  return t.shape.rank


def fallback(view: OpView, layouts: list) -> Decision:
  """No rule: every input gathered to replicated, every output replicated."""
  op = view.op
  split = any(layout is not None and any(layout) for layout in layouts)
  unsupported = ""
  if any(t.dtype == tf.resource and layout is not None and any(layout) for t, layout in zip(op.inputs, layouts)):
    # A whole value cannot be gathered for a variable's handle: each device holds its piece.
    unsupported = "it takes the handle of a sharded variable, and no rule says how to use its pieces"
  elif any(isinstance(layout, Contents) and holds_split(layout) for layout in layouts):
    # Nor for a variant holding pieces (a tf.cond's intermediates, kept for its gradient).
    unsupported = "it takes a variant (an optional) holding split values, and no rule says how to use them"
  elif any(t.dtype == tf.resource and t.name in view.summed for t in op.inputs):
    # Nor for a metric's state: each device holds a part of its value.
    unsupported = ("it takes the handle of a variable whose value is the sum of the devices' parts (a metric's "
                   "state), and no rule says how to use them")
  else:
    once, unsupported = _copied_whole(view)
    if once:
      return Decision(inputs=[replicated(rank_of(t)) for t in op.inputs],
                      outputs=[replicated(rank_of(t)) for t in op.outputs], fallback=split, once=True)
  return Decision(inputs=[replicated(rank_of(t)) for t in op.inputs],
                  outputs=[replicated(rank_of(t)) for t in op.outputs], fallback=split,
                  unsupported=unsupported)


def _copied_whole(view: OpView) -> tuple[bool, str]:
  """What running a fallback's functions (a ``tf.cond``'s branches) on every device would repeat.

  Returns ``(once, unsupported)``: effects (summaries, prints) happen once
  per step on one device, so an op without outputs that has them runs on the
  first device only; with outputs it is refused; so are unseeded stateful
  random draws, which every device's copy would make differently.
  """
  from rewrite import _functions  # pylint: disable=import-outside-toplevel  (private TF, isolated there)
  nodes = _functions.nested_nodes(view.op)
  if any(n.op in _op_kinds.STATEFUL_RANDOM and not n.attr["seed"].i and not n.attr["seed2"].i for n in nodes):
    return False, ("its functions draw random numbers without a seed, and every device's copy would draw its own "
                   "(seed them: tf.random.set_seed(...) before the step is built, or seed=... on the op)")
  if any(n.op in _op_kinds.EFFECTS for n in nodes):
    if any(_used(t) for t in view.op.outputs):
      return False, ("its functions write summaries or print, and its outputs are used: every device's copy would "
                     "write them (move the tf.summary or tf.print out of it)")
    return True, ""
  return False, ""


def _used(t: tf.Tensor) -> bool:
  """Whether anything but Identity ops leading nowhere reads ``t`` (AutoGraph's ``if`` returns a dummy)."""
  outputs = {x.name for x in getattr(t.graph, "outputs", ())}
  stack = [t]
  while stack:
    x = stack.pop()
    if x.name in outputs:
      return True
    for consumer in x.consumers():
      if consumer.type != "Identity":
        return True
      stack.extend(consumer.outputs)
  return False
