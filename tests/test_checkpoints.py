"""The checkpoint manager: a multi-client checkpoint's parts merged (each process's pieces of a variable, one
checkpoint, read whole), and restore_or_initialize's edges (a committed checkpoint damaged afterwards raises an error
naming the file and the checkpoint to restore instead; checkpoint files without a state file are named in a warning).

With real processes (Megatron across workers, each writing its pieces): ``tests/test_multi_client.py``.
"""

import os
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from mse_step import mse_step

import replicator
from replicator import _checkpoints

WHOLE = np.arange(12, dtype=np.float32).reshape(4, 3)
KEY = "w/.ATTRIBUTES/VARIABLE_VALUE"


class _Rows(tf.__internal__.tracking.Trackable):
  """A value of which this writer holds rows ``rows`` (as worker 0's pieces of a variable split across processes)."""

  def __init__(self, rows):
    self.rows = rows

  def _serialize_to_tensors(self):
    a, b = self.rows
    return {"VARIABLE_VALUE": {f"4 3 {a},{b - a}:0,3": tf.constant(WHOLE[a:b])}}


def test_the_parts_merge_into_one_checkpoint_whose_reader_assembles_the_whole(tmp_path):
  prefix = tf.train.Checkpoint(w=_Rows((0, 2))).write(str(tmp_path / "ckpt-1"))  # worker 0: its rows, and the rest
  tf.io.gfile.makedirs(str(tmp_path / "ckpt-1_parts"))
  tf.raw_ops.SaveV2(prefix=str(tmp_path / "ckpt-1_parts" / "part-1"), tensor_names=[KEY],  # worker 1: its rows
                    shape_and_slices=["4 3 2,2:0,3"], tensors=[tf.constant(WHOLE[2:])])
  _checkpoints._merge(prefix, 0)  # pylint: disable=protected-access
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1.data-00000-of-00002", "ckpt-1.data-00001-of-00002",
                                                          "ckpt-1.index"]  # (no part left)
  np.testing.assert_array_equal(tf.train.load_checkpoint(prefix).get_tensor(KEY), WHOLE)
  v = tf.Variable(tf.zeros([4, 3]))
  tf.train.Checkpoint(w=v).read(prefix).assert_consumed()  # a plain variable restores the whole
  np.testing.assert_array_equal(v.numpy(), WHOLE)


# -- the edges of restore_or_initialize: a committed checkpoint damaged afterwards; files no state file commits --------

X = np.random.RandomState(0).randn(8, 3).astype(np.float32)
Y = np.random.RandomState(1).randn(8, 1).astype(np.float32)


class _Job:
  """A one-device Replicator's model and Adam, their checkpoint, and the manager that writes it in ``directory``.

  Made anew for each "run" of the job (as after a restart): the same initial values each time.
  """

  def __init__(self, directory, max_to_keep=5):
    keras.utils.set_random_seed(7)
    self.repl = replicator.Replicator(devices=cpus(1))
    with self.repl.context():
      self.model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                                     keras.layers.Dense(1)])
      self.optimizer = self.repl.wrap_optimizer(keras.optimizers.Adam(0.1))
      self.optimizer.build(self.model.trainable_variables)
    self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer)
    self.manager = _checkpoints.CheckpointManager(self.checkpoint, str(directory), writer=True, max_to_keep=max_to_keep)
    self.dataset = tf.data.Dataset.from_tensors((X, Y)).repeat()
    self.step = mse_step(self.model, self.optimizer)

  def train_and_save(self, saves: int) -> dict:
    """One step before each save; {path: the values saved} for each."""
    saved = {}
    for _ in range(saves):
      self.repl.run(self.step, self.dataset)
      saved[self.manager.save()] = self.values()
    return saved

  def values(self) -> list:
    return [v.numpy() for v in self.model.variables + self.optimizer.optimizer.variables]


def _assert_values(job, expected):
  got = job.values()
  assert len(got) == len(expected)
  for a, b in zip(got, expected):
    np.testing.assert_array_equal(a, b)


def _truncate(path, keep):
  with open(path, "r+b") as f:
    f.truncate(keep)


