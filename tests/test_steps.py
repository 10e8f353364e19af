"""repl.run(..., steps=k): k steps in one graph call (an in-graph loop) == k separate calls."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import IMPLEMENTATIONS
from conftest import cpus

import replicator

BATCH = 8
X = np.random.RandomState(0).randn(10 * BATCH, 4).astype(np.float32)
Y = np.random.RandomState(1).randint(0, 3, size=10 * BATCH).astype(np.int32)


def trainer(n, implementation="auto"):
  repl = replicator.Replicator(cpus(n), implementation=implementation)
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    opt = repl.wrap_optimizer(keras.optimizers.Adam(0.01))

  def input_fn(ctx):
    b = ctx.get_per_replica_batch_size(BATCH)
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    return ds.map(lambda x, y: (x[ctx.replica_id * b:(ctx.replica_id + 1) * b], y[ctx.replica_id * b:(ctx.replica_id + 1) * b]))

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  return repl, model, step_fn, input_fn


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_k_steps_in_one_call_equal_k_calls(n, impl):
  repl, model, step_fn, input_fn = trainer(n, impl)
  separate = [repl.reduce("mean", repl.run(step_fn, input_fn)) for _ in range(3)]
  want = [v.numpy() for v in model.trainable_variables]

  keras.backend.clear_session()
  repl2, model2, step_fn2, input_fn2 = trainer(n, impl)
  losses = repl2.run(step_fn2, input_fn2, steps=3, all_steps=True)
  assert repl2.steps_run == 3
  assert losses[0].shape == (3,)  # one loss per step, stacked
  np.testing.assert_allclose(repl2.reduce("mean", losses).numpy(), [float(v) for v in separate], atol=1e-6)
  for got, expected in zip(model2.trainable_variables, want, strict=True):
    for component in got.value.components:
      np.testing.assert_allclose(component.numpy(), expected, atol=1e-6)
  # Without all_steps: the last step's result.
  last = repl2.run(step_fn2, input_fn2, steps=2)
  assert last[0].shape == ()
  assert repl2.trace_count == 1  # one trace serves every steps= value


def test_loop_stops_when_the_input_ends():
  repl, model, step_fn, input_fn = trainer(2)
  losses = repl.run(step_fn, input_fn, steps=7, all_steps=True)
  assert repl.steps_run == 7 and losses[0].shape == (7,)
  losses = repl.run(step_fn, input_fn, steps=7, all_steps=True)  # only 3 batches are left
  assert repl.steps_run == 3 and losses[1].shape == (3,)
  with pytest.raises(replicator.EndOfInput):
    repl.run(step_fn, input_fn, steps=7)


def test_explicit_inputs_repeat_each_step():
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    v = tf.Variable(0.0)

  def step_fn(x):
    v.assign_add(repl.all_sum(x))
    return v.read_value()

  out = repl.run(step_fn, inputs=replicator.PerReplica([1.0, 2.0, 3.0, 4.0]), steps=5, all_steps=True)
  np.testing.assert_allclose(out[2].numpy(), [10.0, 20.0, 30.0, 40.0, 50.0])
  assert [c.numpy() for c in v.components] == [50.0] * 4


def test_steps_must_be_positive():
  repl = replicator.Replicator(cpus(2))
  with pytest.raises(ValueError, match=r"steps must be a positive integer"):
    repl.run(lambda: tf.constant(1.0), steps=0)


@pytest.mark.parametrize("view", ["local", "global"])
def test_ctrl_c_stops_a_loop_of_steps_after_the_step_in_progress(view):
  # Was: SIGINT waited for all k steps (3 s to be noticed, 7.6 s to stop) and left steps_run stale.
  import os  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2}, devices=cpus(2)), view=view)
  with repl.context():
    count = tf.Variable(0, trainable=False)

  def slow_step(x):  # about 7 ms of matrix products on this machine
    y = tf.fill([192, 192], tf.reduce_mean(x) * 1e-3)
    for _ in range(30):
      y = tf.tanh(tf.matmul(y, y))
    count.assign_add(1)
    return tf.reduce_sum(y)

  data = tf.data.Dataset.from_tensors(tf.ones([4, 2])).repeat()
  repl.run(slow_step, data, steps=2)  # built
  count.assign(0)
  # Python's own Ctrl-C handler: a process started in the background by a shell ignores SIGINT, and so does Python.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
  start = time.perf_counter()
  timer.start()
  try:
    with pytest.raises(KeyboardInterrupt):
      repl.run(slow_step, data, steps=10_000)
  finally:
    signal.signal(signal.SIGINT, previous)
  elapsed = time.perf_counter() - start
  timer.join()
  assert 0 < repl.steps_run < 10_000 and elapsed < 10  # 10,000 steps take 65-80 s
  assert repl.steps_run == int(count.numpy())  # the steps that ran, counted; each whole (kept)
  repl.run(slow_step, data, steps=3)  # runs again
  assert repl.steps_run == 3
