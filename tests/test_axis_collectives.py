"""Axis collectives of a named mesh against NumPy: groups, values and gradients, both lowerings.

all_gather, reduce_scatter, all_to_all, permute and axis_index over each axis
of 2x2 and 2x4 meshes and over the tuple of both. Each test builds one step
holding many collectives, so the parametrisation stays small.
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import IMPLEMENTATIONS
from conftest import cpus

import mesh
import replicator

SHAPES = ({"batch": 2, "model": 2}, {"batch": 2, "model": 4})
AXES = ("batch", "model", ("batch", "model"))
OPS = ("sum", "mean", "max", "min")
NP_REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def make_replicator(shape, impl):
  m = mesh.Mesh(shape, cpus(int(np.prod(list(shape.values())))))
  return m, replicator.Replicator(mesh=m, implementation=impl)


def chain(n):
  """(i, i + 1) for i < n - 1: position 0 is no destination and gets zeros."""
  return [(i, i + 1) for i in range(n - 1)]


def group_of(m, d, axes):
  return next(g for g in m.groups(axes) if d in g)


def np_reduce(op, values):
  stacked = np.stack(values)
  if op == "mean" and np.issubdtype(stacked.dtype, np.integer):
    return np.fix(np.sum(stacked, axis=0) / len(values)).astype(stacked.dtype)  # truncation
  return NP_REDUCE[op](stacked, axis=0).astype(stacked.dtype)


def np_all_to_all(values, position, n, split, concat):
  return np.concatenate([np.split(v, n, axis=split)[position] for v in values], axis=concat)


def np_permute(values, position, perm):
  sources = {dst: src for src, dst in perm}
  return values[sources[position]] if position in sources else np.zeros_like(values[position])


@pytest.mark.parametrize("shape,impl", [  # CI: 2x4 with the first implementation (5 s a case); --full-grid: both
    pytest.param(shape, impl, id=f"{name}-{impl}",
                 marks=(pytest.mark.full_grid,) if (name, impl) == ("2x4", IMPLEMENTATIONS[1]) else ())
    for shape, name in zip(SHAPES, ("2x2", "2x4")) for impl in IMPLEMENTATIONS])
def test_axis_collectives_match_numpy(shape, impl):
  m, repl = make_replicator(shape, impl)
  rng = np.random.RandomState(0)
  floats = [rng.randn(8, 4).astype(np.float32) for _ in range(m.size)]  # 8: divisible by every group size
  ints = [rng.randint(-50, 50, size=[8]).astype(np.int32) for _ in range(m.size)]

  def step_fn(inp):
    x, i = inp
    out = {}
    for axes in AXES:
      n = m.axis_size(axes)
      out[str(axes)] = dict(
          gather0=repl.all_gather(x, axes),
          gather1=repl.all_gather({"x": x, "i": i[None]}, axis=axes, concat_dimension=-1),
          scatter={op: repl.reduce_scatter(x, op, axis=axes) for op in OPS},
          scatter1=repl.reduce_scatter(x, "max", axis=axes, scatter_dimension=1 if n <= 4 else 0),
          scatter_int=[repl.reduce_scatter(i, op, axis=axes) for op in ("sum", "mean")],
          a2a00=repl.all_to_all((x, i), axis=axes),
          a2a01=repl.all_to_all(x, axis=axes, split_dimension=0, concat_dimension=1),
          a2a10=repl.all_to_all(x, axis=axes, split_dimension=-1 if n <= 4 else 0, concat_dimension=0),
          permute=repl.permute((x, i), axis=axes, perm=chain(n)),
          ring=repl.permute(x, axis=axes, perm=[(p, (p + 1) % n) for p in range(n)]),
          index=repl.axis_index(axes))
    return out

  out = repl.run(step_fn, inputs=replicator.PerReplica(list(zip(floats, ints))))
  for axes in AXES:
    n = m.axis_size(axes)
    for d in range(m.size):
      group = group_of(m, d, axes)
      p = group.index(d)
      assert p == m.axis_index(d, axes)
      got = {k: tf.nest.map_structure(lambda v, d=d: v[d].numpy(), v) for k, v in out[str(axes)].items()}
      xs, is_ = [floats[r] for r in group], [ints[r] for r in group]
      msg = f"axes {axes}, device {d}"
      assert got["index"] == p and got["index"].dtype == np.int32, msg
      np.testing.assert_array_equal(got["gather0"], np.concatenate(xs, axis=0), msg)
      np.testing.assert_array_equal(got["gather1"]["x"], np.concatenate(xs, axis=1), msg)
      np.testing.assert_array_equal(got["gather1"]["i"], np.concatenate([v[None] for v in is_], axis=1), msg)
      for op in OPS:
        np.testing.assert_allclose(got["scatter"][op], np.split(np_reduce(op, xs), n)[p], rtol=1e-6, err_msg=f"{op} {msg}")
      dim = 1 if n <= 4 else 0
      np.testing.assert_array_equal(got["scatter1"], np.split(np_reduce("max", xs), n, axis=dim)[p], msg)
      for op, value in zip(("sum", "mean"), got["scatter_int"]):
        np.testing.assert_array_equal(value, np.split(np_reduce(op, is_), n)[p], f"int {op} {msg}")
      np.testing.assert_array_equal(got["a2a00"][0], np_all_to_all(xs, p, n, 0, 0), msg)
      np.testing.assert_array_equal(got["a2a00"][1], np_all_to_all(is_, p, n, 0, 0), msg)
      np.testing.assert_array_equal(got["a2a01"], np_all_to_all(xs, p, n, 0, 1), msg)
      np.testing.assert_array_equal(got["a2a10"], np_all_to_all(xs, p, n, 1 if n <= 4 else 0, 0), msg)
      np.testing.assert_array_equal(got["permute"][0], np_permute(xs, p, chain(n)), msg)
      np.testing.assert_array_equal(got["permute"][1], np_permute(is_, p, chain(n)), msg)
      np.testing.assert_array_equal(got["ring"], np_permute(xs, p, [(q, (q + 1) % n) for q in range(n)]), msg)


def test_axis_index_on_2x4():
  m, repl = make_replicator({"batch": 2, "model": 4}, "one_device")
  out = repl.run(lambda: {str(a): repl.axis_index(a) for a in AXES + (None, ("model", "batch"))})
  assert [int(v) for v in out["batch"]] == [0, 0, 0, 0, 1, 1, 1, 1]
  assert [int(v) for v in out["model"]] == [0, 1, 2, 3, 0, 1, 2, 3]
  assert [int(v) for v in out["('batch', 'model')"]] == list(range(8))
  assert [int(v) for v in out["None"]] == list(range(8))
  assert [int(v) for v in out["('model', 'batch')"]] == [0, 2, 4, 6, 1, 3, 5, 7]  # row-major over the tuple
  assert out["model"][0].dtype == tf.int32 and out["model"][0].shape == []
  assert not repl.explain(lambda: repl.axis_index("model")).collectives  # no communication


def test_static_result_shapes_and_plan():
  m, repl = make_replicator({"batch": 2, "model": 4}, "one_device")
  shapes = {}

  def step_fn():
    x = tf.ones([8, 3])
    ys = dict(gather=repl.all_gather(x, "model", concat_dimension=1), scatter=repl.reduce_scatter(x, axis="model"),
              a2a=repl.all_to_all(x, axis="model", concat_dimension=1), permute=repl.permute(x, axis="batch", perm=[(0, 1)]))
    shapes.update({k: y.shape.as_list() for k, y in ys.items()})
    return ys

  text = str(repl.explain(step_fn))
  assert shapes == dict(gather=[8, 12], scatter=[2, 3], a2a=[2, 12], permute=[8, 3])
  for described in ("all_gather(concat_dimension=1)", "reduce_scatter(op='sum', scatter_dimension=0)",
                    "all_to_all(concat_dimension=1, split_dimension=0)", "permute(perm=((0, 1),))"):
    assert described in text, text


def test_new_methods_are_documented():
  for name in ("reduce_scatter", "all_to_all", "permute", "axis_index", "all_gather"):
    assert ">>>" in getattr(replicator.Replicator, name).__doc__, name


# -- gradients -----------------------------------------------------------------------

KINDS = ("reduce_scatter_sum", "reduce_scatter_mean", "reduce_scatter_max", "reduce_scatter_min",
         "all_to_all", "permute")


def replicated_fn(repl, kind, axes, n):
  if kind.startswith("reduce_scatter_"):
    return lambda x: repl.reduce_scatter(x, kind.rsplit("_", 1)[1], axis=axes)
  if kind == "all_to_all":
    return lambda x: repl.all_to_all(x, axis=axes, split_dimension=0, concat_dimension=1)
  return lambda x: repl.permute(x, axis=axes, perm=chain(n))


def reference(kind, xs, groups):
  """Per-device results of ``kind`` computed on one device from all inputs."""
  ys = [None] * len(xs)
  for group in groups:
    n = len(group)
    members = [xs[r] for r in group]
    for p, r in enumerate(group):
      if kind.startswith("reduce_scatter_"):
        reducer = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max,
                   "min": tf.reduce_min}[kind.rsplit("_", 1)[1]]
        ys[r] = tf.split(reducer(tf.stack(members), axis=0), n)[p]
      elif kind == "all_to_all":
        ys[r] = tf.concat([tf.split(x, n)[p] for x in members], axis=1)
      else:
        sources = {dst: src for src, dst in chain(n)}
        ys[r] = members[sources[p]] if p in sources else tf.zeros_like(members[p])
  return ys


def loss_of(y, x, d):
  """A replica's loss: nonlinear in the collective's result, plus a local path."""
  w = tf.reshape(tf.cast(tf.range(tf.size(y)), y.dtype), tf.shape(y)) * 0.1 + float(d)
  return tf.reduce_sum(tf.sin(y) * w) + tf.reduce_sum(x * x)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("axes", ["model", ("batch", "model")])
def test_gradients_match_single_device(axes, impl):
  """Each replica's gradient equals d(sum of all replicas' losses)/d(its input)."""
  m, repl = make_replicator({"batch": 2, "model": 4}, impl)
  n = m.axis_size(axes)
  rng = np.random.RandomState(5)
  xs = [rng.randn(8, 3).astype(np.float32) for _ in range(m.size)]  # distinct values: no ties

  def step_fn(x):
    grads = {}
    for kind in KINDS:
      with tf.GradientTape() as tape:
        tape.watch(x)
        loss = loss_of(replicated_fn(repl, kind, axes, n)(x), x, repl.replica_id)
      grads[kind] = tape.gradient(loss, x)
    return grads

  out = repl.run(step_fn, inputs=replicator.PerReplica([tf.constant(x) for x in xs]))
  for kind in KINDS:
    x_ref = [tf.constant(x) for x in xs]
    with tf.GradientTape() as tape:
      tape.watch(x_ref)
      ys = reference(kind, x_ref, m.groups(axes))
      total = tf.add_n([loss_of(y, x, d) for d, (y, x) in enumerate(zip(ys, x_ref))])
    want = tape.gradient(total, x_ref)
    for d in range(m.size):
      np.testing.assert_allclose(out[kind][d].numpy(), want[d].numpy(), rtol=1e-5, atol=1e-5,
                                 err_msg=f"{kind} axes {axes} device {d}")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_reduce_scatter_max_gradient_splits_ties(impl):
  _, repl = make_replicator({"batch": 2, "model": 2}, impl)

  def step_fn():
    x = tf.constant([1.0, 5.0, 2.0, 3.0]) + tf.cast(repl.axis_index("model"), tf.float32) * [0.0, 0.0, 1.0, -1.0]
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = repl.reduce_scatter(x, "max", axis="model")
    return tape.gradient(y, x)

  out = repl.run(step_fn)
  # Chunk 0 ([1, 5] on both members) is a tie: member 0's upstream ones split in two.
  # Chunk 1 ([2, 3] vs [3, 2]): member 1's upstream ones go to the holder of each max.
  np.testing.assert_allclose(out[0].numpy(), [0.5, 0.5, 0.0, 1.0])
  np.testing.assert_allclose(out[1].numpy(), [0.5, 0.5, 1.0, 0.0])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradient_of_chained_collectives(impl):
  """A gradient collective whose input is another collective's result (no op in between)."""
  _, repl = make_replicator({"batch": 2, "model": 2}, impl)

  def step_fn(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = repl.permute(repl.permute(x, axis="model", perm=[(0, 1), (1, 0)]), axis="batch", perm=[(0, 1)])
      loss = tf.reduce_sum(repl.all_sum(repl.all_sum(y)) * tf.constant([1.0, 2.0]))
    return tape.gradient(loss, x)

  out = repl.run(step_fn, inputs=replicator.PerReplica([tf.ones([2]) * d for d in range(4)]))
  # Only batch row 0 reaches row 1; then everything is summed twice (x4 replicas, x4 sums).
  for d in range(4):
    np.testing.assert_allclose(out[d].numpy(), [16.0, 32.0] if d < 2 else [0.0, 0.0], err_msg=f"device {d}")
