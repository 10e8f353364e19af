"""Any callable is a step; tf.function helpers inside a step are traced inline, per replica."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import replica_values

import replicator

X = np.random.RandomState(0).randn(16, 5).astype(np.float32)
Y = np.random.RandomState(1).randn(16, 2).astype(np.float32)


def _model():
  keras.utils.set_random_seed(2)
  return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def _one_device(steps=3):
  model, optimizer = _model(), keras.optimizers.Adam(0.05)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(x) - y) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  for _ in range(steps):
    step(X, Y)
  return [v.numpy() for v in model.variables + optimizer.variables]


def _assert_equals_one_device(model, optimizer):
  want = _one_device()
  got = model.variables + list(optimizer.variables)
  assert len(want) == len(got)
  for a, v in zip(want, got):
    for value in replica_values(v):
      np.testing.assert_allclose(value, a, atol=1e-5, rtol=0, err_msg=v.path)


class Trainer:
  """The usual shape of a research script: state on self, the step a method."""

  def __init__(self, repl, helper=False):
    self.repl = repl
    with repl.context():
      self.model = _model()
      self.optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.05))
    self.loss_fn = tf.function(self._loss) if helper else self._loss

  def _loss(self, x, y):
    return tf.reduce_mean((self.model(x) - y) ** 2)

  def step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.loss_fn(x, y)
    grads = tape.gradient(loss, self.model.trainable_variables)
    self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
    return loss

  @tf.function
  def decorated_step(self, batch):
    return self.step(batch)


def _inputs(n):
  return replicator.PerReplica(list(zip(np.split(X, n), np.split(Y, n))))


@pytest.mark.parametrize("which", ["step", "decorated_step"])
def test_a_bound_method_is_a_step(which):
  repl = replicator.Replicator(cpus(4))
  trainer = Trainer(repl)
  for _ in range(3):
    repl.run(getattr(trainer, which), inputs=_inputs(4))
  _assert_equals_one_device(trainer.model, trainer.optimizer)


def test_a_loss_through_a_tf_function_helper_trains_equal_to_one_device():
  # Was: Keras "No gradients provided for any variable".
  repl = replicator.Replicator(cpus(4))
  trainer = Trainer(repl, helper=True)
  for _ in range(3):
    repl.run(trainer.step, inputs=_inputs(4))
  _assert_equals_one_device(trainer.model, trainer.optimizer)


def test_gradient_through_a_tf_function_of_a_replicated_variable():
  # Was: NotImplementedError: numpy() is only available when eager execution is enabled.
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    v = tf.Variable(3.0)
  square = tf.function(lambda x: x * x)

  def step():
    with tf.GradientTape() as tape:
      y = square(v) * tf.cast(repl.replica_id + 1, tf.float32)
    return tape.gradient(y, v)

  assert [float(g) for g in repl.run(step)] == [6.0, 12.0]  # d/dv (r + 1) v^2 = 2 v (r + 1)


def test_a_helper_reads_and_writes_its_replicas_component():
  repl = replicator.Replicator(cpus(3))
  with repl.context():
    v = tf.Variable(1.0)

  @tf.function
  def bump(amount):
    v.assign_add(amount)
    return v.read_value()

  out = repl.run(lambda: bump(tf.cast(repl.replica_id, tf.float32)))
  assert [float(x) for x in out] == [1.0, 2.0, 3.0]
  assert [float(c.numpy()) for c in v.components] == [1.0, 2.0, 3.0]


def test_collectives_inside_a_tf_function_helper():
  repl = replicator.Replicator(cpus(4))

  @tf.function
  def mean_of(x):
    return repl.all_reduce(x, "mean")

  out = repl.run(lambda: mean_of(tf.cast(repl.replica_id, tf.float32)))
  assert [float(x) for x in out] == [1.5] * 4


def test_python_control_flow_on_tensors_in_a_helper_says_how_to_fix_it():
  repl = replicator.Replicator(cpus(2))

  @tf.function
  def relu(x):
    if x > 0:  # a tensor-valued condition: needs AutoGraph
      return x
    return tf.zeros_like(x)

  with pytest.raises(tf.errors.OperatorNotAllowedInGraphError,
                     match=r"a tf.function called inside step_fn is traced inline, once per replica, without "
                           r"AutoGraph.*Fix: remove its @tf.function decorator"):
    repl.run(lambda: relu(tf.constant(1.0)))


def test_the_same_in_the_step_itself_is_converted():
  repl = replicator.Replicator(cpus(2))

  @tf.function
  def step(x):
    if tf.reduce_sum(x) > 0:  # AutoGraph converts the step, decorated or not
      return x
    return -x

  out = repl.run(step, inputs=replicator.PerReplica([tf.constant([1.0]), tf.constant([-2.0])]))
  assert [t.numpy().tolist() for t in out] == [[1.0], [2.0]]


def test_partials_callable_objects_and_variable_methods_are_steps():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    v = tf.Variable([1.0, 2.0])

  class Scale:
    def __init__(self, k):
      self.k = k

    def __call__(self, x):
      return x * self.k

  inputs = replicator.PerReplica([tf.constant(1.0), tf.constant(2.0)])
  assert [float(t) for t in repl.run(functools.partial(tf.add, 10.0), inputs=inputs)] == [11.0, 12.0]
  assert [float(t) for t in repl.run(Scale(3.0), inputs=inputs)] == [3.0, 6.0]
  assert [t.numpy().tolist() for t in repl.run(v.read_value)] == [[1.0, 2.0]] * 2


def test_tf_functions_called_outside_steps_are_unaffected():
  repl = replicator.Replicator(cpus(2))
  repl.run(lambda: tf.constant(1.0))
  assert not tf.config.functions_run_eagerly()
  traced = tf.function(lambda: tf.constant(1.0))
  traced()
  assert traced.experimental_get_tracing_count() == 1


def test_a_plain_input_is_given_to_every_replica():
  # As strategy.run(fn, args=(x,)): not split, not an error.
  repl = replicator.Replicator(cpus(3))
  out = repl.run(lambda x: x["a"] * tf.cast(repl.replica_id, tf.float32), inputs={"a": tf.constant([1.0, 2.0])})
  assert [t.numpy().tolist() for t in out] == [[0.0, 0.0], [1.0, 2.0], [2.0, 4.0]]
  mixed = repl.run(lambda x: x[0] + x[1], inputs=(10.0, replicator.PerReplica([1.0, 2.0, 3.0])))
  assert [float(t) for t in mixed] == [11.0, 12.0, 13.0]
