"""Communication primitives: placeholders while tracing, differentiable by construction.

Each primitive converts its (nest of) input tensors and, for every tensor,
leaves a placeholder node in the replica's subgraph via :func:`rewrite.emit`.
The gradient of a primitive is itself written with primitives, so the
backward pass's communication also goes through placeholders and the rewrite.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
import weakref

import tensorflow as tf
import tree

import rewrite
from replicator.core import _context
from replicator.core import _errors
from replicator.core import _gradient_registry

REDUCE_OPS = ("sum", "mean", "max", "min")

SPARSE_REDUCE_OP = (
    "repl.all_reduce(op={op!r}) got a tf.IndexedSlices at {location}. Sparse values are reduced by "
    "\"sum\" or \"mean\" (their rows are gathered: the result is IndexedSlices); {op} of the "
    "implicit zeros is not defined row by row. Fix: use op=\"sum\"/\"mean\", or reduce a dense "
    "tensor (tf.convert_to_tensor(slices))."
)

ALL_GATHER_INT_AXIS = (
    "repl.all_gather(x, axis={axis!r}): `axis` names mesh axes, as for every collective (an axis "
    "name of {names}, a tuple of them, or None for all), but found the int {axis!r}. The tensor "
    "dimension to concatenate along is `concat_dimension`. Fix: repl.all_gather(x, concat_dimension={axis!r})."
)

_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules[__name__.split(".")[0]], rewrite, tf, tree))
_AUTOGRAPH_MAPS: dict[str, dict] = {}


def register_source_map(converted_fn) -> None:
  """Remembers an autograph-converted function's source map, to name user lines."""
  source_map = getattr(converted_fn, "ag_source_map", None)
  if source_map:
    for loc in source_map:
      _AUTOGRAPH_MAPS.setdefault(loc.filename, {})[loc.lineno] = source_map[loc]


def user_location() -> str:
  """'file.py:12 in step_fn' for the innermost frame of user code."""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    where = _user_frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
    if where is not None:
      return where
    frame = frame.f_back
  return "<unknown location>"


def user_stacklevel() -> int:
  """``warnings.warn``'s ``stacklevel``, for the function calling this one, that points at user code."""
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None:
    if _user_frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name) is not None:
      return level
    frame, level = frame.f_back, level + 1
  return 1


def _user_frame(filename: str, lineno: int, name: str) -> str | None:
  """'file.py:12 in fn' if the frame is user code (autograph's generated code mapped back), else None."""
  if "__autograph_generated" in filename:
    origin = _AUTOGRAPH_MAPS.get(filename, {}).get(lineno)
    if origin is None:
      return None
    return f"{origin.loc.filename}:{origin.loc.lineno} in {origin.function_name or '<lambda>'}"
  if filename.startswith(_INTERNAL_DIRS) or "/keras/" in filename or "<frozen" in filename:
    return None
  return f"{filename}:{lineno} in {name}"


_NOTES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> [(name scope, note)]


@contextlib.contextmanager
def noted(note: str, name: str = "noted"):
  """Ops made inside carry ``note`` where ``explain`` names the line that made them (:func:`location_of`).

  For a choice the library made for them that the line does not show (ring attention taking the all-gather
  across processes).
  """
  with tf.name_scope(name) as scope:
    graph = tf.compat.v1.get_default_graph()
    _NOTES.setdefault(graph, []).append((scope, note))
    yield


def location_of(op: tf.Operation) -> str:
  """Where user code created ``op`` ("file.py:12 in step_fn"), from its traceback, with its :func:`noted` note."""
  where = "<unknown location>"
  for frame in reversed(op.traceback):
    found = _user_frame(frame.filename, frame.lineno, frame.name)
    if found is not None:
      where = found
      break
  for scope, note in _NOTES.get(op.graph, ()):
    if op.name.startswith(scope):
      return f"{where} ({note})"
  return where


def require_context(replicator, name: str, extra: str = "") -> _context.ReplicaContext:
  """The current replica context of ``replicator``, or a clear error."""
  ctx = _context.current_context()
  if ctx is None:
    raise _errors.ReplicaContextError(_errors.NO_REPLICA_CONTEXT.format(name=name, extra=extra))
  if ctx.replicator is not replicator:
    raise _errors.ReplicaContextError(_errors.OTHER_REPLICATOR.format(
        name=name, devices=list(ctx.replicator.devices)))
  return ctx


