"""``repl.run`` called while a ``tf.function`` is traced: the step is called from the caller's graph.

Code written for ``tf.distribute`` calls ``strategy.run`` inside its own
``tf.function``::

    @tf.function
    def train_step(iterator):
      return repl.run(step_fn, inputs=next(iterator))

There the step is built (traced per replica, planned and rewritten) once,
outside the caller's graph, and cached as for a call from Python; the
caller's graph gets one call of the step's function, its inputs the caller's
tensors, its outputs ``PerReplica`` values of the caller's graph (global
values in the global view). The caller's function runs it every time it
runs, in its own loops (``for _ in tf.range(k)``, AutoGraph's ``for batch in
dist_dataset``), without tracing the step again.

What a call from Python adds and a call from a function cannot have, because
the step's failure reaches the caller's function, not ``repl.run``: when the
error leaves that function, what the failed step wrote is still written (the
values from before it are kept, and written back at the start of the step's
next call: training goes on from the state before the failure), and the error
is TensorFlow's, as with ``tf.distribute``. The step's inputs are passed as
``inputs=`` (``next(iterator)``): a dataset or ``input_fn`` as the step's
source, or ``steps=k``, loop in Python and are refused here.
"""

from __future__ import annotations

import tensorflow as tf

from replicator.core import _errors

INPUT_SOURCE = (
    "repl.run(step_fn, {what}) was called while a tf.function is being traced: inside a function the step takes "
    "the batch it runs on as inputs= (the function's own iterator reads it). Fix: "
    "`iterator = iter(repl.distribute_dataset(dataset))` outside the function, and inside it "
    "`repl.run(step_fn, inputs=next(iterator))` (or `for batch in dist: repl.run(step_fn, inputs=batch)`); or call "
    "repl.run(step_fn, {what}) from Python."
)
STEPS = (
    "repl.run(steps={steps}{all_steps}) was called while a tf.function is being traced: a loop of steps is "
    "written in the function itself there. Fix: `for _ in tf.range({steps}): repl.run(step_fn, "
    "inputs=next(iterator))`, or call repl.run(..., steps={steps}) from Python."
)
ACCUMULATING = (
    "repl.run was called while a tf.function is being traced, with a step whose optimizer accumulates gradients "
    "(wrap_optimizer(accumulation_steps=...)): which variant runs (accumulate, or reduce and apply) is chosen in "
    "Python on every call, and a function traced once would run the same one forever. Fix: call repl.run from "
    "Python for this step."
)
NOT_STATIC = (
    "repl.run(step_fn, inputs=...) in the global view, inside a tf.function, takes global batches of a static shape "
    "(the step is partitioned for its shapes), but found {spec}. Fix: batch the dataset with drop_remainder=True "
    "(or give the function an input_signature of fully defined shapes)."
)


def check_call(input_fn, steps, all_steps) -> None:
  """Refuses what a call from a function being traced cannot have: an input source, or a loop of steps."""
  if input_fn is not None:
    raise _errors.ArgumentError(INPUT_SOURCE.format(what=_describe(input_fn)))
  if steps != 1 or all_steps:
    raise _errors.ArgumentError(STEPS.format(steps=steps, all_steps=", all_steps=True" if all_steps else ""))


def _describe(input_fn) -> str:
  if isinstance(input_fn, tf.data.Dataset):
    return "dataset"
  return type(input_fn).__name__ if not callable(input_fn) else "input_fn"
