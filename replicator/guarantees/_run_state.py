"""What a Replicator's calls of ``run`` share, in either view: one object, owned by the Replicator.

The views (``_local``, ``_global``) build steps and call them
through it:

* ``variant`` finds the built step for the next accumulation phases of the
  wrapped optimizers (``wrap_optimizer(accumulation_steps=...)``), building
  it if new, and counts the traces;
* ``execute`` runs a built step: it refuses to start while a failed step has
  left replicated copies different (``atomic=False``), runs one step or a loop
  of them (interruptible between steps by Ctrl-C: ``_interrupt``), records
  what a step that diverged the copies wrote, counts the steps run and
  advances the accumulating optimizers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from replicator.core import _errors
from replicator.guarantees import _interrupt
from replicator.state import _consistency


class RunState:
  """The state of a Replicator's runs: traces, steps run, the stop flag, the divergence record.

  Attributes:
    trace_count: steps built so far (``Replicator.trace_count``).
    steps_run: steps the last call ran (``Replicator.steps_run``).
    accumulating: the Replicator's wrapped optimizers that accumulate gradients.
  """

  def __init__(self, layouts, strict: bool):
    self._layouts = layouts  # _layout_state.LayoutState: its keys are checked after each build
    self._strict = strict
    self.trace_count = 0
    self.steps_run = 0
    self.accumulating: weakref.WeakSet = weakref.WeakSet()
    self._diverged = None  # (what a failed step wrote, its error) while the replicas' copies differ
    self._stop = None  # made by the first call of several steps

  @property
  def stop(self) -> _interrupt.StopFlag:
    """What a loop of steps reads before each step: Ctrl-C stops it (``_interrupt``)."""
    if self._stop is None:
      self._stop = _interrupt.StopFlag()
    return self._stop

  def variant(self, variants: dict, build: Callable):
    """The step in ``variants`` (accumulation phases -> step) for the next phases, built by ``build()`` if new.

    The phases are those of the wrapped optimizers with ``accumulation_steps``
    that the step uses (before its first build: all of this Replicator's).
    """
    used = next(iter(variants.values())).accumulating if variants else tuple(self.accumulating)
    for optimizer in used:
      optimizer.prepare_trace()
    step = variants.get(tuple(o.phase() for o in used)) if variants else None
    if step is None:
      step = build()
      self.trace_count += 1
      self._layouts.check(self._strict)
      variants[tuple(o.phase() for o in step.accumulating)] = step
    return step

  @property
  def diverged(self):
    """While a failed step has left replicated copies different: (what it wrote, its error); else None."""
    return self._diverged

  def check_replicas_agree(self) -> None:
    """Refuses to run while a failed step has left the replicas' copies of some variable different."""
    if self._diverged is None:
      return
    written, error = self._diverged
    found = written.diverged()
    if found:
      raise _errors.ReplicasDivergedError(
          _consistency.STILL_DIVERGED.format(error=error, **_consistency.describe(found)), found)
    self._diverged = None  # restored: the copies agree again

  def execute(self, step, call: Callable, loop: bool):
    """Runs ``call(stop)`` -> (results, steps run): one step (``stop`` None), or a loop of them if ``loop``."""
    self.check_replicas_agree()
    try:
      if loop:  # interruptible between steps
        results, self.steps_run = self.stop.run(lambda: call(self.stop))
      else:
        results, self.steps_run = call(None)
    except _interrupt.Interrupted as e:  # Ctrl-C: the steps run so far are kept and counted
      self.steps_run = e.result[1]
      raise
    except _errors.ReplicasDivergedError as e:  # Replicator(atomic=False)
      self._diverged = (step.written, str(e.__cause__ and _errors.root_cause(e.__cause__.message)))
      raise
    for optimizer in step.accumulating:
      optimizer.advance(self.steps_run)
    return results
