"""Variables created inside a step: once, for every replica, from replica 0's initial value.

Initial values computed in the step graph are lifted out and evaluated once
(Sonnet's lazily built modules), or, where they depend on the step's data,
assigned on the first run; every replica gets the same variable.
"""

import numpy as np
import pytest
import sonnet as snt
import tensorflow as tf
from conftest import cpus
from conftest import replica_values

import replicator
from replicator.state import _lifting

X = np.random.RandomState(0).randn(8, 6, 6, 2).astype(np.float32)
SEQ = np.random.RandomState(1).randn(5, 8, 3).astype(np.float32)  # time-major: [T, B, F]
Y = np.random.RandomState(2).randn(8, 2).astype(np.float32)


def _seeded():
  return snt.initializers.TruncatedNormal(stddev=0.3, seed=7)


MODULES = {
    "linear": lambda: snt.Sequential([snt.Flatten(), snt.Linear(2, w_init=_seeded())]),
    "conv_mlp": lambda: snt.Sequential([snt.Conv2D(3, 3, w_init=_seeded()), tf.nn.relu, snt.Flatten(),
                                        snt.nets.MLP([5, 2], w_init=_seeded())]),
    "lstm_static": lambda: ("static", snt.LSTM(4, w_i_init=_seeded(), w_h_init=_seeded())),
    "gru_dynamic": lambda: ("dynamic", snt.GRU(4, w_i_init=_seeded(), w_h_init=_seeded())),
    "vanilla_dynamic": lambda: ("dynamic", snt.VanillaRNN(4, w_i_init=_seeded(), w_h_init=_seeded())),
}


class Model(snt.Module):
  """A Sonnet module built lazily: no variable exists before the first step."""

  def __init__(self, kind):
    super().__init__()
    made = MODULES[kind]()
    self.unroll, self.core = made if isinstance(made, tuple) else (None, made)
    self.head = snt.Linear(2, w_init=_seeded())

  def __call__(self, batch):
    if self.unroll is None:
      return self.core(batch)
    state = self.core.initial_state(batch.shape[1])
    unroll = snt.static_unroll if self.unroll == "static" else snt.dynamic_unroll
    outputs, _ = unroll(self.core, batch, state)
    return self.head(outputs[-1])


def _train(kind, n, steps=3):
  tf.random.set_seed(0)
  inputs = SEQ if kind.endswith(("static", "dynamic")) else X
  batch_axis = 1 if kind.endswith(("static", "dynamic")) else 0
  repl = replicator.Replicator(cpus(n)) if n else None
  with repl.context() if repl else tf.device("/cpu:0"):
    model = Model(kind)
    optimizer = snt.optimizers.Adam(0.05)
    if repl:
      optimizer = repl.wrap_optimizer(optimizer)

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(x) - y) ** 2)
    variables = model.trainable_variables
    optimizer.apply(tape.gradient(loss, variables), variables)
    return loss

  if repl is None:
    one_device = tf.function(step)
    for _ in range(steps):
      one_device((inputs, Y))
  else:
    per_replica = replicator.PerReplica(list(zip(np.split(inputs, n, axis=batch_axis), np.split(Y, n))))
    for _ in range(steps):
      repl.run(step, inputs=per_replica)
  return model, optimizer


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_lazily_built_sonnet_modules_train_equal_to_one_device(kind):
  # Was: VariableCreationError "initial value computed in the step graph".
  want, want_optimizer = _train(kind, None)
  got, optimizer = _train(kind, 4)
  assert [v.name for v in got.variables] == [v.name for v in want.variables]
  for a, v in zip(want.variables + want_optimizer.variables, got.variables + optimizer.variables):
    assert len(v.components) == 4
    for value in replica_values(v):
      np.testing.assert_allclose(value, a.numpy(), atol=1e-5, rtol=0, err_msg=v.name)


def test_a_variable_created_by_every_replica_is_one_variable_with_replica_0s_value():
  # Was: four variables with the values 0, 1, 2, 3.
  repl = replicator.Replicator(cpus(4))
  made = []

  def step():
    v = tf.Variable(float(repl.replica_id), name="counter")
    made.append(v)
    v.assign_add(1.0)
    return v.read_value()

  assert [float(x) for x in repl.run(step)] == [1.0] * 4
  assert len({id(v) for v in made}) == 1
  assert [float(c.numpy()) for c in made[0].components] == [1.0] * 4


