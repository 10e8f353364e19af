"""Ctrl-C during a call of several steps: the loop stops after the step in progress.

``repl.run(step_fn, data, steps=k)`` runs its k steps in one graph call, and a
signal is handled by Python only when that call returns: a SIGINT waited for
every step (3 s to be noticed, 7.6 s to stop, in the probe), and
``repl.steps_run`` kept the count of the call before. So a call of several
steps made from the main thread runs in a worker thread, while the main thread
waits where signals are handled; on Ctrl-C it raises a stop flag that the
loop's condition reads before each step, waits for the step in progress to end
(its writes are kept: the call returns normally, with the count of steps
run), and raises ``KeyboardInterrupt`` carrying that call's result. A second
Ctrl-C leaves at once (the call then ends in the background). One step per
call, and calls from other threads, run directly.
"""

from __future__ import annotations

import threading
from typing import Any
from typing import Callable

import tensorflow as tf

from replicator.state import _variables


class Interrupted(KeyboardInterrupt):
  """A ``KeyboardInterrupt`` raised once the interrupted call has stopped; ``result`` is what it returned."""

  def __init__(self, result: Any):
    super().__init__("interrupted: the loop stopped after the step in progress")
    self.result = result


class StopFlag:
  """A host variable the steps loop reads before each step: True stops it."""

  def __init__(self):
    with tf.init_scope(), tf.device("CPU:0"), _variables.creating_components():
      self._variable = _variables.new_component(initial_value=False, trainable=False, name="stop_requested")

  def keep_going(self) -> tf.Tensor:
    """In the loop's condition: whether no stop was asked for."""
    return tf.logical_not(self._variable.read_value())

  def run(self, fn: Callable[[], Any]) -> Any:
    """``fn()``; from the main thread, interruptible between steps (see the module's docstring)."""
    if threading.current_thread() is not threading.main_thread():
      return fn()
    self._variable.assign(False)
    box: dict[str, Any] = {}
    done = threading.Event()

    def target():
      try:
        box["result"] = fn()
      except BaseException as e:  # pylint: disable=broad-except  # re-raised in the caller's thread
        box["error"] = e
      finally:
        done.set()

    worker = threading.Thread(target=target, name="replicator-steps", daemon=True)
    worker.start()
    interrupted = False
    try:
      done.wait()
    except KeyboardInterrupt:
      interrupted = True
      self._variable.assign(True)  # the loop ends before its next step
      done.wait()  # a second Ctrl-C leaves now (the call then ends in the background)
    worker.join()
    if "error" in box:
      raise box["error"]
    if interrupted:
      raise Interrupted(box["result"])
    return box["result"]