def _check_graph(ctx: _context.ReplicaContext, name: str, location: str) -> None:
  graph = tf.compat.v1.get_default_graph()
  if graph is not ctx.graph:
    raise _errors.CollectiveInControlFlowError(_errors.IN_CONTROL_FLOW.format(
        name=name, graph=getattr(graph, "name", type(graph).__name__), location=location))


def _leaves(x, name: str, keep_slices: bool = False):
  flat = tree.flatten(x)
  tensors = []
  for leaf in flat:
    if isinstance(leaf, tf.IndexedSlices):
      if keep_slices:
        tensors.append(leaf)
        continue
      leaf = tf.convert_to_tensor(leaf)
    try:
      tensors.append(tf.convert_to_tensor(leaf))
    except (TypeError, ValueError) as e:
      raise _errors.ArgumentTypeError(f"repl.{name}() takes a nest of tensors, but one leaf is {leaf!r} "
                      f"({type(leaf).__name__}), which is not convertible to a tensor.") from e
  return tensors


def _emit(ctx, kind, x, params, axes, result_shape, location, call):
  if x.op.type == "Placeholder" and any(p.node == x.op.name for p in ctx.placeholders):
    # The input is an earlier collective's placeholder (say, in the gradient of
    # chained collectives). The rewrite removes that node, so read it through
    # an identity that the rewrite rewires like any other consumer.
    x = tf.identity(x)
  y, record = rewrite.emit(
      x, replica=ctx.replica_id, index=len(ctx.placeholders), kind=kind, params=params,
      axes=axes, result_shape=result_shape, device=ctx.device, location=location, call=call)
  ctx.placeholders.append(record)
  if ctx.analysis is not None:
    ctx.analysis.collective(kind, x, y, axes)
  return y


def _differentiable(ctx, forward, x):
  """Applies forward(x) -> (y, grad_fn) with a custom gradient, for float tensors."""
  if not (x.dtype.is_floating or x.dtype.is_complex):
    y, _ = forward(x)
    return y

  @tf.custom_gradient
  def op(t):
    return forward(t)

  y = op(x)
  name = _gradient_registry.gradient_name(y)
  if name:
    ctx.gradient_names.append(name)
  return y


def _call(ctx, name: str, location: str, x, one, keep_slices: bool = False):
  """Runs ``one(leaf_tensor, call_description)`` for every leaf of nest ``x``.

  ``IndexedSlices`` leaves are converted to dense tensors, or with
  ``keep_slices`` handed to ``one`` as they are.
  """
  _check_graph(ctx, name, location)
  leaves = _leaves(x, name, keep_slices)
  ctx.calls += 1
  call = f"call {ctx.calls - 1}"
  results = [one(t, call if len(leaves) == 1 else f"{call}, tensor {i} of {len(leaves)}")
             for i, t in enumerate(leaves)]
  return tree.unflatten_as(x, results)


def all_reduce(ctx, x, op: str, axes: tuple[str, ...], location: str):
  """Elementwise reduction over the replicas of ``axes``; every replica gets the result.

  An ``IndexedSlices`` leaf (op "sum" or "mean") stays sparse: see :func:`sparse_sum`.
  """
  if op not in REDUCE_OPS:
    raise _errors.ArgumentError(f"repl.all_reduce(op={op!r}): op must be one of {REDUCE_OPS}.")

  def one(t, call):
    if isinstance(t, tf.IndexedSlices):
      if op not in ("sum", "mean"):
        raise _errors.ArgumentTypeError(SPARSE_REDUCE_OP.format(op=op, location=location))
      return _sparse_sum_leaf(ctx, t, axes, location, call, mean=op == "mean")
    if t.dtype == tf.bool or t.dtype == tf.string:
      raise _errors.ArgumentTypeError(f"repl.all_reduce() needs numeric tensors, found {t.dtype.name} at {location}. "
                      "Fix: cast to a number first (e.g. tf.cast(x, tf.int32)).")
    if t.dtype.is_complex and op in ("max", "min"):
      raise _errors.ArgumentTypeError(
          f"repl.all_reduce(op={op!r}) of a {t.dtype.name} tensor at {location}: {op} is defined on real numbers, "
          f"not complex ones. Fix: reduce the parts you order by (tf.math.real, tf.math.imag or tf.abs) with "
          f"op={op!r}, or use op='sum' or 'mean', which complex tensors take.")
    return _differentiable(ctx, lambda u: _reduce_with_grad(ctx, u, op, axes, location, call), t)

  return _call(ctx, "all_reduce", location, x, one, keep_slices=True)