def test_a_truncated_data_file_is_named_with_the_previous_checkpoint_whose_restore_gives_its_values(tmp_path):
  # Was: restore_or_initialize() raised TensorFlow's IndexError "Read less bytes than requested", and nothing else.
  saved = _Job(tmp_path).train_and_save(2)
  first, second = (str(tmp_path / f"ckpt-{i}") for i in (1, 2))
  assert list(saved) == [first, second]
  data = f"{second}.data-00000-of-00001"
  _truncate(data, os.path.getsize(data) // 2)

  job = _Job(tmp_path)  # the job restarted
  fresh = job.values()
  assert not np.array_equal(fresh[0], saved[first][0])
  with pytest.raises(replicator.CheckpointDamagedError) as caught:
    job.manager.restore_or_initialize()
  assert str(caught.value) == (
      f"The latest committed checkpoint {second} (named by the state file {tmp_path / 'checkpoint'}) cannot be "
      f"restored: its data file {data} is truncated (TensorFlow: Read less bytes than requested). The previous "
      f"committed checkpoint, {first}, reads whole. Fix: restore it in place of restore_or_initialize(), in every "
      f"process: checkpoint.restore({first!r}) (or catch replicator.CheckpointDamagedError and call "
      f"checkpoint.restore(e.previous)); training goes on from there, and the next save commits a new latest "
      f"checkpoint.")
  error = caught.value
  assert (error.files, error.checkpoint, error.previous) == ((data,), second, first)
  assert isinstance(error, RuntimeError) and isinstance(error.__cause__, IndexError)
  assert type(error).__module__ == "replicator"
  _assert_values(job, fresh)  # the failed restore changed nothing

  # The fix, as the message says: the previous checkpoint's values exactly, and training goes on from there.
  job.checkpoint.restore(error.previous).assert_consumed()
  _assert_values(job, saved[first])
  again = job.train_and_save(1)
  assert list(again) == [second]  # (numbered from the restored save counter: written over the damaged one)
  job = _Job(tmp_path)  # and the next restart restores the new latest checkpoint
  assert job.manager.restore_or_initialize() == second
  _assert_values(job, again[second])


def _corrupt(path):
  with open(path, "r+b") as f:
    byte = f.read(1)
    f.seek(0)
    f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage, file, what, cause", [
    (_corrupt, "data-00000-of-00001", r"is corrupted \(TensorFlow: TensorBundle at {prefix} shard 0 \(\d+ bytes\): "
     r"Checksum does not match: stored \d+ vs. calculated on the restored bytes \d+\)\.", tf.errors.DataLossError),
    (lambda path: _truncate(path, 20), "index", r"is truncated \(TensorFlow: file is too short to be an sstable\)\.",
     tf.errors.OpError),
    (os.remove, "index", r"is missing\.", tf.errors.NotFoundError),  # (was: no error, training started from scratch)
    (os.remove, "data-00000-of-00001", r"is missing \(TensorFlow: {prefix}\.data-00000-of-00001; No such file or "
     r"directory\)\.", tf.errors.OpError),
], ids=["corrupted data", "truncated index", "deleted index", "deleted data"])
def test_every_damage_names_its_file_and_tensorflows_reason(tmp_path, damage, file, what, cause):
  saved = _Job(tmp_path).train_and_save(3)
  previous, latest = list(saved)[1:]
  path = f"{latest}.{file}"
  damage(path)
  job = _Job(tmp_path)
  with pytest.raises(replicator.CheckpointDamagedError) as caught:
    job.manager.restore_or_initialize()
  kind = "index file" if file == "index" else "data file"
  assert re.search(re.escape(f"cannot be restored: its {kind} {path} ") + what.format(prefix=re.escape(latest)) +
                   re.escape(f" The previous committed checkpoint, {previous}, reads whole."), str(caught.value)), (
                       str(caught.value))
  assert caught.value.files == (path,) and isinstance(caught.value.__cause__, cause)
  job.checkpoint.restore(caught.value.previous).assert_consumed()
  _assert_values(job, saved[previous])


def test_damaged_checkpoints_between_are_passed_over_to_the_newest_that_reads_whole(tmp_path):
  saved = _Job(tmp_path).train_and_save(3)
  first, second, third = saved
  os.remove(f"{third}.data-00000-of-00001")
  _truncate(f"{second}.data-00000-of-00001", 10)
  job = _Job(tmp_path)
  with pytest.raises(replicator.CheckpointDamagedError, match=re.escape(
      f"its data file {third}.data-00000-of-00001 is missing (TensorFlow: {third}.data-00000-of-00001; No such file "
      f"or directory). The previous committed checkpoint that reads whole is {first} (those between are damaged too: "
      f"ckpt-2, whose data file is truncated (TensorFlow: Read less bytes than requested)). Fix: restore it in place "
      f"of restore_or_initialize(), in every process: checkpoint.restore({first!r})")) as caught:
    job.manager.restore_or_initialize()
  assert caught.value.previous == first
  job.checkpoint.restore(first).assert_consumed()
  _assert_values(job, saved[first])


