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
A committed checkpoint that no longer reads (a file truncated or corrupted
after the commit, or deleted) raises :class:`replicator.CheckpointDamagedError`
naming the file and the earlier checkpoint to restore instead; checkpoint files
that no state file commits are named in a warning, not restored.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import warnings
from typing import Callable

import tensorflow as tf

from replicator import _checkpoint_keys
from replicator.core import _errors
from replicator.state import _variables

STATE_FILE = "checkpoint"  # tf.train.CheckpointManager's commit marker, in the directory

DAMAGED = (
    "The latest committed checkpoint {checkpoint} (named by the state file {state}) cannot be restored: {damage}. "
    "{fallback}")
FALL_BACK = (
    "{found} Fix: restore it in place of restore_or_initialize(), in every process: "
    "checkpoint.restore({previous!r}) (or catch replicator.CheckpointDamagedError and call "
    "checkpoint.restore(e.previous)); training goes on from there, and the next save commits a new latest checkpoint.")
NO_FALL_BACK = (
    "{none}. Fix: put back an intact copy of the damaged file, or start from scratch: move {directory} aside, and "
    "restore_or_initialize() finds no checkpoint.")
UNCOMMITTED = (
    "Checkpoint files in {directory} are ignored: no state file ({state}) commits them, so restore_or_initialize() "
    "starts from scratch. Found: {found}. Files without a state file are a save cut short before its commit (in a "
    "multi-client job: other workers' pieces under a '<prefix>_parts' folder that worker 0 had not merged yet, and "
    "worker 0's own files of that save, which lack those pieces), or checkpoint files copied without their state file. "
    "{fix}")
UNCOMMITTED_FIX = (
    "Fix: if {prefix} (the newest) is known complete, restore it in place of restore_or_initialize(), in every "
    "process: checkpoint.restore({prefix!r}) (or copy its state file along with it); otherwise delete the files.")
UNCOMMITTED_PARTS_ONLY = (
    "None of them is a checkpoint of its own (only a save's parts, no '<prefix>.index' in the folder itself): there is "
    "nothing to restore. Fix: delete them (a save of that number writes them anew).")


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
    """Restores the latest committed checkpoint if there is one (every process); its path, or None.

    The latest committed checkpoint is the one the directory's state file
    (``checkpoint``) names. If it does not read (a file of it truncated,
    corrupted or deleted after it was committed), this raises
    :class:`replicator.CheckpointDamagedError` naming the file and the newest
    earlier checkpoint of the state file's list that reads whole (its
    ``previous``), to restore instead with ``checkpoint.restore``.

    Without a state file nothing is restored (training starts from scratch);
    if checkpoint files are there all the same (``*.index``, ``*.data-*``,
    also under a save's ``<prefix>_parts`` or ``<prefix>_temp`` folder), a
    ``RuntimeWarning`` names them: a save cut short before its commit, or
    files copied without their state file, and none is restored unasked. With
    a state file, files it does not list (a newer save cut short before its
    commit, which the next save of that number writes over) are normal and
    pass without a warning.
    """
    state = tf.train.get_checkpoint_state(self._directory)
    if state is None:
      _warn_uncommitted(self._directory)
      return None
    latest = state.model_checkpoint_path
    try:
      self._checkpoint.restore(latest).expect_partial()
    except (IndexError, tf.errors.OpError) as e:  # (IndexError: TensorFlow's reader, on a truncated data file)
      damage = _damage(latest)
      if damage is None:  # the files read whole: not theirs to explain
        raise
      raise _damaged(self._directory, state, damage) from e
    return latest


def _damaged(directory: str, state, damage: tuple[tuple[str, ...], str]) -> _errors.CheckpointDamagedError:
  """The error for the latest checkpoint of ``state``, which ``damage`` (:func:`_damage`) keeps from reading."""
  latest = state.model_checkpoint_path
  files, what = damage
  if len(files) == 1:
    named = f"its {_kind(latest, files[0])} {files[0]} {what}"
  else:  # several data files missing, or one of them damaged (TensorFlow does not say which)
    named = f"{'its' if what.startswith('are') else 'one of its'} data files ({', '.join(files)}) {what}"
  earlier = [path for path in state.all_model_checkpoint_paths if path != latest][::-1]
  previous, skipped = None, []
  for path in earlier:
    found = _damage(path)
    if found is None:
      previous = path
      break
    skipped.append(f"{os.path.basename(path)}, whose {_kind(path, found[0][0])} {found[1]}")
  if previous is not None:
    found = (f"The previous committed checkpoint, {previous}, reads whole." if not skipped else
             f"The previous committed checkpoint that reads whole is {previous} (those between are damaged too: "
             f"{'; '.join(skipped)}).")
    text = FALL_BACK.format(found=found, previous=previous)
  else:
    listed = ", ".join(os.path.basename(path) for path in state.all_model_checkpoint_paths) or os.path.basename(latest)
    none = (f"The earlier committed checkpoints are damaged too ({'; '.join(skipped)})" if skipped else
            f"There is no earlier committed checkpoint to fall back to (the state file lists {listed})")
    text = NO_FALL_BACK.format(none=none, directory=directory)
  message = DAMAGED.format(checkpoint=latest, state=os.path.join(directory, STATE_FILE), damage=named, fallback=text)
  return _errors.CheckpointDamagedError(message, files=files, checkpoint=latest, previous=previous)