def sparse_sum(ctx, x, axes: tuple[str, ...], location: str, scale: float = 1.0):
  """The sum over the group of ``IndexedSlices`` (a nest of them), as ``IndexedSlices``.

  The sum of sparse values is the concatenation of their rows: every member
  gets every member's ``values`` and ``indices``, gathered in group order
  (members may hold different numbers of rows), so on a batch split in
  group order the rows come in the order one device would have them. Values
  are multiplied by ``scale``. ``dense_shape`` is the member's own.
  """
  return _call(ctx, "all_reduce", location, x,
               lambda t, call: _sparse_sum_leaf(ctx, t, axes, location, call, scale=scale), keep_slices=True)


def sparse_gradient_sum(ctx, t: tf.IndexedSlices, batch_axes: tuple[str, ...], copy_axes: tuple[str, ...],
                        location: str, scale: float = 1.0) -> tf.IndexedSlices:
  """The sum of a sparse gradient over ``batch_axes + copy_axes``, with the rows one device would have.

  Devices that differ only along ``copy_axes`` (non-batch axes) see the same
  batch shard, so their rows are the same tokens, in the same order: the
  whole rows (a replicated table used the same way) or pieces of them (each
  device used its own columns). Concatenating them, as :func:`sparse_sum`
  does, gives one device's gradient as a dense sum but counts each token
  ``len(copies)`` times, which changes optimizers that treat a row's slices
  one by one (Keras Adam's second moment). So the copies' rows are gathered
  and, when their indices agree position by position (checked at run time,
  without communication), summed slice by slice; otherwise (each copy looked
  up different tokens, e.g. a sequence split) they stay concatenated. The
  result is then gathered over ``batch_axes`` like :func:`sparse_sum`.
  Needs the rows' count to be static; else everything is concatenated.
  """
  ctx.calls += 1
  call = f"call {ctx.calls - 1}"
  n = t.values.shape[0]
  if copy_axes and n is not None:
    k = ctx.replicator.mesh.axis_size(copy_axes)
    values = _all_gather_leaf(ctx, t.values, 0, copy_axes, location, f"{call}, values of the copies")
    indices = _all_gather_leaf(ctx, t.indices, 0, copy_axes, location, f"{call}, indices of the copies")
    by_copy = tf.reshape(indices, [k, n])
    aligned = tf.reduce_all(tf.equal(by_copy, by_copy[:1]))
    # Aligned: copy 0's positions hold the slice sums and the rest is dropped; else all rows stay.
    # (A mask, not a tf.cond: the step's graph is imported into the run's functions.)
    summed = tf.reduce_sum(tf.reshape(values, tf.concat([[k, n], tf.shape(values)[1:]], 0)), axis=0)
    summed = tf.concat([summed, tf.zeros_like(values[n:])], axis=0)
    keep = tf.concat([tf.ones([n], tf.bool), tf.fill([(k - 1) * n], tf.logical_not(aligned))], axis=0)
    t = tf.IndexedSlices(tf.boolean_mask(tf.where(aligned, summed, values), keep), tf.boolean_mask(indices, keep),
                         t.dense_shape)
  elif copy_axes:
    batch_axes = tuple(batch_axes) + tuple(copy_axes)
  if not batch_axes:
    return t if scale == 1.0 else tf.IndexedSlices(t.values * tf.cast(scale, t.values.dtype), t.indices,
                                                   t.dense_shape)
  return _sparse_sum_leaf(ctx, t, tuple(batch_axes), location, call, scale=scale)


def _sparse_sum_leaf(ctx, t, axes, location, call, mean: bool = False, scale: float = 1.0):
  if not isinstance(t, tf.IndexedSlices):
    raise _errors.ArgumentTypeError(f"A sparse reduction takes tf.IndexedSlices, found {type(t).__name__} at {location}.")
  values = _all_gather_leaf(ctx, t.values, 0, axes, location, f"{call}, values", ragged=True)
  indices = _all_gather_leaf(ctx, t.indices, 0, axes, location, f"{call}, indices", ragged=True)
  if mean:
    scale = scale / ctx.replicator.mesh.axis_size(axes)
  if scale != 1.0:
    values = values * tf.cast(scale, values.dtype)
  return tf.IndexedSlices(values, indices, t.dense_shape)


def _reduce_leaf(ctx, t, op, axes, location, call):
  return _emit(ctx, "all_reduce", t, {"op": op}, axes, t.shape, location, call)


