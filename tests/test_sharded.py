"""Tests for sharded values: shard/pack/unpack/relayout round trips against NumPy."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh

SPECS = [(None, None), ("batch", None), (None, "model"), ("batch", "model"), ("model", "batch"),
         (("batch", "model"), None)]


@pytest.fixture(name="m")
def _mesh():
  return mesh.Mesh({"batch": 2, "model": 4}, devices=cpus(8))


def _value():
  return np.arange(8 * 16, dtype=np.float32).reshape(8, 16)


@pytest.mark.parametrize("spec", SPECS)
def test_shard_unpack_pieces_against_numpy(m, spec):
  x = _value()
  layout = mesh.Layout(spec, m)
  pieces = mesh.unpack(mesh.shard(x, layout))
  assert len(pieces) == 8
  for d, piece in enumerate(pieces):
    begin, size = layout.shard_slices(d, x.shape)
    np.testing.assert_array_equal(piece.numpy(), x[begin[0]:begin[0] + size[0], begin[1]:begin[1] + size[1]])
    assert piece.device.endswith(f"CPU:{d}")


@pytest.mark.parametrize("spec", SPECS)
def test_pack_unpack_round_trip(m, spec):
  x = _value()
  layout = mesh.Layout(spec, m)
  pieces = [p.numpy() for p in mesh.unpack(mesh.shard(x, layout))]
  packed = mesh.pack(pieces, layout)
  np.testing.assert_array_equal(packed.numpy(), x)
  np.testing.assert_array_equal(tf.convert_to_tensor(packed).numpy(), x)
  assert packed.shape == (8, 16)
  for a, b in zip(mesh.unpack(packed), pieces):
    np.testing.assert_array_equal(a.numpy(), b)


@pytest.mark.parametrize("source", SPECS)
@pytest.mark.parametrize("target", [(None, None), ("model", "batch"), (None, ("batch", "model"))])
def test_relayout_round_trip(m, source, target):
  x = _value()
  moved = mesh.relayout(mesh.shard(x, mesh.Layout(source, m)), mesh.Layout(target, m))
  np.testing.assert_array_equal(moved.numpy(), x)
  expected = mesh.unpack(mesh.shard(x, mesh.Layout(target, m)))
  for a, b in zip(mesh.unpack(moved), expected):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  back = mesh.relayout(moved, mesh.Layout(source, m))
  np.testing.assert_array_equal(back.numpy(), x)


def test_relayout_to_another_mesh(m):
  x = _value()
  other = mesh.Mesh({"x": 4}, devices=cpus(8)[4:])
  moved = mesh.relayout(mesh.shard(x, mesh.Layout(("batch", "model"), m)), mesh.Layout((None, "x"), other))
  assert [p.shape.as_list() for p in mesh.unpack(moved)] == [[8, 4]] * 4
  assert mesh.unpack(moved)[0].device.endswith("CPU:4")
  np.testing.assert_array_equal(moved.numpy(), x)


def test_pack_errors(m):
  layout = mesh.Layout((None, "model"), m)
  with pytest.raises(mesh.LayoutError, match=r"pack\(\) needs one piece per mesh device: the mesh .* has 8 devices, found 2"):
    mesh.pack([np.zeros([2, 2])] * 2, layout)
  pieces = [np.zeros([2, 2], np.float32)] * 7 + [np.zeros([2, 3], np.float32)]
  with pytest.raises(mesh.LayoutError, match=r"piece of shape \[2, 3\] for device 7 .* puts pieces of shape \[2, 2\] there"):
    mesh.pack(pieces, layout)
  with pytest.raises(TypeError, match="Expected a mesh.ShardedTensor or a sharded variable"):
    mesh.unpack(np.zeros([2]))