def _kind(prefix: str, path: str) -> str:
  return ("index file" if path == f"{prefix}.index" else "data files" if path == f"{prefix}.data-*" else
          "data file" if ".data-" in path else "file")


def _damage(prefix: str) -> tuple[tuple[str, ...], str] | None:
  """Why the checkpoint at ``prefix`` does not read: (the file or files at fault, what is wrong); None if it reads.

  Reads every tensor (one at a time): called only once a restore failed.
  """
  index = f"{prefix}.index"
  if not tf.io.gfile.exists(index):
    return (index,), "is missing"
  try:
    reader = tf.train.load_checkpoint(prefix)
  except (IndexError, ValueError, tf.errors.OpError) as e:
    return (index,), _what(e)
  data = sorted(tf.io.gfile.glob(f"{prefix}.data-*"))
  counts = {int(m.group(1)) for m in (re.search(r"-of-(\d+)$", path) for path in data) if m}
  missing = [f"{prefix}.data-{i:05d}-of-{n:05d}" for n in counts for i in range(n)]
  missing = [path for path in missing if path not in data]
  if missing:
    return tuple(missing), "is missing" if len(missing) == 1 else "are missing"
  for key in sorted(reader.get_variable_to_shape_map()):
    try:
      reader.get_tensor(key)
    except (IndexError, ValueError, tf.errors.OpError) as e:  # the file: named by TensorFlow, or its shard's number
      named = re.findall(r"(?:^|\s)(\S+\.data-\d+-of-\d+)", str(e))
      shard = re.search(r"\bshard (\d+)\b", str(e))
      at = named or [path for path in data if shard and re.search(rf"\.data-0*{shard.group(1)}-of-", path)]
      return tuple(dict.fromkeys(at or data or [f"{prefix}.data-*"])), _what(e)
  return None if data else ((f"{prefix}.data-*",), "are missing")


def _what(error: BaseException) -> str:
  """What a reader's error says of a file: truncated, corrupted, missing or unreadable, with TensorFlow's reason."""
  reason = _errors.root_cause(str(error)) or type(error).__name__
  if re.search(r"less bytes|too short|truncated|end of file", reason, re.I):
    what = "is truncated"
  elif re.search(r"checksum|corrupt", reason, re.I):
    what = "is corrupted"
  elif isinstance(error, tf.errors.NotFoundError) or "No such file" in reason:
    what = "is missing"
  else:
    what = "does not read"
  return f"{what} (TensorFlow: {reason})"


def _uncommitted(directory: str) -> list[str]:
  """The checkpoint files in ``directory`` and its saves' part folders, relative to it, in order of their numbers."""
  patterns = [os.path.join(directory, folder, name) for folder in ("", "*_parts", "*_temp")
              for name in ("*.index", "*.data-*")]
  found = {os.path.relpath(path, directory) for pattern in patterns for path in tf.io.gfile.glob(pattern)}
  return sorted(found, key=_numbers)


def _numbers(name: str) -> list:
  return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _warn_uncommitted(directory: str) -> None:
  found = _uncommitted(directory)
  if not found:
    return
  prefixes = [name[:-len(".index")] for name in found if os.sep not in name and name.endswith(".index")]
  fix = (UNCOMMITTED_FIX.format(prefix=os.path.join(directory, prefixes[-1])) if prefixes else
         UNCOMMITTED_PARTS_ONLY)
  shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
  warnings.warn(UNCOMMITTED.format(directory=directory, state=os.path.join(directory, STATE_FILE), found=shown,
                                   fix=fix), RuntimeWarning, stacklevel=3)