def test_a_damaged_checkpoint_with_none_before_it_says_there_is_none_and_how_to_start_from_scratch(tmp_path):
  saved = _Job(tmp_path, max_to_keep=1).train_and_save(2)
  latest = list(saved)[-1]
  assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
  _truncate(f"{latest}.data-00000-of-00001", 0)
  job = _Job(tmp_path, max_to_keep=1)
  with pytest.raises(replicator.CheckpointDamagedError) as caught:
    job.manager.restore_or_initialize()
  assert str(caught.value).endswith(
      f"its data file {latest}.data-00000-of-00001 is truncated (TensorFlow: Read less bytes than requested). There is "
      f"no earlier committed checkpoint to fall back to (the state file lists ckpt-2). Fix: put back an intact copy of "
      f"the damaged file, or start from scratch: move {tmp_path} aside, and restore_or_initialize() finds no "
      f"checkpoint.")
  assert caught.value.previous is None
  os.rename(tmp_path, f"{tmp_path}-damaged")  # the fix: from scratch
  assert _Job(tmp_path).manager.restore_or_initialize() is None


def test_checkpoint_files_without_a_state_file_are_named_in_a_warning_and_restore_when_asked(tmp_path):
  # Was: restore_or_initialize() returned None without a word, and training started from scratch.
  saved = _Job(tmp_path).train_and_save(2)
  os.remove(tmp_path / "checkpoint")  # (as files copied without it)
  job = _Job(tmp_path)
  fresh = job.values()
  with pytest.warns(RuntimeWarning) as caught:
    assert job.manager.restore_or_initialize() is None
  assert len(caught) == 1 and caught[0].filename == __file__  # (pointed at the caller's line)
  latest = str(tmp_path / "ckpt-2")
  assert str(caught[0].message) == (
      f"Checkpoint files in {tmp_path} are ignored: no state file ({tmp_path / 'checkpoint'}) commits them, so "
      f"restore_or_initialize() starts from scratch. Found: ckpt-1.data-00000-of-00001, ckpt-1.index, "
      f"ckpt-2.data-00000-of-00001, ckpt-2.index. Files without a state file are a save cut short before its commit "
      f"(in a multi-client job: other workers' pieces under a '<prefix>_parts' folder that worker 0 had not merged "
      f"yet, and worker 0's own files of that save, which lack those pieces), or checkpoint files copied without "
      f"their state file. Fix: if {latest} (the newest) is known complete, restore it in place of "
      f"restore_or_initialize(), in every process: checkpoint.restore({latest!r}) (or copy its state file along with "
      f"it); otherwise delete the files.")
  _assert_values(job, fresh)  # nothing restored unasked
  job.checkpoint.restore(latest).assert_consumed()  # the fix
  _assert_values(job, saved[latest])


def test_only_the_parts_of_an_interrupted_multi_client_save_are_named_as_nothing_to_restore(tmp_path):
  parts = tmp_path / "ckpt-1_parts"
  parts.mkdir()
  tf.raw_ops.SaveV2(prefix=str(parts / "part-1"), tensor_names=[KEY], shape_and_slices=["4 3 2,2:0,3"],
                    tensors=[tf.constant(WHOLE[2:])])  # worker 1's pieces; worker 0 never merged them
  manager = _checkpoints.CheckpointManager(tf.train.Checkpoint(w=tf.Variable(WHOLE)), str(tmp_path), writer=True)
  with pytest.warns(RuntimeWarning, match=re.escape(
      "Found: ckpt-1_parts/part-1.data-00000-of-00001, ckpt-1_parts/part-1.index. Files without a state file are a "
      "save cut short") + ".*" + re.escape(
      "None of them is a checkpoint of its own (only a save's parts, no '<prefix>.index' in the folder itself): there "
      "is nothing to restore. Fix: delete them (a save of that number writes them anew).")):
    assert manager.restore_or_initialize() is None


def test_no_warning_beside_a_state_file_nor_in_an_empty_directory(tmp_path):
  saved = _Job(tmp_path).train_and_save(1)
  job = _Job(tmp_path)
  tf.train.Checkpoint(model=job.model).write(str(tmp_path / "ckpt-2"))  # a newer save cut short before its commit
  (tmp_path / "ckpt-3_parts").mkdir()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert job.manager.restore_or_initialize() == str(tmp_path / "ckpt-1")  # the committed one
    _assert_values(job, saved[str(tmp_path / "ckpt-1")])
    assert _Job(tmp_path / "new").manager.restore_or_initialize() is None
