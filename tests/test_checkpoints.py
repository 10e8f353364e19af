"""A multi-client checkpoint's parts merged: each process's pieces of a variable, one checkpoint, read whole.

With real processes (Megatron across workers, each writing its pieces): ``tests/test_multi_client.py``.
"""

import numpy as np
import tensorflow as tf

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