def reduce_for(ctx, tensors: list[tf.Tensor], op: str, axes: tuple[str, ...], member: int,
               location: str) -> list[tf.Tensor]:
  """All-reduces dense ``tensors`` whose result only group member ``member`` uses.

  Every member still gets the result (the collective is an all-reduce), but
  the lowering within one process reduces on ``member``'s device, so the
  copies the others do not read are pruned. For the sharded update's
  gradients, which only their owner applies. Not differentiable.
  """
  return _call(ctx, "all_reduce", location, list(tensors),
               lambda t, call: _emit(ctx, "all_reduce", t, {"op": op, "root": member}, axes, t.shape, location, call))


def _reduce_with_grad(ctx, t, op, axes, location, call):
  y = _reduce_leaf(ctx, t, op, axes, location, call)

  def grad(dy):
    where = f"gradient of all_reduce({op}) at {location}"
    if op in ("sum", "mean"):
      return _reduce_leaf(ctx, dy, op, axes, where, call)
    # max/min: the upstream gradients of all replicas flow to the replicas
    # holding the extreme value, shared equally between ties.
    mask = tf.cast(tf.equal(t, y), dy.dtype)
    total = _reduce_leaf(ctx, dy, "sum", axes, where, call)
    ties = _reduce_leaf(ctx, mask, "sum", axes, where, call)
    return mask * total / ties

  return y, grad


def broadcast(ctx, x, source: int, axes: tuple[str, ...], location: str):
  """Every replica of the group gets the value of group member ``source``."""
  size = ctx.replicator.mesh.axis_size(axes)
  if not isinstance(source, int) or not 0 <= source < size:
    raise _errors.ArgumentError(f"repl.broadcast(source={source!r}): source must be a replica index in "
                     f"[0, {size}) (the group along axes {axes} has {size} replicas).")
  position = ctx.replicator.mesh.axis_index(ctx.replica_id, axes)

  def one(t, call):
    def forward(u):
      y = _emit(ctx, "broadcast", u, {"source": source}, axes, u.shape, location, call)

      def grad(dy):
        total = _reduce_leaf(ctx, dy, "sum", axes, f"gradient of broadcast at {location}", call)
        return total if position == source else tf.zeros_like(total)

      return y, grad

    return _differentiable(ctx, forward, t)

  return _call(ctx, "broadcast", location, x, one)


def _group_str(axes: tuple[str, ...], size: int) -> str:
  where = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"
  return f"the {size} replica(s) of each group along {where}"


def _dimension(name: str, param: str, value, t: tf.Tensor, location: str) -> int:
  """Checks tensor dimension ``value`` of ``t`` for ``repl.name(param=value)``; returns it >= 0."""
  rank = t.shape.rank
  if rank is None or rank == 0:
    raise _errors.ArgumentError(f"repl.{name}() needs tensors of known rank >= 1, found shape {t.shape} "
                     f"at {location}. Fix: reshape scalars to [1] first (tf.reshape(x, [1])).")
  if not isinstance(value, int) or isinstance(value, bool):
    raise _errors.ArgumentTypeError(f"repl.{name}({param}={value!r}): {param} must be an int (a tensor dimension), "
                    f"found {type(value).__name__}.")
  if not -rank <= value < rank:
    raise _errors.ArgumentError(f"repl.{name}({param}={value}) is out of range for a tensor of rank {rank} "
                     f"(shape {t.shape}) at {location}. Fix: pass a dimension in [{-rank}, {rank}).")
  return value % rank


def _check_divisible(name: str, param: str, dim: int, t: tf.Tensor, axes, size: int, location: str) -> None:
  """The static size of dimension ``dim`` of ``t`` must be a multiple of the group size."""
  length = t.shape[dim]
  if length is None:
    raise _errors.ArgumentError(
        f"repl.{name}({param}={dim}) splits dimension {dim} of a {t.dtype.name} tensor of shape "
        f"{t.shape} among {_group_str(axes, size)}, but that dimension has no static size at "
        f"{location}. Fix: give it a static size (e.g. tf.ensure_shape), or split another dimension.")
  if length % size:
    raise _errors.ArgumentError(
        f"repl.{name}({param}={dim}) splits dimension {dim} (of size {length}) of a {t.dtype.name} "
        f"tensor of shape {t.shape} among {_group_str(axes, size)}, but {size} does not evenly "
        f"divide {length} at {location}. Fix: pad dimension {dim} to a multiple of {size} "
        f"(e.g. {-(-length // size) * size}), or split another dimension.")


