"""Any callable as a step: functions, lambdas, bound methods, partials, callable objects, tf.functions.

``repl.run`` traces the step itself, once per replica, with AutoGraph as
``tf.function`` would. :func:`to_trace` finds the Python code to trace
behind a callable (a ``tf.function``'s ``python_function``, a bound
method's function, a partial's function, a callable object's ``__call__``)
and converts it with AutoGraph, keeping the binding.

A ``tf.function`` *called inside* a step (a decorated helper) is traced
inline, as plain Python, while the step is traced (:func:`inline_functions`):
each replica's trace then reads its own component of a replicated variable,
passes variables as arguments, differentiates through the helper and may
call collectives in it, exactly as if the decorator were not there. A helper
runs without AutoGraph then: Python ``if``/``while`` on tensors inside it
need ``tf.cond``/``tf.while_loop``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable
from collections.abc import Iterator

import tensorflow as tf

INLINE_HELPER_NEEDS_AUTOGRAPH = (
    "\n\nNote: a tf.function called inside step_fn is traced inline, once per replica, without "
    "AutoGraph, so Python control flow on tensors inside it cannot be converted. Fix: remove its "
    "@tf.function decorator (the step is converted with AutoGraph as a whole), or use tf.cond / "
    "tf.while_loop in it."
)


def _python_function(fn: Callable) -> Callable:
  """The Python callable a ``tf.function`` wraps (itself for anything else)."""
  while isinstance(fn, tf.types.experimental.PolymorphicFunction):
    fn = fn.python_function
  return fn


def to_trace(fn: Callable, autograph: bool, convert: Callable[[Callable], Callable]) -> Callable:
  """The callable whose trace is the step: ``fn`` unwrapped and, with ``autograph``, converted.

  Args:
    fn: the user's step.
    autograph: whether to convert with AutoGraph.
    convert: converts a plain Python function (``tf.autograph.to_graph`` and
      bookkeeping); may return its argument unchanged.
  """
  fn = _python_function(fn)
  if not autograph:
    return fn
  if isinstance(fn, functools.partial):
    return functools.partial(to_trace(fn.func, autograph, convert), *fn.args, **fn.keywords)
  if inspect.ismethod(fn):
    return types.MethodType(to_trace(fn.__func__, autograph, convert), fn.__self__)
  if inspect.isfunction(fn):
    return convert(fn)
  if callable(fn) and not inspect.isclass(fn) and inspect.ismethod(fn.__call__):  # a callable object
    return to_trace(fn.__call__, autograph, convert)
  return fn


def code_of(fn: Callable) -> types.CodeType | None:
  """The code object behind a step (what stays the same when the step is re-created), or None."""
  fn = _python_function(fn)
  while isinstance(fn, functools.partial):
    fn = _python_function(fn.func)
  if inspect.ismethod(fn):
    fn = fn.__func__
  if not inspect.isfunction(fn) and callable(fn) and not inspect.isclass(fn):
    call = type(fn).__call__  # a callable object: its class's __call__
    fn = call if inspect.isfunction(call) else fn
  return getattr(fn, "__code__", None)


@contextlib.contextmanager
def inline_functions() -> Iterator[None]:
  """``tf.function``s called inside run as plain Python (traced inline into the current graph).

  Uses the public ``tf.config.run_functions_eagerly`` switch, restored on
  exit; it is process-wide, so a ``tf.function`` called by another thread
  while a step is being built also runs as Python then.
  """
  saved = tf.config.functions_run_eagerly()
  tf.config.run_functions_eagerly(True)
  try:
    yield
  except tf.errors.OperatorNotAllowedInGraphError as e:
    raise type(e)(str(e) + INLINE_HELPER_NEEDS_AUTOGRAPH) from e
  finally:
    tf.config.run_functions_eagerly(saved)
