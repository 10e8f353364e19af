"""Tests for rewrite.plan: matching placeholders across replicas and checking them."""

import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import rewrite


def record(replica, index, kind="all_reduce", params=(("op", "sum"),), dtype=tf.float32, shape=(3,),
           location="train.py:7 in step_fn", axes=("replica",), call=None):
  return rewrite.Placeholder(
      replica=replica, index=index, kind=kind, params=params, axes=axes, dtype=dtype,
      shape=tf.TensorShape(shape), input_shape=tf.TensorShape(shape), input=f"x{replica}_{index}:0",
      node=f"p{replica}_{index}", device=f"/device:CPU:{replica}", location=location,
      call=f"call {index}" if call is None else call)


def one_device(_):
  return "one_device"


def test_matches_in_call_order():
  m = mesh.Mesh({"replica": 2}, cpus(2))
  p = rewrite.plan([[record(0, 0), record(0, 1, dtype=tf.int32)],
                    [record(1, 0), record(1, 1, dtype=tf.int32)]], m, one_device)
  assert [c.index for c in p.collectives] == [0, 1]
  assert p.collectives[1].dtype == tf.int32
  assert [mem.node for mem in p.collectives[0].members] == ["p0_0", "p1_0"]
  assert p.collectives[0].groups == ((0, 1),)
  assert p.bytes_per_step == 2 * 12 + 2 * 12
  assert "all_reduce(op='sum')" in str(p) and "one_device" in str(p) and "train.py:7" in str(p)
  assert p.summary()[0]["bytes_per_replica"] == 12


def test_count_mismatch_names_replicas_call_and_line():
  m = mesh.Mesh({"replica": 2}, cpus(2))
  with pytest.raises(rewrite.CollectiveMismatchError) as e:
    rewrite.plan([[record(0, 0, location="train.py:12 in step_fn")], []], m, one_device)
  assert e.value.replicas == (0, 1) and e.value.call_index == 0
  assert "Replica 0 made 1 collective call(s) but replica 1 made 0" in str(e.value)
  assert "train.py:12 in step_fn" in str(e.value)
  assert "repl.replica_id == 0" in str(e.value)  # the common cause and its fix


@pytest.mark.parametrize("change, what", [
    (dict(params=(("op", "max"),)), "kind or parameters"),
    (dict(kind="broadcast", params=(("source", 0),)), "kind or parameters"),
    (dict(dtype=tf.float64), "dtype"),
    (dict(shape=(4,)), "shape"),
    (dict(axes=("other",)), "axes"),
    # Same kind and shape from another call (the keys' and the values' gradients, in the other order on one
    # replica): matched by order, they would exchange each other's data.
    (dict(call="call 1"), r"call \(which of the step's calls made it\)"),
])
def test_each_disagreement(change, what):
  m = mesh.Mesh({"replica": 3}, cpus(3))
  with pytest.raises(rewrite.CollectiveMismatchError, match=rf"Replicas 0 and 2 disagree on collective #0 \(its {what} differs\)"):
    rewrite.plan([[record(0, 0)], [record(1, 0)], [record(2, 0, **change)]], m, one_device)


def test_partial_shapes_are_merged():
  m = mesh.Mesh({"replica": 2}, cpus(2))
  p = rewrite.plan([[record(0, 0, shape=(None, 3))], [record(1, 0, shape=(5, None))]], m, one_device)
  assert p.collectives[0].shape.as_list() == [5, 3]


def test_first_disagreement_reported_before_count():
  m = mesh.Mesh({"replica": 2}, cpus(2))
  with pytest.raises(rewrite.CollectiveMismatchError, match="its dtype differs"):
    rewrite.plan([[record(0, 0), record(0, 1)], [record(1, 0, dtype=tf.int64)]], m, one_device)


def test_shapes_must_agree_within_groups_only():
  m = mesh.Mesh({"batch": 2, "model": 2}, cpus(4))
  shapes = [(3, 2), (3, 2), (5, 2), (5, 2)]  # batch shards of different sizes
  p = rewrite.plan([[record(r, 0, shape=s, axes=("model",))] for r, s in enumerate(shapes)], m, one_device)
  assert p.collectives[0].shape.as_list() == [None, 2]
  assert p.collectives[0].groups == ((0, 1), (2, 3))
  shapes = [(3, 2), (5, 2), (3, 2), (5, 2)]  # but members of one group must agree
  with pytest.raises(rewrite.CollectiveMismatchError, match=r"Replicas 0 and 1 disagree on collective #0 \(its shape differs\)"):
    rewrite.plan([[record(r, 0, shape=s, axes=("model",))] for r, s in enumerate(shapes)], m, one_device)
