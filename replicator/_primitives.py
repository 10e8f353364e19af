"""Communication primitives: placeholders while tracing, differentiable by construction.

Each primitive converts its (nest of) input tensors and, for every tensor,
leaves a placeholder node in the replica's subgraph via :func:`rewrite.emit`.
The gradient of a primitive is itself written with primitives, so the
backward pass's communication also goes through placeholders and the rewrite.
"""

from __future__ import annotations

import os
import sys

import tensorflow as tf
import tree

import rewrite
from replicator import _context
from replicator import _errors
from replicator import _gradient_registry

REDUCE_OPS = ("sum", "mean", "max", "min")

_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules[__name__.rsplit(".", 1)[0]], rewrite, tf, tree))
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
    filename = frame.f_code.co_filename
    if "__autograph_generated" in filename:
      origin = _AUTOGRAPH_MAPS.get(filename, {}).get(frame.f_lineno)
      if origin is not None:
        return f"{origin.loc.filename}:{origin.loc.lineno} in {origin.function_name}"
    elif not filename.startswith(_INTERNAL_DIRS) and "/keras/" not in filename and "<frozen" not in filename:
      return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    frame = frame.f_back
  return "<unknown location>"


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


def _leaves(x, name: str):
  flat = tree.flatten(x)
  tensors = []
  for leaf in flat:
    if isinstance(leaf, tf.IndexedSlices):
      leaf = tf.convert_to_tensor(leaf)
    try:
      tensors.append(tf.convert_to_tensor(leaf))
    except (TypeError, ValueError) as e:
      raise TypeError(f"repl.{name}() takes a nest of tensors, but one leaf is {leaf!r} "
                      f"({type(leaf).__name__}), which is not convertible to a tensor.") from e
  return tensors


def _emit(ctx, kind, x, params, axes, result_shape, location, call):
  y, record = rewrite.emit(
      x, replica=ctx.replica_id, index=len(ctx.placeholders), kind=kind, params=params,
      axes=axes, result_shape=result_shape, device=ctx.device, location=location, call=call)
  ctx.placeholders.append(record)
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


def _call(ctx, name: str, location: str, x, one):
  """Runs ``one(leaf_tensor, call_description)`` for every leaf of nest ``x``."""
  _check_graph(ctx, name, location)
  leaves = _leaves(x, name)
  ctx.calls += 1
  call = f"call {ctx.calls - 1}"
  results = [one(t, call if len(leaves) == 1 else f"{call}, tensor {i} of {len(leaves)}")
             for i, t in enumerate(leaves)]
  return tree.unflatten_as(x, results)


def all_reduce(ctx, x, op: str, axes: tuple[str, ...], location: str):
  """Elementwise reduction over the replicas of ``axes``; every replica gets the result."""
  if op not in REDUCE_OPS:
    raise ValueError(f"repl.all_reduce(op={op!r}): op must be one of {REDUCE_OPS}.")

  def one(t, call):
    if t.dtype == tf.bool or t.dtype == tf.string:
      raise TypeError(f"repl.all_reduce() needs numeric tensors, found {t.dtype.name} at {location}. "
                      "Fix: cast to a number first (e.g. tf.cast(x, tf.int32)).")
    return _differentiable(ctx, lambda u: _reduce_with_grad(ctx, u, op, axes, location, call), t)

  return _call(ctx, "all_reduce", location, x, one)


def _reduce_leaf(ctx, t, op, axes, location, call):
  return _emit(ctx, "all_reduce", t, {"op": op}, axes, t.shape, location, call)


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
    raise ValueError(f"repl.broadcast(source={source!r}): source must be a replica index in "
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


def all_gather(ctx, x, axis: int, axes: tuple[str, ...], location: str):
  """Concatenates the group's tensors along tensor dimension ``axis``."""
  size = ctx.replicator.mesh.axis_size(axes)
  position = ctx.replicator.mesh.axis_index(ctx.replica_id, axes)

  def one(t, call):
    rank = t.shape.rank
    if rank is None or rank == 0:
      raise ValueError(f"repl.all_gather() needs tensors of known rank >= 1, found shape {t.shape} "
                       f"at {location}. Fix: reshape scalars to [1] first (tf.reshape(x, [1])).")
    if not -rank <= axis < rank:
      raise ValueError(f"repl.all_gather(axis={axis}) is out of range for a tensor of rank {rank} "
                       f"(shape {t.shape}) at {location}.")
    dim = axis % rank
    shape = t.shape.as_list()
    shape[dim] = None if shape[dim] is None else shape[dim] * size

    def forward(u):
      y = _emit(ctx, "all_gather", u, {"axis": dim}, axes, tf.TensorShape(shape), location, call)

      def grad(dy):
        total = _reduce_leaf(ctx, dy, "sum", axes, f"gradient of all_gather at {location}", call)
        n = tf.shape(u)[dim]
        return tf.gather(total, tf.range(position * n, (position + 1) * n), axis=dim)

      return y, grad

    return _differentiable(ctx, forward, t)

  return _call(ctx, "all_gather", location, x, one)
