"""``repl.with_layout`` (``replicator/core/_layout_constraint.py``): a layout the global-view step states for a value.

Each case is the step on one device against the same step on the mesh, with the
value laid out as stated: the results equal, and ``explain`` shows the value in
the stated layout (the relayouts' reason "the layout the step states for it"),
its gradient too. Tolerance: a split contraction sums in another order; these
runs differ from one device by at most 3.4e-7 of a value (1.4e-6 of a gradient
of 4.3), so rtol 2e-6; a lost piece of a sum is off by 1e-1 or more.
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator

ATOL, RTOL = 1e-6, 2e-6
STATED = "the layout the step states for it"


def _repl(view="global", **kwargs):
  return replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)), view=view, **kwargs)


def _weights():
  rng = np.random.default_rng(0)
  return rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)


def _batch():
  return np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)


def _mlp(w1, w2, state=lambda h: h):
  def step(x):
    with tf.GradientTape() as tape:
      h = state(tf.nn.relu(tf.matmul(x, w1)))
      loss = tf.reduce_sum(tf.sin(tf.matmul(h, w2)))
    return loss, tape.gradient(loss, [w1, w2])
  return step


def _one_device():
  w1, w2 = (tf.Variable(w) for w in _weights())
  return tf.function(_mlp(w1, w2))(tf.constant(_batch()))


@pytest.mark.parametrize("spec", [("batch", None), ("batch", "model"), (None, "model"), (("batch", "model"), None)])
def test_a_stated_layout_keeps_the_values_and_lays_the_value_out_so(spec):
  expected = _one_device()
  repl = _repl(layouts={"w1": (None, "model"), "w2": ("model", None)})
  with repl.context():
    w1, w2 = tf.Variable(_weights()[0], name="w1"), tf.Variable(_weights()[1], name="w2")
  step = _mlp(w1, w2, lambda h: repl.with_layout(h, spec))
  data = tf.data.Dataset.from_tensors(_batch()).repeat()
  loss, grads = repl.run(step, data)
  np.testing.assert_allclose(float(loss), float(expected[0]), rtol=RTOL, atol=ATOL)
  for ours, theirs in zip(grads, expected[1]):
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=RTOL, atol=ATOL)

  report = repl.explain(step, data)
  want = tuple(tuple(e) if isinstance(e, tuple) else ((e,) if e else ()) for e in spec)
  stated = [row for row in report.relayouts if row.op_name.startswith("with_layout")]
  # The value and its gradient are in the stated layout (relayouted there, or computed so directly).
  assert all(row.target == want for row in stated)
  rows = [c for c in report.collective_rows if STATED in c.why]
  assert all(c.op_name.startswith("with_layout") for c in rows)
  if spec == ("batch", None):  # relu's output, split by the kernel's columns, and its gradient (split by w2's
    # rows): each gathered, as stated
    assert [(c.kind, c.axes) for c in rows] == [("all_gather", ("model",))] * 2


def test_the_ops_before_a_stated_layout_compute_it_directly():
  # tf.sin of a batch-split input, stated split over both axes: the sine runs on the finer piece (the input is
  # sliced for free), nothing is gathered or moved.
  repl = _repl()
  data = tf.data.Dataset.from_tensors(_batch()).repeat()

  def step(x):
    return tf.reduce_sum(repl.with_layout(tf.sin(x), (("batch", "model"), None)) ** 2)

  np.testing.assert_allclose(float(repl.run(step, data)), np.sum(np.sin(_batch()) ** 2), rtol=1e-6)
  report = repl.explain(step, data)
  assert [c.kind for c in report.collective_rows] == ["all_reduce"]  # the sum's partial sums only
  sine = [row for row in report.relayouts if row.op_type == "Sin"]
  assert sine and all(row.target == (("batch", "model"), ()) and not row.gathered for row in sine)


def test_a_nest_is_laid_out_leaf_by_leaf_and_the_spec_may_be_a_layout():
  repl = _repl()
  data = tf.data.Dataset.from_tensors(_batch()).repeat()

  def step(x):
    a, b = repl.with_layout((x, 2 * x), mesh.Layout(("batch", "model"), repl.mesh))
    return tf.reduce_sum(a * b)

  np.testing.assert_allclose(float(repl.run(step, data)), 2 * np.sum(_batch() ** 2), rtol=1e-6)


def test_what_cannot_be_stated_is_refused_naming_the_call_and_the_fix():
  repl = _repl()
  data = tf.data.Dataset.from_tensors(_batch()).repeat()
  with pytest.raises(mesh.LayoutError, match=r"laid out at .*test_layout_constraint.py:\d+ in <lambda>.*'nope'.*Fix: use one of"):
    repl.run(lambda x: repl.with_layout(x, ("batch", "nope")), data)
  with pytest.raises(mesh.LayoutError, match=r"laid out at .*: Cannot split the value of shape \[4, 7\].*dimension 1 "
                                             r"has size 7, which is not divisible by 2.*Fix: make dimension 1"):
    odd = tf.data.Dataset.from_tensors(np.ones((4, 7), np.float32)).repeat()
    repl.run(lambda x: repl.with_layout(x, (None, "model")), odd)
  with pytest.raises(replicator.ArgumentError, match=r"x has 2 dimensions .*the spec 1 entries.*Fix: give one entry"):
    repl.run(lambda x: repl.with_layout(x, ("batch",)), data)
  with pytest.raises(replicator.ArgumentTypeError, match=r"expected a spec, a tuple with one entry per dimension"):
    repl.run(lambda x: repl.with_layout(x, "batch"), data)
  with pytest.raises(replicator.ReplicaContextError, match=r"outside a step.*Fix: call it inside the step function"):
    repl.with_layout(tf.ones([4, 4]), ("batch", None))
  local = _repl(view="local")
  with pytest.raises(replicator.ReplicaContextError, match=r"runs in the local view.*Fix: construct the Replicator "
                                                           r"with view=\"global\""):
    local.run(lambda: local.with_layout(tf.ones([4, 4]), ("batch", None)))
