"""Each collective against NumPy (dtypes, shapes, nests), and its gradient against one device."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import IMPLEMENTATIONS
from conftest import REPLICA_COUNTS
from conftest import cpus

import replicator

DTYPES = (np.float32, np.float64, np.int32, np.int64)
NP_REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def per_replica_values(n, shape, dtype, seed=0):
  rng = np.random.RandomState(seed)
  return [(rng.randn(*shape) * 10).astype(dtype) for _ in range(n)]


def expected_reduce(op, values):
  stacked = np.stack(values)
  if op == "mean" and np.issubdtype(stacked.dtype, np.integer):
    return np.fix(np.sum(stacked, axis=0) / len(values)).astype(stacked.dtype)  # truncation
  return NP_REDUCE[op](stacked, axis=0).astype(stacked.dtype)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_all_reduce_ops_dtypes_and_nests(n, impl):
  repl = replicator.Replicator(cpus(n), implementation=impl)
  ops = ("sum", "mean", "max", "min")
  inputs = [{"a": per_replica_values(n, (3, 2), d, seed=i)} for i, d in enumerate(DTYPES)]
  per_replica = replicator.PerReplica(
      [{d.__name__: (inputs[i]["a"][r], inputs[i]["a"][r][0]) for i, d in enumerate(DTYPES)} for r in range(n)])

  def step_fn(x):
    return {op: repl.all_reduce(x, op=op) for op in ops}

  out = repl.run(step_fn, inputs=per_replica)
  for r in range(n):
    for op in ops:
      for i, d in enumerate(DTYPES):
        full, row = (v[r] for v in out[op][d.__name__])
        want = expected_reduce(op, inputs[i]["a"])
        tol = 1e-6 if d is np.float32 else 1e-12
        np.testing.assert_allclose(full.numpy(), want, rtol=tol, err_msg=f"{op} {d} replica {r}")
        np.testing.assert_allclose(row.numpy(), want[0], rtol=tol)
        assert full.dtype == tf.as_dtype(d)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_all_sum_broadcast_all_gather(n, impl):
  repl = replicator.Replicator(cpus(n), implementation=impl)
  xs = per_replica_values(n, (2, 3), np.float32)
  ints = per_replica_values(n, (4,), np.int32, seed=1)

  def step_fn(x, i):
    return dict(
        sum=repl.all_sum([x, i]),
        bcast=repl.broadcast((x, i), source=n - 1),
        gather0=repl.all_gather(x, concat_dimension=0),
        gather1=repl.all_gather({"x": x}, concat_dimension=-1),
        gather_int=repl.all_gather(i),
        replica_id=tf.constant(repl.replica_id))

  out = repl.run(lambda v: step_fn(*v), inputs=replicator.PerReplica(list(zip(xs, ints))))
  for r in range(n):
    np.testing.assert_allclose(out["sum"][0][r].numpy(), np.sum(xs, axis=0), rtol=1e-6)
    np.testing.assert_array_equal(out["sum"][1][r].numpy(), np.sum(ints, axis=0))
    np.testing.assert_array_equal(out["bcast"][0][r].numpy(), xs[-1])
    np.testing.assert_array_equal(out["bcast"][1][r].numpy(), ints[-1])
    np.testing.assert_array_equal(out["gather0"][r].numpy(), np.concatenate(xs, axis=0))
    np.testing.assert_array_equal(out["gather1"]["x"][r].numpy(), np.concatenate(xs, axis=1))
    np.testing.assert_array_equal(out["gather_int"][r].numpy(), np.concatenate(ints))
    assert int(out["replica_id"][r]) == r


@pytest.mark.parametrize("n", [2, 4])
def test_small_float_dtypes(n):
  repl = replicator.Replicator(cpus(n))
  for dtype in (tf.float16, tf.bfloat16):
    out = repl.run(lambda dtype=dtype: repl.all_reduce(tf.ones([3], dtype) * (repl.replica_id + 1), op="max"))
    assert out[0].dtype == dtype
    np.testing.assert_allclose(tf.cast(out[n - 1], tf.float32).numpy(), [n] * 3)


# -- gradients -----------------------------------------------------------------------

def collective_fns(kind, n, source=1):
  """(replicated, reference): the same math with a primitive and on stacked values."""
  if kind.startswith("all_reduce_"):
    op = kind.split("_")[-1]
    reference = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max,
                 "min": tf.reduce_min}[op]
    return (lambda repl, x: repl.all_reduce(x, op=op),
            lambda xs: [reference(tf.stack(xs), axis=0)] * n)
  if kind == "broadcast":
    return lambda repl, x: repl.broadcast(x, source=source), lambda xs: [xs[source]] * n
  if kind == "all_gather":
    return lambda repl, x: repl.all_gather(x, concat_dimension=1), lambda xs: [tf.concat(xs, axis=1)] * n
  raise ValueError(kind)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("kind", ["all_reduce_sum", "all_reduce_mean", "all_reduce_max",
                                  "all_reduce_min", "broadcast", "all_gather"])
def test_gradients_match_single_device(kind, n, impl):
  """Each replica's gradient equals d(sum of all replicas' losses)/d(its input)."""
  repl = replicator.Replicator(cpus(n), implementation=impl)
  xs = per_replica_values(n, (2, 3), np.float32, seed=3)  # distinct values: no ties
  weights = per_replica_values(n, (2, 3 * n if kind == "all_gather" else 3), np.float32, seed=4)
  replicated, reference = collective_fns(kind, n, source=min(1, n - 1))

  def loss_of(y, w, x):
    return tf.reduce_sum(tf.sin(y) * w) + tf.reduce_sum(x * x)  # local and collective paths

  def step_fn(inp):
    x, w = inp
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = loss_of(replicated(repl, x), w, x)
    return tape.gradient(loss, x)

  grads = repl.run(step_fn, inputs=replicator.PerReplica([(tf.constant(x), tf.constant(w)) for x, w in zip(xs, weights)]))

  x_ref = [tf.constant(x) for x in xs]
  with tf.GradientTape() as tape:
    tape.watch(x_ref)
    ys = reference(x_ref)
    total = tf.add_n([loss_of(y, w, x) for y, w, x in zip(ys, weights, x_ref)])
  want = tape.gradient(total, x_ref)
  for r in range(n):
    np.testing.assert_allclose(grads[r].numpy(), want[r].numpy(), rtol=1e-5, atol=1e-6, err_msg=f"replica {r}")


def test_max_gradient_splits_ties():
  repl = replicator.Replicator(cpus(2))

  def step_fn():
    x = tf.constant([1.0, 5.0])
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = repl.all_reduce(x, op="max")  # both replicas hold the max: a tie
    return tape.gradient(y, x)

  out = repl.run(step_fn)
  # d(sum over 2 replicas of y)/dx_r: 2 upstream ones, split over 2 tied replicas.
  np.testing.assert_allclose(out[0].numpy(), [1.0, 1.0])
  np.testing.assert_allclose(out[1].numpy(), [1.0, 1.0])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", [{"batch": 2, "model": 2}, {"batch": 2, "model": 4}])
def test_collectives_over_named_mesh_axes(shape, impl):
  import mesh
  m = mesh.Mesh(shape, cpus(shape["batch"] * shape["model"]))
  repl = replicator.Replicator(mesh=m, implementation=impl)
  values = [np.full([2], float(10 * i + 1), np.float32) for i in range(m.size)]

  def step_fn(x):
    return dict(model_sum=repl.all_reduce(x, axis="model"), batch_max=repl.all_reduce(x, op="max", axis="batch"),
                all_sum=repl.all_sum(x, axis=("batch", "model")), model_bcast=repl.broadcast(x, source=1, axis="model"))

  out = repl.run(step_fn, inputs=replicator.PerReplica(values))
  for d in range(m.size):
    model_group = next(g for g in m.groups("model") if d in g)
    batch_group = next(g for g in m.groups("batch") if d in g)
    np.testing.assert_allclose(out["model_sum"][d].numpy(), sum(values[i] for i in model_group))
    np.testing.assert_allclose(out["batch_max"][d].numpy(), np.max([values[i] for i in batch_group], axis=0))
    np.testing.assert_allclose(out["all_sum"][d].numpy(), sum(values))
    np.testing.assert_allclose(out["model_bcast"][d].numpy(), values[model_group[1]])
