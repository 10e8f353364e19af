"""A layout the step states for a value it computes: ``repl.with_layout(x, spec)`` in the global view.

The global view lays out every value a step computes by its rules, from the
inputs' and the variables' layouts. Where the researcher knows better (keep
a layer's output split over the sequence between two blocks, gather the
activations instead of the weights of one layer, split a value over a
tensor-parallel axis the rules would leave whole), ``with_layout`` states
it, as ``jax.lax.with_sharding_constraint``, DTensor's ``relayout`` and Mesh
TensorFlow's layouts of named dimensions do: the value is relayouted to
``spec`` where it is computed (the collectives ``explain`` lists with the
reason "the layout the step states for it"), the ops before it are asked for
it (and produce it directly where their rules can), and the ops after it
take it from there. Its gradient is stated the same layout. The value is
the same; only where its pieces live changes.

Each call leaves an identity op in the traced step and records its spec in
the trace (``_context.GlobalTrace.pinned``); the global view checks the spec
against the mesh and the value's shape when it partitions the step.
"""

from __future__ import annotations

import tensorflow as tf
import tree

import mesh as mesh_lib
from replicator.core import _context
from replicator.core import _errors
from replicator.core import _primitives

LOCAL_VIEW = (
    "repl.with_layout() at {location} states a global value's layout, but this step runs in the local view, where "
    "each replica computes its own values. Fix: construct the Replicator with view=\"global\", or move pieces "
    "between replicas yourself (repl.all_gather, repl.all_to_all, repl.reduce_scatter).")
OUTSIDE_STEP = (
    "repl.with_layout() at {location} was called outside a step: it states the layout of a value a global-view "
    "step computes. Fix: call it inside the step function given to repl.run (or Keras's train_step); to lay out a "
    "value you hold, use mesh.shard(value, layout) or mesh.relayout(value, layout).")
SPEC_TYPE = (
    "repl.with_layout(x, spec={spec!r}) at {location}: expected a spec, a tuple with one entry per dimension of x "
    "(a mesh axis name, a tuple of names, or None for a whole dimension). Fix: e.g. (\"batch\", \"seq\", None).")
RANK = (
    "repl.with_layout(x, spec={spec}) at {location}: x has {rank} dimensions (shape {shape}), the spec {entries} "
    "entries. Fix: give one entry per dimension (None for a whole one).")


def _spec(spec, location: str) -> tuple:
  if isinstance(spec, mesh_lib.Layout):
    spec = spec.spec
  elif hasattr(spec, "axes") and not isinstance(spec, (tuple, list)):  # a keras.distribution.TensorLayout
    spec = spec.axes
  if not isinstance(spec, (tuple, list)) or not all(
      e is None or isinstance(e, str) or (isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e))
      for e in spec):
    raise _errors.ArgumentTypeError(SPEC_TYPE.format(spec=spec, location=location))
  return tuple(tuple(e) if isinstance(e, list) else e for e in spec)


def with_layout(replicator, x, spec, *, location: str | None = None):
  """``x`` (a tensor or nest of tensors), laid out as ``spec`` in the global-view step being traced.

  ``replicator``: the Replicator whose step states it (None: whichever global-view step is being traced, as for
  Keras's ``distribute_tensor``). ``location``: where the user asked for it (default: the caller's frame).
  """
  location = location or _primitives.user_location()
  trace = _context.current_global_trace()
  if trace is None or (replicator is not None and trace.replicator is not replicator):
    if _context.current_context() is not None:
      raise _errors.ReplicaContextError(LOCAL_VIEW.format(location=location))
    raise _errors.ReplicaContextError(OUTSIDE_STEP.format(location=location))
  spec = _spec(spec, location)

  def one(t):
    t = tf.convert_to_tensor(t)
    if t.shape.rank is not None and t.shape.rank != len(spec):
      raise _errors.ArgumentError(RANK.format(spec=spec, location=location, rank=t.shape.rank, shape=t.shape,
                                              entries=len(spec)))

    @tf.custom_gradient
    def stated(value):
      out = tf.identity(value, name="with_layout")
      trace.pinned.append((out.op, spec, location))

      def grad(dy):
        dx = tf.identity(dy, name="with_layout_grad")
        trace.pinned.append((dx.op, spec, location))
        return dx

      return out, grad

    return stated(t)

  return tree.map_structure(one, x)