def _resized(shape: tf.TensorShape, dim: int, multiply: int = 1, divide: int = 1) -> tf.TensorShape:
  dims = shape.as_list()
  dims[dim] = None if dims[dim] is None else dims[dim] * multiply // divide
  return tf.TensorShape(dims)


def _gather_leaf(ctx, t, dim, axes, location, call, ragged: bool = False):
  """An all_gather placeholder; ``ragged``: members may differ in size along ``dim``."""
  if ragged:
    shape = tf.TensorShape([None if d == dim else n for d, n in enumerate(t.shape.as_list())])
    return _emit(ctx, "all_gather", t, {"concat_dimension": dim, "ragged": True}, axes, shape, location, call)
  size = ctx.replicator.mesh.axis_size(axes)
  return _emit(ctx, "all_gather", t, {"concat_dimension": dim}, axes, _resized(t.shape, dim, size),
               location, call)


def _all_gather_leaf(ctx, t, dim, axes, location, call, ragged: bool = False):
  """Differentiable all_gather of one tensor; ragged if asked or if ``dim`` has no static size."""
  position = ctx.replicator.mesh.axis_index(ctx.replica_id, axes)
  ragged = ragged or t.shape[dim] is None

  def forward(u):
    y = _gather_leaf(ctx, u, dim, axes, location, call, ragged)

    def grad(dy):
      where = f"gradient of all_gather at {location}"
      total = _reduce_leaf(ctx, dy, "sum", axes, where, call)
      if ragged:  # this member's rows start after those of the members before it
        sizes = _gather_leaf(ctx, tf.shape(u)[dim:dim + 1], 0, axes, where, call)
        start, n = tf.reduce_sum(sizes[:position]), sizes[position]
      else:
        n = tf.shape(u)[dim]
        start = position * n
      return tf.gather(total, tf.range(start, start + n), axis=dim)

    return y, grad

  return _differentiable(ctx, forward, t)


def all_gather(ctx, x, concat_dimension: int, axes: tuple[str, ...], location: str):
  """Concatenates the group's tensors along tensor dimension ``concat_dimension``.

  Members may differ in size along that dimension if it has no static size
  (a batch dimension, say): the gather is then *ragged*.
  """

  def one(t, call):
    dim = _dimension("all_gather", "concat_dimension", concat_dimension, t, location)
    return _all_gather_leaf(ctx, t, dim, axes, location, call)

  return _call(ctx, "all_gather", location, x, one)


def _reduce_scatter_leaf(ctx, t, op, dim, axes, location, call):
  size = ctx.replicator.mesh.axis_size(axes)
  return _emit(ctx, "reduce_scatter", t, {"op": op, "scatter_dimension": dim}, axes,
               _resized(t.shape, dim, divide=size), location, call)


def reduce_scatter(ctx, x, op: str, scatter_dimension: int, axes: tuple[str, ...], location: str):
  """Reduces over the group; group member i gets chunk i of the result along ``scatter_dimension``."""
  if op not in REDUCE_OPS:
    raise _errors.ArgumentError(f"repl.reduce_scatter(op={op!r}): op must be one of {REDUCE_OPS}.")
  size = ctx.replicator.mesh.axis_size(axes)

  def one(t, call):
    if t.dtype == tf.bool or t.dtype == tf.string:
      raise _errors.ArgumentTypeError(f"repl.reduce_scatter() needs numeric tensors, found {t.dtype.name} at {location}. "
                      "Fix: cast to a number first (e.g. tf.cast(x, tf.int32)).")
    dim = _dimension("reduce_scatter", "scatter_dimension", scatter_dimension, t, location)
    _check_divisible("reduce_scatter", "scatter_dimension", dim, t, axes, size, location)

    def forward(u):
      y = _reduce_scatter_leaf(ctx, u, op, dim, axes, location, call)

      def grad(dy):
        # Every member's input reaches every chunk: the gradient of the full
        # reduction is the members' upstream chunks gathered in group order.
        where = f"gradient of reduce_scatter({op}) at {location}"
        full_dy = _gather_leaf(ctx, dy, dim, axes, where, call)
        if op == "sum":
          return full_dy
        if op == "mean":
          return full_dy / tf.cast(size, dy.dtype)
        # max/min, as all_reduce: to the members holding the extreme value, split between ties.
        mask = tf.cast(tf.equal(u, _gather_leaf(ctx, y, dim, axes, where, call)), dy.dtype)
        ties = _reduce_leaf(ctx, mask, "sum", axes, where, call)
        return mask * full_dy / ties

      return y, grad

    return _differentiable(ctx, forward, t)

  return _call(ctx, "reduce_scatter", location, x, one)


