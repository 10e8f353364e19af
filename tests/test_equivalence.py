"""K training steps on N replicas == the same K steps on one device with the global batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import REPLICA_COUNTS
from conftest import cpus

import replicator

GLOBAL_BATCH = 32
STEPS = 3
TOL = 1e-5


def data(seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randn(STEPS * GLOBAL_BATCH, 8).astype(np.float32)
  y = rng.randint(0, 4, size=STEPS * GLOBAL_BATCH).astype(np.int32)
  return x, y


def global_batches():
  x, y = data()
  return [(x[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH], y[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH])
          for k in range(STEPS)]


def input_fn(ctx):
  """Replica r reads rows [r*b, (r+1)*b) of every global batch."""
  b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
  x, y = data()
  rows = np.concatenate([np.arange(k * GLOBAL_BATCH + ctx.replica_id * b, k * GLOBAL_BATCH + (ctx.replica_id + 1) * b)
                         for k in range(STEPS)])
  return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(b)


def assert_replicated_equal(reference_values, replicated_variables):
  assert len(reference_values) == len(replicated_variables)
  for want, var in zip(reference_values, replicated_variables):
    components = var.components
    for c in components:
      np.testing.assert_allclose(c.numpy(), want, atol=TOL, rtol=0)
      np.testing.assert_array_equal(c.numpy(), components[0].numpy())  # replicas identical


def unwrap(v):
  """The ReplicatedVariable behind a Keras variable (or the variable itself)."""
  return v.value if isinstance(v, keras.Variable) else v


# -- Keras 3 + Adam ---------------------------------------------------------------------

def keras_model_and_opt(opt_name):
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
  opt = {"adam": lambda: keras.optimizers.Adam(1e-2),
         "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
         "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1)}[opt_name]()
  return model, opt


def keras_loss(model, x, y):
  return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))


def keras_reference(opt_name):
  model, opt = keras_model_and_opt(opt_name)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = keras_loss(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  losses = [float(step(x, y)) for x, y in global_batches()]
  return [v.numpy() for v in model.trainable_variables], [v.numpy() for v in opt.variables], losses


@pytest.mark.parametrize("opt_name,n", [  # CI: Adam at every count, the others at 4 replicas; --full-grid: all
    pytest.param(o, n, marks=() if o == "adam" or n == 4 else (pytest.mark.full_grid,))
    for o in ("adam", "sgd_momentum", "adamw") for n in REPLICA_COUNTS])
def test_keras_mlp(opt_name, n):
  want_params, want_slots, want_losses = keras_reference(opt_name)
  keras.backend.clear_session()
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    model, base_opt = keras_model_and_opt(opt_name)
    opt = repl.wrap_optimizer(base_opt)

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = keras_loss(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  losses = [float(repl.reduce("mean", repl.run(step_fn, input_fn))) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, want_losses, atol=TOL)
  assert_replicated_equal(want_params, [unwrap(v) for v in model.trainable_variables])
  # Optimizer state (iterations, learning rate, slots created lazily in the first step):
  # under the default sharded update each slot is current on its owner, and read from there.
  assert opt.update == ("sharded" if n > 1 else "replicated")
  assert len(want_slots) == len(base_opt.variables)
  for want, v in zip(want_slots, base_opt.variables):
    np.testing.assert_allclose(v.numpy(), want, atol=TOL, rtol=0)
  assert int(base_opt.iterations.numpy()) == STEPS


# -- tf.Module + SGD ---------------------------------------------------------------------

class MLP(tf.Module):

  def __init__(self):
    super().__init__()
    rng = np.random.RandomState(2)
    self.w1 = tf.Variable(rng.randn(8, 16).astype(np.float32) * 0.3)
    self.b1 = tf.Variable(np.zeros(16, np.float32))
    self.w2 = tf.Variable(rng.randn(16, 4).astype(np.float32) * 0.3)
    self.b2 = tf.Variable(np.zeros(4, np.float32))

  def __call__(self, x):
    return tf.nn.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2


def module_loss(module, x, y):
  logits = module(x)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_tf_module_sgd(n):
  ref = MLP()
  ref_opt = keras.optimizers.SGD(0.5)
  for x, y in global_batches():
    with tf.GradientTape() as tape:
      loss = module_loss(ref, x, y)
    ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))

  repl = replicator.Replicator(cpus(n))
  with repl.context():
    module = MLP()
    opt = repl.wrap_optimizer(keras.optimizers.SGD(0.5))
  assert all(isinstance(v, replicator.ReplicatedVariable) for v in module.trainable_variables)

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = module_loss(module, x, y)
    opt.apply_gradients(zip(tape.gradient(loss, module.trainable_variables), module.trainable_variables))
    return loss

  for _ in range(STEPS):
    repl.run(step_fn, input_fn)
  assert_replicated_equal([v.numpy() for v in ref.trainable_variables], module.trainable_variables)


@pytest.mark.parametrize("n", [2, 4])
def test_tf_module_manual_sgd_with_sum_reduction(n):
  """A hand-written update with the loss scaled by the global batch and reduction='sum'."""
  ref = MLP()
  for x, y in global_batches():
    with tf.GradientTape() as tape:
      loss = module_loss(ref, x, y)
    for v, g in zip(ref.trainable_variables, tape.gradient(loss, ref.trainable_variables)):
      v.assign_sub(0.5 * g)

  repl = replicator.Replicator(cpus(n))
  with repl.context():
    module = MLP()
  sgd = repl.wrap_optimizer(keras.optimizers.SGD(0.5), reduction="sum")

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      logits = module(x)
      per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
      loss = tf.reduce_sum(per_example) / GLOBAL_BATCH
    grads = sgd.reduce_gradients(tape.gradient(loss, module.trainable_variables))
    for v, g in zip(module.trainable_variables, grads):
      v.assign_sub(0.5 * g)

  for _ in range(STEPS):
    repl.run(step_fn, input_fn)
  assert_replicated_equal([v.numpy() for v in ref.trainable_variables], module.trainable_variables)


# -- Sonnet 2 -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("opt_name", ["adam", "momentum"])
def test_sonnet(opt_name, n):
  snt = pytest.importorskip("sonnet")

  def make():
    tf.random.set_seed(3)
    net = snt.nets.MLP([16, 4])
    opt = snt.optimizers.Adam(1e-2) if opt_name == "adam" else snt.optimizers.Momentum(0.1, 0.9)
    net(tf.zeros([1, 8]))  # create the weights
    return net, opt

  ref, ref_opt = make()
  for x, y in global_batches():
    with tf.GradientTape() as tape:
      loss = module_loss(ref, x, y)
    ref_opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)

  repl = replicator.Replicator(cpus(n))
  with repl.context():
    net, base = make()
    opt = repl.wrap_optimizer(base)

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = module_loss(net, x, y)
    opt.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
    return loss

  for _ in range(STEPS):
    repl.run(step_fn, input_fn)
  assert_replicated_equal([v.numpy() for v in ref.trainable_variables], net.trainable_variables)
