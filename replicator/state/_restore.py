"""A checkpoint restore that fails leaves the Replicator's variables as they were.

TensorFlow restores a checkpoint (``tf.train.Checkpoint.restore``) object by
object: it reads every saved tensor, then calls each object's
``_restore_from_tensors`` in turn. A tensor of the wrong shape raises there,
after the objects before it were already assigned: a model restored from a
checkpoint of another architecture came back half old, half new.

A :class:`ReplicatedVariable`'s ``_restore_from_tensors`` therefore keeps,
for the restore under way, each variable's values before it is assigned
(:func:`keep`); a variable that finds a tensor it cannot take puts back
everything this restore assigned before it (:func:`undo`) and then raises.
The kept values are the variables' own buffers (a read shares a variable's
buffer until the variable is assigned a new one), held until the next
restore begins or the next step runs (:func:`release`).

Which calls belong to one restore is told by the caller's frame: TensorFlow
2.21's ``MultiDeviceSaver.restore`` calls every object's
``_restore_from_tensors`` from one function, ``restore_fn`` in
``tensorflow/python/checkpoint/functional_saver.py``. Outside it (a restore
deferred until an object is created, another caller) each variable is its
own restore: nothing before it is undone. Checked on TensorFlow 2.21.
"""

from __future__ import annotations

import sys
import threading

_SAVER = "checkpoint/functional_saver.py"
_state = threading.local()


def _session() -> int | None:
  """An id of the restore under way (its caller's frame), or None outside TensorFlow's multi-object restore."""
  frame = sys._getframe(2)  # pylint: disable=protected-access
  for _ in range(20):  # through Keras's variable, TensorFlow's saveable wrappers, AutoGraph's do_not_convert
    if frame is None:
      return None
    if frame.f_code.co_name == "restore_fn" and frame.f_code.co_filename.replace("\\", "/").endswith(_SAVER):
      return id(frame)
    frame = frame.f_back
  return None


def _kept() -> list:
  session = _session()
  if getattr(_state, "session", None) != session:
    _state.session, _state.kept = session, []
  return _state.kept if session is not None else []


def keep(name: str, components) -> None:
  """Keeps ``components``' values before this restore assigns them (in TensorFlow's restore only)."""
  kept = _kept()
  if getattr(_state, "session", None) is not None:
    kept.append((name, [(c, c.read_value()) for c in components]))


def undo() -> list[str]:
  """Puts back what this restore assigned so far; returns the names of the variables put back, in order."""
  kept = _kept()
  for _, values in reversed(kept):
    for component, value in values:
      component.assign(value)
  names = [name for name, _ in kept]
  _state.session, _state.kept = None, []
  return names


def release() -> None:
  """Drops the values kept by the last restore (it is over): the next restore or step calls this."""
  if getattr(_state, "kept", None):
    _state.session, _state.kept = None, []