def test_an_initial_value_from_the_steps_data_is_replica_0s_assigned_on_the_first_run():
  repl = replicator.Replicator(cpus(2))
  holder = []

  def step(x):
    if not holder:
      holder.append(tf.Variable(tf.reduce_mean(x) * 2.0, name="scale"))  # data-dependent (ActNorm-style)
    return holder[0].read_value() + 0.0 * x[0]

  first = repl.run(step, inputs=replicator.PerReplica([tf.constant([1.0, 3.0]), tf.constant([5.0, 7.0])]))
  assert [float(v) for v in first] == [4.0, 4.0]  # replica 0's mean (2) times 2, on both replicas
  second = repl.run(step, inputs=replicator.PerReplica([tf.constant([9.0, 9.0]), tf.constant([0.0, 0.0])]))
  assert [float(v) for v in second] == [4.0, 4.0]  # initialised once
  assert [float(c.numpy()) for c in holder[0].components] == [4.0, 4.0]


def test_a_random_initial_value_is_drawn_once_not_every_step():
  repl = replicator.Replicator(cpus(2))
  holder = []

  def step():
    if not holder:
      holder.append(tf.Variable(tf.random.normal([3], seed=1), name="noise"))
    return holder[0].read_value()

  first = repl.run(step)
  np.testing.assert_array_equal(first[0], first[1])
  (compiled,) = repl._views["local"].steps.get(step)[("none",)].values()  # pylint: disable=protected-access
  assert "RandomStandardNormal" not in [n.op for n in compiled.graph_def.node]  # lifted out, not run every step
  np.testing.assert_array_equal(repl.run(step)[0], first[0])


def test_a_variable_only_some_replicas_create_is_an_error():
  repl = replicator.Replicator(cpus(2))

  def step():
    if repl.replica_id == 1:
      tf.Variable(1.0, name="only_here")
    return tf.constant(0.0)

  with pytest.raises(replicator.VariableCreationError,
                     match=r"Replica 1 created the variable 'only_here' \(the step's variable #0\), but replica 0 "
                           r"created only 0 variable\(s\).*Fix: create it on every replica"):
    repl.run(step)

  def swapped():
    tf.Variable(1.0, name="a" if repl.replica_id == 0 else "b")
    return tf.constant(0.0)

  with pytest.raises(replicator.VariableCreationError,
                     match=r"Replica 1 created the variable 'b' as the step's variable #0, where replica 0 created "
                           r"'a'\."):
    repl.run(swapped)


def test_a_data_dependent_initial_value_needs_a_static_shape():
  repl = replicator.Replicator(cpus(2))
  holder = []

  def input_fn(ctx):
    return tf.data.Dataset.from_tensor_slices(np.ones([4, 2], np.float32)).batch(2)

  def step(x):
    if not holder:
      holder.append(tf.Variable(x * 2.0))
    return holder[0].read_value()

  with pytest.raises(replicator.VariableCreationError,
                     match=r"computed from the step's data .* whose shape is not static \(\(None, 2\)\).*Fix: give "
                           r"the initial value a static shape"):
    repl.run(step, input_fn)


def test_lift_refuses_step_inputs_and_state_changes():
  seen = {}

  @tf.function
  def trace(x):
    v = tf.constant([1.0, 2.0])
    seen["constant"] = _lifting.liftable_ops(v * 3.0) is not None
    seen["input"] = _lifting.liftable_ops(x * 3.0) is None
    seen["random"] = _lifting.lift(tf.random.uniform([2], seed=3)) is not None
    return x

  trace.get_concrete_function(tf.TensorSpec([2]))
  assert seen == {"constant": True, "input": True, "random": True}


def test_sonnet_batch_norm_built_in_the_step_averages_its_moving_statistics():
  # snt.BatchNorm's moving averages (snt.ExponentialMovingAverage: tf.Variables made on
  # the first call, aggregation NONE) are the replicas' mean: one device's moving mean
  # for equal batches; the moving variance is the mean of the replicas' variances.
  x = (np.arange(48, dtype=np.float32).reshape(16, 3) / 10) ** 1.5
  reference = snt.BatchNorm(create_scale=False, create_offset=False, decay_rate=0.9)
  one_device = tf.function(lambda b: reference(b, is_training=True))
  for _ in range(3):
    one_device(x)
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    bn = snt.BatchNorm(create_scale=False, create_offset=False, decay_rate=0.9)
  inputs = replicator.PerReplica(np.split(x, 4))
  for _ in range(3):
    repl.run(lambda b: bn(b, is_training=True), inputs=inputs)
  np.testing.assert_allclose(np.asarray(bn.moving_mean.value), reference.moving_mean.value.numpy(), rtol=1e-5)
  for component in bn.moving_mean.average.components:
    np.testing.assert_allclose(component.numpy(), reference.moving_mean.value.numpy(), rtol=1e-5)
  variance = np.mean([part.var(axis=0) for part in np.split(x, 4)], axis=0)[None]  # snt keeps [1, C]
  np.testing.assert_allclose(np.asarray(bn.moving_variance.value), variance, rtol=1e-5)