def _all_to_all_leaf(ctx, t, split, concat, axes, location, call):
  size = ctx.replicator.mesh.axis_size(axes)
  shape = _resized(_resized(t.shape, split, divide=size), concat, multiply=size)
  return _emit(ctx, "all_to_all", t, {"split_dimension": split, "concat_dimension": concat}, axes,
               shape, location, call)


def all_to_all(ctx, x, split_dimension: int, concat_dimension: int, axes: tuple[str, ...], location: str):
  """Member i sends chunk j (along ``split_dimension``) to member j, which concatenates what it gets."""
  size = ctx.replicator.mesh.axis_size(axes)

  def one(t, call):
    split = _dimension("all_to_all", "split_dimension", split_dimension, t, location)
    concat = _dimension("all_to_all", "concat_dimension", concat_dimension, t, location)
    _check_divisible("all_to_all", "split_dimension", split, t, axes, size, location)

    def forward(u):
      y = _all_to_all_leaf(ctx, u, split, concat, axes, location, call)

      def grad(dy):  # the inverse exchange: split where the forward concatenated, and back
        return _all_to_all_leaf(ctx, dy, concat, split, axes, f"gradient of all_to_all at {location}", call)

      return y, grad

    return _differentiable(ctx, forward, t)

  return _call(ctx, "all_to_all", location, x, one)


def _check_perm(perm, size: int, axes) -> tuple[tuple[int, int], ...]:
  """``perm`` as sorted (source, destination) pairs, or a clear error."""
  try:
    pairs = tuple((s, d) for s, d in perm)
  except (TypeError, ValueError):
    pairs = None
  if pairs is None or not all(isinstance(p, numbers.Integral) and not isinstance(p, bool)
                              for pair in pairs for p in pair):
    raise _errors.ArgumentTypeError(f"repl.permute(perm={perm!r}): perm must be a list of (source, destination) "
                    "pairs of group positions (ints), e.g. [(0, 1), (1, 0)].")
  pairs = tuple((int(s), int(d)) for s, d in pairs)
  for s, d in pairs:
    if not (0 <= s < size and 0 <= d < size):
      raise _errors.ArgumentError(f"repl.permute(perm={perm!r}): the pair ({s}, {d}) names a position outside "
                       f"[0, {size}) ({_group_str(axes, size)}). Fix: use group positions "
                       f"0..{size - 1} (see repl.axis_index).")
  for which, index in (("source", 0), ("destination", 1)):
    positions = [pair[index] for pair in pairs]
    repeated = sorted({p for p in positions if positions.count(p) > 1})
    if repeated:
      raise _errors.ArgumentError(f"repl.permute(perm={perm!r}): {which} position(s) {repeated} appear more than "
                       f"once. Each member sends to at most one destination and receives from at "
                       f"most one source. Fix: list each {which} once (use several permute calls "
                       f"or repl.all_gather to send one value to several members).")
  return tuple(sorted(pairs))


def _permute_leaf(ctx, t, pairs, axes, location, call):
  return _emit(ctx, "permute", t, {"perm": pairs}, axes, t.shape, location, call)


def permute(ctx, x, perm, axes: tuple[str, ...], location: str, differentiable: bool = True):
  """Group member ``destination`` gets member ``source``'s value; others get zeros.

  ``differentiable=False``: no gradient (a pipeline sends its gradients itself); nothing ties the result to the
  input for a gradient function.
  """
  pairs = _check_perm(perm, ctx.replicator.mesh.axis_size(axes), axes)
  inverse = tuple(sorted((d, s) for s, d in pairs))

  def one(t, call):
    if not differentiable:
      return _permute_leaf(ctx, t, pairs, axes, location, call)

    def forward(u):
      y = _permute_leaf(ctx, u, pairs, axes, location, call)

      def grad(dy):  # each source gets its destination's upstream gradient
        return _permute_leaf(ctx, dy, inverse, axes, f"gradient of permute at {location}", call)

      return y, grad

    return _differentiable(ctx, forward, t)

  return _call(ctx, "permute", location, x, one)


def axis_index(ctx, axes: tuple[str, ...]) -> tf.Tensor:
  """This replica's position within its group along ``axes``: an int32 constant."""
  index = tf.constant(ctx.replicator.mesh.axis_index(ctx.replica_id, axes), tf.int32)
  if ctx.analysis is not None:
    ctx.analysis.set(index, axes)  # a constant of the trace, but a different one on each replica
  return index
