"""This process's collectives aborted, and the coordination service's key-value store: TensorFlow's private calls.

TensorFlow 2.21 has no public API for either, and the multi-client watchdog
(``_watchdog``) needs both:

* ``abort_collectives``: every collective this process is waiting in fails at
  once with the given message, and every later one too (the process's
  collective runtime is done; a job restarts). ``MultiWorkerMirroredStrategy``'s
  own health check aborts so. Preferred to a collective's own
  ``timeout_seconds`` because TensorFlow 2.21 sometimes crashes (SIGSEGV, seen
  in 1 run of 3 to 10 in this library's hung-peer test) while it aborts a ring
  all-reduce that timed out.
* ``publish`` / ``read``: the coordination service's key-value store (its
  leader is worker 0), where each process says how far it is.
  ``MultiWorkerMirroredStrategy``'s preemption handler claims keys there.

Both are methods of the eager context (``tensorflow/python/eager/context.py``:
``abort_collective_ops``, ``set_config_key_value``, ``get_config_key_value``,
``delete_config_key_value``), checked on TensorFlow 2.21.0. Inserting a key
that exists fails (``AlreadyExistsError``), so ``publish`` deletes it first.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.eager import context  # private: see the module docstring


def abort_collectives(message: str) -> None:
  """Fails every pending and later collective of this process with ``UnavailableError`` saying ``message``."""
  context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)


def publish(key: str, value: str) -> None:
  """Sets ``key`` to ``value`` in the job's key-value store (replacing what it held)."""
  ctx = context.context()
  try:
    ctx.delete_config_key_value(key)
  except tf.errors.OpError:
    pass  # (not there yet)
  ctx.set_config_key_value(key, value)


def read(key: str, timeout_seconds: float) -> str | None:
  """``key``'s value in the job's key-value store; None if it is not there within ``timeout_seconds`` or unreadable."""
  try:
    return context.context().get_config_key_value(key, max(1, int(timeout_seconds * 1000)))
  except tf.errors.OpError:
    return None
