"""Tests for mesh: devices and the named-axis Mesh."""

import os

import pytest
import tensorflow as tf
from conftest import cpus

import mesh
from mesh import _devices


def test_canonical_names():
  assert mesh.canonical_name("cpu:1") == "/device:CPU:1"
  assert mesh.canonical_name("/job:localhost/replica:0/task:0/device:CPU:2") == "/device:CPU:2"
  assert mesh.canonical_name("/job:worker/task:1/device:CPU:0") == "/job:worker/replica:0/task:1/device:CPU:0"


def test_local_devices_prefers_available_type():
  assert mesh.local_devices() == cpus(8)


def test_unknown_device_lists_available():
  with pytest.raises(mesh.DeviceError, match=r"Unknown device 'cpu:99' at position 1\. Expected one of .*/device:CPU:0.*virtual_cpus"):
    mesh.Mesh({"x": 2}, devices=["cpu:0", "cpu:99"])
  with pytest.raises(mesh.DeviceError, match=r"Unknown device 'gpu:0'"):
    mesh.Mesh({"x": 1}, devices=["gpu:0"])


def test_duplicate_device():
  with pytest.raises(mesh.DeviceError, match=r"listed twice \(positions 0 and 1\)"):
    mesh.Mesh({"x": 2}, devices=["cpu:0", "/device:CPU:0"])


def test_bad_axes_and_counts():
  with pytest.raises(mesh.MeshError, match="non-empty mapping"):
    mesh.Mesh({"x": 0})
  with pytest.raises(mesh.MeshError, match=r"needs 4 devices, but 3 were given"):
    mesh.Mesh({"x": 2, "y": 2}, devices=cpus(3))
  with pytest.raises(mesh.MeshError, match=r"needs 16 devices, but 8 were given \(all local"):
    mesh.Mesh({"x": 16})


def test_virtual_cpus_after_initialisation():
  assert mesh.virtual_cpus(8) == cpus(8)  # same count: no-op
  with pytest.raises(mesh.DeviceError, match=r"virtual_cpus\(3\) must run before TensorFlow initialises its devices, but they are already initialised with 8"):
    mesh.virtual_cpus(3)
  with pytest.raises(mesh.DeviceError, match="positive integer"):
    mesh.virtual_cpus(0)
  with pytest.raises(mesh.DeviceError, match=r"intra_op_threads=...\) needs a non-negative integer or None, but found -1"):
    mesh.virtual_cpus(8, intra_op_threads=-1)
  now = tf.config.threading.get_intra_op_parallelism_threads()
  with pytest.raises(mesh.DeviceError, match=rf"virtual_cpus\(8, intra_op_threads={now + 2}\) must run before "
                     rf"TensorFlow initialises its devices, but they are already initialised with {now} intra-op"):
    mesh.virtual_cpus(8, intra_op_threads=now + 2)
  assert mesh.virtual_cpus(8, intra_op_threads=now) == cpus(8)


def test_virtual_cpus_give_a_kernel_the_cores_over_the_devices(monkeypatch):
  # conftest made 8 logical CPUs with virtual_cpus(8): unless TF_NUM_INTRAOP_THREADS was set, a kernel gets
  # cores // 8 threads, at least one (TensorFlow's default would be one per core).
  if not os.environ.get("TF_NUM_INTRAOP_THREADS"):
    assert tf.config.threading.get_intra_op_parallelism_threads() == max(1, _devices.cores() // 8)
  monkeypatch.setattr(_devices, "cores", lambda: 16)
  monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
  assert [_devices.intra_op_threads_for(n) for n in (1, 2, 4, 8, 16, 32)] == [0, 8, 4, 2, 1, 1]
  monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "3")  # the user's choice: left to TensorFlow
  assert _devices.intra_op_threads_for(4) == 0


def test_coordinates_row_major():
  m = mesh.Mesh({"batch": 2, "model": 4}, devices=cpus(8))
  assert m.shape == {"batch": 2, "model": 4}
  assert m.axis_names == ("batch", "model")
  assert m.size == 8
  assert m.coords(6) == {"batch": 1, "model": 2}
  assert all(m.index(m.coords(i)) == i for i in range(8))
  assert m.device_index("cpu:5") == 5


def test_groups_along_axes():
  m = mesh.Mesh({"batch": 2, "model": 4}, devices=cpus(8))
  assert m.groups("model") == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert m.groups("batch") == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert m.groups(None) == (tuple(range(8)),)
  assert m.groups(("model", "batch")) == ((0, 4, 1, 5, 2, 6, 3, 7),)
  assert m.axis_index(6, "model") == 2
  assert m.axis_index(6, "batch") == 1
  assert m.axis_size(("batch", "model")) == 8


def test_unknown_axis():
  m = mesh.Mesh({"batch": 2}, devices=cpus(2))
  with pytest.raises(mesh.MeshError, match=r"Unknown mesh axis 'model'\. This mesh has axes \('batch',\)"):
    m.groups("model")


def test_from_devices_and_equality():
  a = mesh.Mesh.from_devices(["cpu:0", "cpu:1"])
  assert a == mesh.Mesh({"replica": 2}, devices=cpus(2))
  assert hash(a) == hash(mesh.Mesh({"replica": 2}, devices=cpus(2)))
  assert "replica" in repr(a)


def test_with_repeats_adds_a_last_axis_whose_positions_are_one_device():
  base = mesh.Mesh({"stage": 2, "batch": 2}, devices=cpus(4))
  repeated = base.with_repeats("micro", 3)
  assert repeated.shape == {"stage": 2, "batch": 2, "micro": 3}
  assert repeated.repeated_axes == ("micro",) and base.repeated_axes == ()
  assert repeated.devices == tuple(d for d in base.devices for _ in range(3))
  assert repeated.coords(7) == {"stage": 1, "batch": 0, "micro": 1}
  assert repeated.groups("micro")[1] == (3, 4, 5)  # (device 1 of base, its three positions)
  assert {repeated.devices[r] for r in repeated.groups("micro")[1]} == {base.devices[1]}
  assert repeated.groups("stage")[0] == (0, 6)
  with pytest.raises(mesh.MeshError, match="expected a new axis name"):
    base.with_repeats("batch", 2)
  with pytest.raises(mesh.MeshError, match="a positive int"):
    base.with_repeats("micro", 0)
