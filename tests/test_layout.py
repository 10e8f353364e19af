"""Tests for mesh layouts: specs, legality errors, shard geometry, LayoutMap, LayoutRules."""

import numpy as np
import pytest
from conftest import cpus

import mesh


@pytest.fixture(name="m")
def _mesh():
  return mesh.Mesh({"batch": 2, "model": 4}, devices=cpus(8))


def test_spec_normalisation_and_axes(m):
  layout = mesh.Layout([None, ["model"], ("batch",)], m)
  assert layout.spec == (None, "model", "batch")
  assert layout.sharded_axes == ("batch", "model")
  assert layout.replicated_axes == ()
  assert mesh.Layout((None, None), m).replicated_axes == ("batch", "model")
  assert mesh.Layout((("batch", "model"),), m).num_shards(0) == 8


def test_shard_geometry_against_numpy(m):
  x = np.arange(8 * 8).reshape(8, 8)
  for spec in [(None, "model"), ("batch", "model"), ("model", "batch"), (("batch", "model"), None),
               (None, ("model", "batch")), (None, None)]:
    layout = mesh.Layout(spec, m)
    covered = np.zeros_like(x)
    for d in range(m.size):
      begin, size = layout.shard_slices(d, x.shape)
      covered[begin[0]:begin[0] + size[0], begin[1]:begin[1] + size[1]] += 1
    # every element is held by exactly the devices along the replicated axes
    assert (covered == m.axis_size(layout.replicated_axes) if layout.replicated_axes else covered == 1).all(), spec


def test_row_major_over_axis_tuples(m):
  layout = mesh.Layout((("batch", "model"),), m)
  assert [layout.shard_index(d)[0] for d in range(8)] == list(range(8))
  layout = mesh.Layout((("model", "batch"),), m)
  assert [layout.shard_index(d)[0] for d in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


def test_unknown_axis_message(m):
  with pytest.raises(mesh.LayoutError, match=r"Layout \(None, 'hidden'\) names mesh axis 'hidden' \(for tensor dimension 1\), "
                     r"but the mesh has axes \('batch', 'model'\) \(shape \{'batch': 2, 'model': 4\}\)\. Fix: use one of"):
    mesh.Layout((None, "hidden"), m)


def test_axis_used_twice_message(m):
  with pytest.raises(mesh.LayoutError, match=r"Layout \('model', 'model'\) uses mesh axis 'model' for tensor dimensions 0 "
                     r"and 1; a mesh axis can split only one dimension of a tensor\. Fix: replicate one"):
    mesh.Layout(("model", "model"), m)
  with pytest.raises(mesh.LayoutError, match="uses mesh axis 'batch' for tensor dimensions 0 and 1"):
    mesh.Layout((("batch", "model"), "batch"), m)


def test_not_divisible_message(m):
  layout = mesh.Layout((None, "model"), m)
  with pytest.raises(mesh.LayoutError, match=r"Cannot split variable 'w' of shape \[6, 10\] with layout \(None, 'model'\): "
                     r"dimension 1 has size 10, which is not divisible by 4, the size of mesh axis 'model'\. "
                     r"Fix: make dimension 1 a multiple of 4 \(e\.g\. 12\)"):
    layout.check([6, 10], what="variable 'w'")
  with pytest.raises(mesh.LayoutError, match=r"not divisible by 8, the size of mesh axes \('batch', 'model'\)"):
    mesh.Layout((("batch", "model"),), m).check([12])


def test_rank_mismatch_and_bad_entry(m):
  with pytest.raises(mesh.LayoutError, match=r"has 2 entries, but a tensor has rank 1 \(shape \[4\]\)"):
    mesh.Layout((None, "model"), m).check([4])
  with pytest.raises(mesh.LayoutError, match=r"entry 0 is 3; each entry must be a mesh axis name"):
    mesh.Layout((3,), m)
  with pytest.raises(mesh.LayoutError, match="one entry per tensor dimension"):
    mesh.Layout("model", m)


def test_layout_map_lookup():
  layouts = mesh.LayoutMap({r"dense_1/kernel": (None, "model"), r".*bias": ("model",),
                            "dense_2/bias": (None,)})
  assert layouts.lookup("dense_1/kernel") == (None, "model")
  assert layouts.lookup("dense_1/bias") == ("model",)
  assert layouts.lookup("dense_2/bias") == (None,)  # an exact key wins over patterns
  assert layouts.lookup("dense_3/kernel") is None


def test_layout_map_ambiguous():
  layouts = mesh.LayoutMap({"kernel": (None, "model"), "dense_1/": ("model", None)})
  with pytest.raises(mesh.LayoutError, match=r"Variable 'dense_1/kernel' matches 2 LayoutMap patterns: \['kernel', 'dense_1/'\]"):
    layouts.lookup("dense_1/kernel")


def test_layout_rules(m):
  rules = mesh.LayoutRules([("batch", "batch"), ("hidden", "model"), ("vocab", None)])
  assert rules.spec(("batch", "hidden")) == ("batch", "model")
  assert rules.spec(("embed", "vocab")) == (None, None)
  assert rules.layout(("rows", "hidden"), m) == mesh.Layout((None, "model"), m)
  assert rules.mesh_axes("hidden") == ("model",) and rules.mesh_axes("embed") == ()
  layouts = rules.layout_map({"w1": ("rows", "cols", "hidden"), "w2": ("hidden", "classes")})
  assert layouts.lookup("mnist/w2") == ("model", None)
  shared = mesh.LayoutRules([("ff", "model"), ("heads", "model")])  # Megatron: both over "model"
  assert shared.spec(("embed", "heads")) == (None, "model") and shared.spec(("ff", "embed")) == ("model", None)
  with pytest.raises(mesh.LayoutError, match="uses mesh axis 'model' for tensor dimensions 0 and 1"):
    shared.layout(("heads", "ff"), m)  # but not in one tensor
  with pytest.raises(mesh.LayoutError, match="takes \\(dimension name, mesh axis\\) pairs"):
    mesh.LayoutRules(["hidden"])
