"""The global view's rule for ``While``: loops whose body runs on each device's pieces, their splits kept.

Each test runs against one device; warnings are errors in the suite, so a test that does not expect a warning
also checks that nothing fell back, and ``strict=True`` makes a fallback an error besides.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import copies_distance
from conftest import cpus
from conftest import keras_step

import mesh
import replicator

MESHES = {"2x2": {"batch": 2, "model": 2}, "4x1": {"batch": 4}}
BATCH_AXES = ("batch",)
ATOL = 1e-5  # measured: 4.8e-7 (the recurrence's loss, 4x1; its gradients 2.4e-7), 1.2e-7 (Keras RNNs after 3 Adam
# steps, every variable and slot; see below)


def _repl(shape="2x2", strict=True, layouts=None):
  return replicator.Replicator(mesh=mesh.Mesh(MESHES[shape], devices=cpus(4)), batch_axes=("batch",),
                               layouts=None if layouts is None else mesh.LayoutMap(layouts), view="global",
                               strict=strict)


def _recurrence(x, w):
  """A cumulative tanh recurrence over the time steps of ``x`` [batch, time, features]: a plain tf.while_loop."""

  def body(t, h, total):
    h = tf.tanh(tf.matmul(h, w) + tf.gather(x, t, axis=1))
    return t + 1, h, total + h

  zeros = tf.zeros([x.shape[0], w.shape[1]])
  _, h, total = tf.while_loop(lambda t, h, total: t < x.shape[1], body, [tf.constant(0), zeros, zeros])
  return h, total


def _loss_and_grads(fn, x, w):
  with tf.GradientTape() as tape:
    tape.watch(x)
    h, total = fn(x, w)
    loss = tf.reduce_mean(tf.square(total)) + tf.reduce_sum(h)
  dw, dx = tape.gradient(loss, [w, x])
  return loss, tf.convert_to_tensor(dw), dx


def _equal_to_one_device(fn, x, w0, shape="2x2"):
  """Runs ``_loss_and_grads(fn)`` in the global view (strict) and on one device; asserts equal. Returns the
  Replicator, the step and the dataset (for ``repl.explain``)."""
  expected = tf.function(lambda x, w: _loss_and_grads(fn, x, w))(tf.constant(x), tf.Variable(w0))
  repl = _repl(shape)
  with repl.context():
    w = tf.Variable(w0, name="w")

  def step_fn(batch):
    return _loss_and_grads(fn, batch, w)

  dataset = tf.data.Dataset.from_tensors(x)
  got = repl.run(step_fn, dataset)
  for what, a, b in zip(("loss", "d/dw", "d/dx"), got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL, err_msg=what)
  return repl, step_fn, dataset


def _data(rows=8, time=5, features=3):
  return np.random.default_rng(0).normal(size=(rows, time, features)).astype("float32")


def _weights(features=3):
  return (np.random.default_rng(1).normal(size=(features, features)) * 0.5).astype("float32")


@pytest.mark.parametrize("shape", sorted(MESHES))
def test_a_while_loop_over_a_batch_split_tensor_equals_one_device_without_a_fallback(shape):
  # The state h enters whole (zeros) and comes back split over the batch: it enters split (sliced, for free). The
  # gradient's loop carries w's gradient as each device's partial sums, all-reduced once after the loop.
  repl, step_fn, dataset = _equal_to_one_device(_recurrence, _data(), _weights(), shape)
  plan = repl.explain(step_fn, dataset)
  assert not plan.fallbacks
  loops = [c for c in plan.collective_rows if "While" in c.op_type]
  assert [(c.kind, c.shape, c.why) for c in loops] == [("all_reduce", (3, 3), loops[0].why)], loops
  assert loops[0].why.startswith("partial sum")  # w's gradient: one all-reduce, after the loop
  assert not [r for r in plan.relayouts if not r.free and r.op_type != "return"]  # nothing gathered for the loops


def test_tf_scan_over_batch_split_rows_equals_one_device():
  # tf.scan reads its elements from a TensorList made from the sequence (time major: each element the batch's rows
  # at one time step, split over "batch") and writes the results to another.
  def scan(x, w):
    elements = tf.transpose(x, [1, 0, 2])
    states = tf.scan(lambda h, row: tf.tanh(tf.matmul(h, w) + row), elements,
                     initializer=tf.zeros([x.shape[0], w.shape[1]]))
    return states[-1], tf.reduce_sum(states, axis=0)

  repl, step_fn, dataset = _equal_to_one_device(scan, _data(), _weights())
  assert not repl.explain(step_fn, dataset).fallbacks


def test_a_split_value_the_body_gathers_is_gathered_before_the_loop():
  # The outer product of the batch-split column with itself needs it whole (a relayout in the body: a gather),
  # so the loop variable is gathered before the loop and the loop runs on it whole, communicating nothing.
  x = np.arange(8, dtype=np.float32) - 3.0

  def step_fn(v):
    def body(t, v, acc):
      return t + 1, v, acc + v[:, None] * v[None, :] * tf.cast(t + 1, tf.float32)

    _, _, acc = tf.while_loop(lambda t, v, acc: t < 3, body, [tf.constant(0), v, tf.zeros([8, 8])])
    return acc

  repl = _repl("4x1")
  got = repl.run(step_fn, tf.data.Dataset.from_tensors(x))
  np.testing.assert_allclose(np.asarray(got), np.outer(x, x) * 6.0)
  plan = repl.explain(step_fn, tf.data.Dataset.from_tensors(x))
  assert not plan.fallbacks
  (gather,) = [r for r in plan.relayouts if not r.free]
  assert gather.op_type == "StatelessWhile" and (gather.source, gather.target) == ((("batch",),), ((),))


def test_a_loop_whose_body_needs_a_collective_falls_back_naming_the_op():
  # Each step subtracts the mean over the split batch: an all-reduce inside the body, not placed in loops yet. The
  # loop runs on gathered inputs, right, with the fallback's warning; repl.explain names the op of the body.
  x = _data()

  def step_fn(x):
    def body(t, h):
      h = tf.tanh(h + tf.gather(x, t, axis=1))
      return t + 1, h - tf.reduce_max(h, axis=0)

    _, h = tf.while_loop(lambda t, h: t < x.shape[1], body, [tf.constant(0), tf.zeros([8, 3])])
    return tf.reduce_sum(h, axis=1)

  expected = tf.function(step_fn)(tf.constant(x))
  repl = _repl(strict=False)
  dataset = tf.data.Dataset.from_tensors(x)
  with pytest.warns(UserWarning, match=r"cannot partition StatelessWhile .*: .*needs communication"):
    got = repl.run(step_fn, dataset)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=ATOL)
  (row,) = repl.explain(step_fn, dataset).fallbacks
  assert row.op_type == "StatelessWhile"
  assert "Max while/Max in its body needs communication" in row.why, row.why
  assert "Max while/Max in its body needs communication" in str(repl.explain(step_fn, dataset))
  with pytest.raises(replicator.UnsupportedError, match=r"StatelessWhile \(while, at .*test_rules_loops.py"):
    _repl(strict=True).run(step_fn, dataset)


def test_a_scan_whose_body_needs_a_collective_runs_on_whole_rows_gathered_before_it():
  # tf.scan reads the rows from a list made before the loop; a list cannot be gathered, so where the body would
  # communicate (the max over the split batch) the list is made of whole rows instead (the sequence gathered before
  # the loop, as explain's relayouts show) and the loop runs whole on every device. Was: TensorListFromTensor fell
  # back; refusing the loop for its list of pieces would have been worse.
  def step_fn(x):
    rows = tf.transpose(x, [1, 0, 2])
    states = tf.scan(lambda h, row: tf.tanh(h + row) - tf.reduce_max(h, axis=0), rows, initializer=tf.zeros([8, 3]))
    return tf.reduce_sum(states, axis=0)

  x = _data(time=4)
  expected = tf.function(step_fn)(tf.constant(x))
  repl = _repl()
  dataset = tf.data.Dataset.from_tensors(x)
  np.testing.assert_allclose(np.asarray(repl.run(step_fn, dataset)), np.asarray(expected), rtol=0, atol=ATOL)
  plan = repl.explain(step_fn, dataset)
  assert [(r.source, r.target) for r in plan.relayouts if not r.free] == [((BATCH_AXES, (), ()), ((), (), ()))]
  assert not [c for c in plan.collective_rows if "While" in c.op_type]


def test_a_loop_whose_gradient_s_loop_cannot_run_partitioned_falls_back_with_it():
  # A loop in a loop, under a gradient tape: the inner gradient loop pops lists of lists, whose elements' shapes are
  # not known in the outer gradient's body, so the outer gradient loop cannot run partitioned. Its lists could not
  # be gathered, so the forward loop falls back too (was it partitioned, the gradient's loop would be refused).
  def fn(x, w):
    def outer(i, h):
      def inner(j, g):
        return j + 1, tf.tanh(tf.matmul(g, w) + tf.gather(x, i, axis=1))

      return (i + 1,) + tuple(tf.while_loop(lambda j, g: j < 2, inner, [tf.constant(0), h])[1:])

    _, h = tf.while_loop(lambda i, h: i < 3, outer, [tf.constant(0), tf.zeros([8, 3])])
    return h, h

  expected = tf.function(lambda x, w: _loss_and_grads(fn, x, w))(tf.constant(_data()), tf.Variable(_weights()))
  repl = _repl(strict=False)
  with repl.context():
    w = tf.Variable(_weights(), name="w")

  def step_fn(batch):
    return _loss_and_grads(fn, batch, w)

  dataset = tf.data.Dataset.from_tensors(_data())
  with pytest.warns(UserWarning, match=r"cannot partition While \(while,"):
    got = repl.run(step_fn, dataset)
  for what, a, b in zip(("loss", "d/dw", "d/dx"), got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL, err_msg=what)
  (row,) = repl.explain(step_fn, dataset).fallbacks
  assert row.why.startswith("its gradient's loop gradient_tape/while/while_grad would not run partitioned"), row


# Keras's recurrent layers: a While over a TensorList of the time steps, its gradient another While over the lists
# of intermediates the forward loop pushed.

BATCH = 12
RNN_STEPS = 3


def _rnn(context, kind, sequences):
  with context:
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Input((5, 3)), getattr(keras.layers, kind)(8, return_sequences=sequences, name="rnn")]
    model = keras.Sequential(layers + ([keras.layers.Flatten()] if sequences else []) + [keras.layers.Dense(4)])
    opt = keras.optimizers.Adam(1e-2)
  return model, opt


def _sequences():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * RNN_STEPS, 5, 3)).astype("float32")
  y = rng.integers(0, 4, size=BATCH * RNN_STEPS).astype("int32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


@pytest.mark.parametrize("sequences", [False, True], ids=["last", "sequences"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_keras_rnn_trains_with_its_batch_split_and_equals_one_device(kind, sequences):
  # Was: a fallback (the sequence gathered, the loops run whole on every device). Now each device runs the loops
  # on its rows; the gradient loop's weight gradients are all-reduced after it. Measured: 3e-8 (LSTM), 1.2e-7
  # (LSTM, sequences), 6e-8 (GRU), 4.5e-8 (GRU, sequences) over every variable and Adam slot after 3 steps.
  one_model, one_opt = _rnn(contextlib.nullcontext(), kind, sequences)
  one_step = tf.function(keras_step(one_model, one_opt))
  expected = [float(one_step(batch)) for batch in _sequences()]
  repl = _repl("2x2")
  model, opt = _rnn(repl.context(), kind, sequences)
  step_fn = keras_step(model, opt)
  dataset = _sequences()
  losses = [float(repl.run(step_fn, dataset)) for _ in range(RNN_STEPS)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=ATOL)
  assert copies_distance(model.variables + opt.variables, one_model.variables + one_opt.variables) <= ATOL
  assert int(opt.iterations.numpy()) == RNN_STEPS


def test_a_keras_lstm_step_explained_has_no_fallback_and_its_loops_communicate_nothing_inside():
  repl = _repl("2x2")
  model, opt = _rnn(repl.context(), "LSTM", False)
  step_fn = keras_step(model, opt)
  plan = repl.explain(step_fn, _sequences())
  assert not plan.fallbacks
  loops = [c for c in plan.collective_rows if "While" in c.op_type]
  # After the gradient loop: the sums of the kernel's, the recurrent kernel's and the bias's gradients.
  assert sorted(c.shape for c in loops) == [(3, 32), (8, 32), (32,)], loops
  assert all(c.kind == "all_reduce" and c.axes == ("batch",) and c.why.startswith("partial sum") for c in loops)
  assert not [r for r in plan.relayouts if not r.free]


def test_a_keras_lstm_fits_with_its_batch_split_and_equals_one_device():
  # Keras's own train step (model.fit) in the global view. Measured: 6e-8.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * 3, 5, 3)).astype("float32")
  y = rng.integers(0, 4, size=BATCH * 3).astype("int32")

  def fit(context):
    with context:
      keras.utils.set_random_seed(1)
      model = keras.Sequential([keras.layers.Input((5, 3)), keras.layers.LSTM(8), keras.layers.Dense(4)])
      model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    history = model.fit(dataset, epochs=2, verbose=0, shuffle=False).history
    return model, history["loss"]

  one_model, expected = fit(contextlib.nullcontext())
  model, losses = fit(_repl("2x2").context())
  np.testing.assert_allclose(losses, expected, rtol=0, atol=ATOL)
  assert copies_distance(model.variables + model.optimizer.variables,
                         one_model.variables + one_model.optimizer.variables) <= ATOL


LSTM_UNITS = {r"lstm/lstm_cell/(recurrent_)?kernel$": (None, "model")}


def test_a_keras_lstm_with_a_split_kernel_is_refused_naming_the_op():
  # The kernels split over "model" (the bias not): the body would gather the gates for the bias, inside the loop.
  repl = _repl("2x2", strict=False, layouts=LSTM_UNITS)
  with repl.context():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((5, 3)), keras.layers.LSTM(8, name="lstm"), keras.layers.Dense(4)])
    opt = keras.optimizers.Adam(1e-2)
  with pytest.raises(replicator.UnsupportedError,
                     match=r"cannot partition While \(.*lstm.*\): it takes the handle of a sharded variable.*"
                           r"\(BiasAdd .*lstm_cell.*/BiasAdd in its body gathers a split input\)"):
    repl.run(keras_step(model, opt), _sequences())
