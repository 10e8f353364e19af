"""Checkpoints of a multi-client job: each process writes what it owns; the commit marker last.

In a multi-client job every worker process holds a copy of the replicated
variables and runs the same ``save`` call. If each wrote its copy to the same
files, the writes would race. Here each process writes only what it owns:
worker 0 writes the checkpoint (every replicated variable, and its own pieces
of the variables split across processes), and every other process writes its
pieces of those, in a file of its own under the same keys (:class:`Parts`);
worker 0 then merges the files into the checkpoint (``MergeV2Checkpoints``),
whose reader assembles a variable's pieces into its whole value. A metric's
parts are read by every process together just before the save (one
all-reduce each, ``values_gathered``), and worker 0 writes the values read.
``tf.train.CheckpointManager`` writes its ``checkpoint`` state file (the
commit marker that ``latest_checkpoint`` reads) after the merge, so a process
killed in the middle of a save leaves the previous checkpoint the latest.

Every process restores from the same directory (a file system every worker
reaches); replicated variables restore into any number of workers and any mesh.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from typing import Callable

import tensorflow as tf

from replicator import _checkpoint_keys
from replicator.state import _variables


class Parts:
  """How the processes of a multi-client job write the variables split across processes: each its own pieces.

  Args:
    task: this process's worker.
    variables: the variables split across processes, in creation order (the
      same in every process), at the time of a save.
    publish: ``(name, text)``: makes ``text`` readable by every process
      (the coordination service's key-value store).
    read: ``name -> text``, waiting until it is published.
    barrier: ``name ->`` returns once every process called it.
  """

  def __init__(self, task: int, variables: Callable[[], list], publish: Callable, read: Callable,
               barrier: Callable):
    self._task, self._variables = task, variables
    self._publish, self._read, self._barrier = publish, read, barrier
    self._saves = itertools.count()

  def save(self, root, manager, directory: str, checkpoint_number) -> str | None:
    """One save, in every process: worker 0's ``manager`` writes and commits; its path there, None elsewhere."""
    variables = self._variables()
    if not variables:
      return manager.save(checkpoint_number=checkpoint_number) if self._task == 0 else None
    name = f"replicator/checkpoint/{directory}/{next(self._saves)}"
    if self._task != 0:
      found = json.loads(self._read(name))
      names, specs, pieces = [], [], []
      for variable, key in zip(variables, found["keys"]):
        for spec, piece in _variables.own_pieces(variable).items():
          names.append(key)
          specs.append(spec)
          pieces.append(piece)
      if names:
        tf.io.gfile.makedirs(_parts_directory(found["prefix"]))
        tf.raw_ops.SaveV2(prefix=_part(found["prefix"], self._task), tensor_names=names, shape_and_slices=specs,
                          tensors=pieces)
      self._barrier("checkpoint parts written")
      return None

    def merge(save_path):  # after worker 0's files are written, before the state file that commits them
      stale = _parts_directory(save_path)  # (a save of this number cut short, maybe by another number of workers)
      if tf.io.gfile.exists(stale):  # removed before the others, told below, write theirs
        tf.io.gfile.rmtree(stale)
      keys = {id(_variables.underlying(obj)): key for obj, key in _checkpoint_keys.keys(root, save_path)}
      self._publish(name, json.dumps({"prefix": save_path,
                                      "keys": [keys[id(_variables.underlying(v))] for v in variables]}))
      self._barrier("checkpoint parts written")  # (the others write their pieces meanwhile)
      _merge(save_path, self._task)

    with _variables.pieces_written(variables):
      options = tf.train.CheckpointOptions(experimental_write_callbacks=[merge])
      return manager.save(checkpoint_number=checkpoint_number, options=options)


def _parts_directory(prefix: str) -> str:
  return f"{prefix}_parts"


def _part(prefix: str, task: int) -> str:
  return os.path.join(_parts_directory(prefix), f"part-{task}")


def _merge(prefix: str, task: int) -> None:
  """The checkpoint at ``prefix`` (this process's files) and the other processes' parts, merged at ``prefix``."""
  base = os.path.basename(prefix)
  for path in tf.io.gfile.glob(f"{prefix}.*"):  # this process's files become a part too
    tf.io.gfile.rename(path, _part(prefix, task) + os.path.basename(path)[len(base):], overwrite=True)
  parts = sorted(path[:-len(".index")] for path in tf.io.gfile.glob(_part(prefix, "*") + ".index"))
  tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=prefix, delete_old_dirs=True)


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
               barrier=None, parts: Parts | None = None, **kwargs):
    self._checkpoint = checkpoint
    self._parts = parts
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
    with self._gathered():  # every process: the values only every process together can read (a metric's parts)
      if self._parts is not None:  # (every process writes its pieces of the variables split across processes)
        path = self._parts.save(self._checkpoint, self._manager, self._directory, checkpoint_number)
      else:
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
