"""Checkpoints of a multi-client job: worker 0 writes what every process read together; the commit marker last.

In a multi-client job every worker process holds a copy of the replicated
variables and runs the same ``save`` call. If each wrote its copy to the same
files, the writes would race. Here each process writes only what it owns:
worker 0 writes the checkpoint and the others write nothing. A variable split
across processes (and a metric's parts) is read by every process together
just before the save (one all-reduce each, ``values_gathered``), and worker 0
writes the values read: its pieces are gathered, not each written by its
owner (a checkpoint of one worker's memory's worth). ``tf.train.CheckpointManager``
writes the checkpoint's files first and its ``checkpoint`` state file (the
commit marker that ``latest_checkpoint`` reads) last, so a process killed in
the middle of a save leaves the previous checkpoint the latest.

Every process restores from the same directory (a file system every worker
reaches); replicated variables restore into any number of workers and any mesh.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf


class CheckpointManager:
  """``tf.train.CheckpointManager`` for a (possibly multi-client) Replicator's checkpoint.

  Made by :meth:`replicator.MultiWorkerReplicator.checkpoint_manager`. Call
  ``save`` and ``restore_or_initialize`` in every process, as the rest of the
  program; the process that owns the variables writes.

  Args:
    checkpoint: the ``tf.train.Checkpoint`` (or any trackable) to save.
    directory: where checkpoints go, the same path in every process.
    writer: whether this process writes the checkpoint (it owns the variables).
    max_to_keep: how many checkpoints to keep (None: all).
    **kwargs: ``tf.train.CheckpointManager``'s other arguments (``max_to_keep``, ...).
  """

  def __init__(self, checkpoint, directory: str, writer: bool, max_to_keep: int | None = 5, gathered=None,
               barrier=None, **kwargs):
    self._checkpoint = checkpoint
    self._directory = directory
    self._writer = writer
    # Around a save, in every process: reads what only every process together can read (values_gathered).
    self._gathered = gathered if gathered is not None else contextlib.nullcontext
    # After a save, in every process: returns once every process is there (the writer has written).
    self._barrier = barrier if barrier is not None else (lambda: None)
    self._manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep, **kwargs) if writer else None

  @property
  def directory(self) -> str:
    return self._directory

  @property
  def latest_checkpoint(self) -> str | None:
    """The latest committed checkpoint's path prefix (read from the directory, in every process), or None."""
    return tf.train.latest_checkpoint(self._directory)

  def save(self, checkpoint_number: int | None = None) -> str | None:
    """Writes a checkpoint (in the writing process); its path there, None in the others."""
    with self._gathered():  # every process: the values split across processes, read together
      path = self._manager.save(checkpoint_number=checkpoint_number) if self._writer else None
    self._barrier()  # no process goes on (to restore it, say) before the checkpoint is written
    return path

  def restore_or_initialize(self) -> str | None:
    """Restores the latest checkpoint if there is one (every process); its path, or None."""
    latest = self.latest_checkpoint
    if latest is None:
      return None
    self._checkpoint.restore(latest).expect_partial()
    return latest
