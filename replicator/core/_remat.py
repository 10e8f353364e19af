"""Rematerialization: a function's forward pass computed again in its backward pass, with the first pass's draws.

:func:`remat` wraps a function so that its backward pass keeps only the
function's inputs and computes everything else again from them, under a
``GradientTape``, when the gradient is asked for. It works where
``tf.recompute_grad`` does not: inside a ``tf.function`` (Keras's ``fit``,
``repl.run`` in both views) with keyword arguments, and with random draws,
which the second pass replays (``_tf_op_callbacks``) so that its values, hence
the gradients, are the first pass's:

* arguments: every tensor in ``args`` and ``kwargs`` (nested structures,
  composite tensors flattened) is an input of the recomputation; any other
  value (``training=True``, ``None``, a Python number, a layer) is closed
  over as it was passed;
* variables read inside: gradients with respect to them, as for
  ``tf.custom_gradient``'s ``variables=`` (the trainable variables the
  forward pass reads);
* random draws: stateless ops (``tf.random.stateless_*``, Keras's Dropout on
  TensorFlow) draw again from the same seed tensors; stateful random ops
  (``tf.random.uniform``, ``tf.random.normal``, ``tf.random.Generator``'s
  draws) give the first pass's outputs; every variable read gives the value
  the first pass read (the weights, and the variables the function writes:
  Keras's ``SeedGenerator`` state, a layer's moving statistics), however
  TensorFlow orders the step's writes. Each variable the function writes is set
  back, after the recomputation, to the value it held when the backward pass
  began: the function's writes happen once, as without remat.

What the backward pass keeps from the forward pass: the inputs, the outputs
of the stateful random ops and the values it read of variables (a read
holds the variable's buffer: no copy, unless the variable is written before
the backward pass; a Keras seed is two integers). It recomputes every other op, once the
gradient of the outputs exists (the inputs of the recomputation depend on it,
so TensorFlow cannot run it early, nor merge it with the forward pass).

Called eagerly, or inside a ``tf.while_loop`` or ``tf.cond`` body, the
function runs as without remat (see :data:`CONTROL_FLOW_BODIES`): eager op
callbacks cannot replace outputs, and a loop's gradient body cannot capture
what a recomputation reads.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable

import tensorflow as tf

from replicator.core import _errors
from replicator.core import _tf_op_callbacks

# The name scope of the recomputation: under ``gradient_tape``, as ``tf.GradientTape`` puts the ops of the gradient
# functions (so ``repl.memory`` counts the recomputed forward as backward ops, and the block's inputs as saved).
BACKWARD_SCOPE = "gradient_tape/"

NOT_CALLABLE = (
    "replicator.remat(fn) takes a function (or a Keras layer); found {found!r} of type {kind}. Fix: pass the "
    "function that computes the block, e.g. `block = replicator.remat(block)` or `@replicator.remat` above its def."
)
CREATES_VARIABLES = (
    "replicator.remat({name}) created variables {names} when it was called: the backward pass computes the "
    "function again, and a second call would create them again. Fix: create (build) them before the first "
    "rematerialized call, e.g. layer.build(input_shape), or make the layer outside and close over it."
)


# The graphs TensorFlow 2.21 traces tf.while_loop's and tf.cond's bodies in (control_flow_v2_func_graphs; their
# class names only). TensorFlow differentiates a loop by building a gradient loop, whose body cannot capture the
# variables a recomputation reads (while_v2: "in list of internal_captures but not in internal_capture_to_output"),
# and a Keras RNN cell caches its dropout mask across the loop's iterations: a function called there runs as
# without remat (the rematerialized function around the loop, Keras's RNN layer under RematScope, recomputes it).
CONTROL_FLOW_BODIES = frozenset({"WhileBodyFuncGraph", "WhileCondFuncGraph", "CondBranchFuncGraph"})


def _name(fn) -> str:
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _is_tensor(x) -> bool:
  """A tensor argument (an input of the recomputation); variables are closed over, read inside as written."""
  return isinstance(x, tf.Tensor)


def _differentiable(x) -> bool:
  return x.dtype.is_floating or x.dtype.is_complex


def _after(tensors, gradients):
  """``tensors`` again, each made to depend on ``gradients`` (so their consumers run in the backward pass).

  A float or complex tensor becomes ``x + 0`` where the 0 is computed from a
  value of the first gradient (as ``tf.recompute_grad`` does): a data
  dependency, which every optimizer keeps; others get a control dependency.
  """
  first = next((g for g in gradients if g is not None), None)
  if first is None:
    return list(tensors)
  element = tf.reduce_max(tf.reshape(tf.cast(tf.math.real(first) if first.dtype.is_complex else first,
                                             tf.float32), [-1])[:1])
  zero = tf.where(tf.math.is_nan(element), float("nan"), 0.0)  # 0 unless the gradient is NaN
  tied = []
  for x in tensors:
    if _differentiable(x):
      tied.append(x + tf.cast(zero, x.dtype))
    else:
      with tf.control_dependencies([zero]):
        tied.append(tf.identity(x))
  return tied


def remat(fn: Callable, *, ambient: Callable[[], Callable[[], contextlib.AbstractContextManager]] | None = None,
          name: str | None = None) -> Callable:
  """``fn`` rematerialized: its backward pass computes it again (see the module docstring).

  Args:
    fn: the function; called as ``fn(*args, **kwargs)``.
    ambient: called at each call before the first pass, returns a function
      giving a context manager that the recomputation runs in (the caller's
      state the function reads implicitly: Keras's call context and
      autocast scope, see ``integrations/_remat``). None: none.
    name: the name errors use (the function's by default).
  """
  if not callable(fn):
    raise _errors.ArgumentTypeError(NOT_CALLABLE.format(found=fn, kind=type(fn).__name__))
  label = name or _name(fn)
  scope = (re.sub(r"[^A-Za-z0-9_]+", "_", label.replace("<locals>", "")).strip("_") or "remat") + "_recompute"

  @tf.autograph.experimental.do_not_convert
  @functools.wraps(fn)
  def rematerialized(*args, **kwargs):
    if tf.executing_eagerly():  # op callbacks cannot replace eager outputs: no replay, so no recomputation
      return fn(*args, **kwargs)
    if type(tf.compat.v1.get_default_graph()).__name__ in CONTROL_FLOW_BODIES:
      return fn(*args, **kwargs)  # a loop's body or a branch: the loop or the cond around it is what to recompute
    structure = (args, kwargs)
    leaves = tf.nest.flatten(structure, expand_composites=True)
    positions = [i for i, leaf in enumerate(leaves) if _is_tensor(leaf)]
    enter = ambient() if ambient is not None else contextlib.nullcontext

    def call(tensors):
      filled = list(leaves)
      for i, t in zip(positions, tensors):
        filled[i] = t
      call_args, call_kwargs = tf.nest.pack_sequence_as(structure, filled, expand_composites=True)
      return fn(*call_args, **call_kwargs)

    kept = {}  # the first pass's non-tensor outputs, put back in the structure after tf.custom_gradient

    @tf.custom_gradient
    def forward(*tensors):
      graph = tf.compat.v1.get_default_graph()
      created = []

      def creator(next_creator, **kw):
        created.append(kw.get("name"))
        return next_creator(**kw)

      with tf.variable_creator_scope(creator), _tf_op_callbacks.recording(label, graph) as record:
        result = call(tensors)
      if created:
        raise _errors.UnsupportedError(CREATES_VARIABLES.format(name=label, names=created))
      record.check()
      flat = tf.nest.flatten(result, expand_composites=True)
      outputs = [i for i, leaf in enumerate(flat) if isinstance(leaf, tf.Tensor)]
      kept["structure"], kept["flat"], kept["outputs"] = result, flat, outputs

      def backward(*gradients, variables=None):
        variables = list(variables or ())
        gradients = [tf.zeros_like(flat[i]) if g is None else g for i, g in zip(outputs, gradients)]
        with tf.name_scope(BACKWARD_SCOPE + scope):  # (the backward pass's ops, named as the tape names its own)
          tied = _after(tensors, gradients)
          written = record.written_variables()
          before = [tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype) for handle, dtype in written]
          with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch([t for t in tied if _differentiable(t)])
            tape.watch([v for v in variables if _differentiable(v)])
            with enter(), _tf_op_callbacks.replaying(record, tf.compat.v1.get_default_graph()):
              again = tf.nest.flatten(call(tied), expand_composites=True)
          targets = [(again[i], g) for i, g in zip(outputs, gradients) if _differentiable(again[i])]
          sources = [x for x in tied + variables if _differentiable(x)]
          found = list(tape.gradient([t for t, _ in targets], sources, output_gradients=[g for _, g in targets])
                       if targets and sources else [None] * len(sources))
          inputs = [found.pop(0) if _differentiable(t) else None for t in tied]
          found = [found.pop(0) if _differentiable(v) else None for v in variables]
          for (handle, _), value in zip(written, before):  # after the recomputation's writes (automatic control
            tf.raw_ops.AssignVariableOp(resource=handle, value=value)  # dependencies order a resource's ops as made)
        if variables:
          return inputs, found
        return inputs

      return [flat[i] for i in outputs], backward

    tensors = [leaves[i] for i in positions]
    results = forward(*tensors)
    flat = list(kept["flat"])
    for i, t in zip(kept["outputs"], results if isinstance(results, (list, tuple)) else [results]):
      flat[i] = t
    return tf.nest.pack_sequence_as(kept["structure"], flat, expand_composites=True)

  return rematerialized
