"""Tests for wrap_optimizer: gradient fusion into buckets, sharded and replicated updates."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy_float16
from conftest import cpus
from conftest import float16_noise
from conftest import replica_values

import mesh
import replicator
from replicator.state import _variables


def _train(bucket_bytes, n=4):
  # A replicated update: the buckets' sizes alone (under the sharded update a bucket holds one owner's gradients).
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(w, activation="tanh") for w in (16, 16, 3)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.05), bucket_bytes=bucket_bytes, update="replicated")
  x = np.random.RandomState(0).randn(4 * n, 6).astype(np.float32)

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(x) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  inputs = replicator.PerReplica(np.split(x, n))
  for _ in range(3):
    repl.run(step, inputs=inputs)
  plan = repl.explain(step, inputs=inputs)
  return [v.numpy() for v in model.trainable_variables], plan


@pytest.mark.parametrize("bucket_bytes", [1, 600, 1 << 20])
def test_fused_gradients_equal_unfused(bucket_bytes):
  expected, plain = _train(None)
  got, fused = _train(bucket_bytes)
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  fused_reductions = [c for c in fused.collectives if c.kind == "all_reduce"]
  sizes = [c.shape.num_elements() for c in fused_reductions]
  assert len([c for c in plain.collectives if c.kind == "all_reduce"]) == 6
  if bucket_bytes == 1 << 20:  # everything in one bucket: 6*16+16 + 16*16+16 + 16*3+3 floats
    assert sizes == [96 + 16 + 256 + 16 + 48 + 3]
  elif bucket_bytes == 600:  # 150 floats per bucket at most; larger tensors alone
    assert sizes == [112, 256, 16 + 48 + 3] and max(c.nbytes for c in fused_reductions) == 1024
  else:
    assert len(sizes) == 6


def test_a_bucket_of_4_mb_or_more_is_reduced_in_two_parts_the_last_gradients_first():
  """A 64 MB bucket of three 600 x 600 layers' gradients (4.3 MB): the last two layers' (they exist first in the
  backward pass) are reduced first, then the first layer's; the training equals reducing every gradient alone."""
  found = {}
  for bucket_bytes in (64 << 20, None):
    repl = replicator.Replicator(cpus(2))
    with repl.context():
      keras.utils.set_random_seed(0)
      model = keras.Sequential([keras.Input((600,))] + [keras.layers.Dense(600, activation="tanh") for _ in range(3)])
      optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.01), bucket_bytes=bucket_bytes, update="replicated")

    def step(x, model=model, optimizer=optimizer):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
      optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    inputs = replicator.PerReplica(np.split(np.random.RandomState(0).randn(8, 600).astype(np.float32), 2))
    for _ in range(2):
      repl.run(step, inputs=inputs)
    sizes = [c.shape.num_elements() for c in repl.explain(step, inputs=inputs).collectives if c.kind == "all_reduce"]
    found[bucket_bytes] = [v.numpy() for v in model.trainable_variables], sizes
  assert found[64 << 20][1] == [2 * (600 * 600 + 600), 600 * 600 + 600]
  assert len(found[None][1]) == 6
  for a, b in zip(found[64 << 20][0], found[None][0]):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_default_buckets_fuse_small_gradients_only():
  # wrap_optimizer's default (1 MB): a 1.4 MB kernel keeps its own all-reduce; the bias and the small layer
  # after it share one. Under the sharded update a bucket holds one owner's gradients and is reduced for it.
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((600,)), keras.layers.Dense(600), keras.layers.Dense(3)])
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.1))
  assert optimizer.bucket_bytes == 1 << 20 and optimizer.update == "sharded"

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(x) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  inputs = replicator.PerReplica(np.split(np.ones((4, 600), np.float32), 2))
  plan = repl.explain(step, inputs=inputs)
  reductions = [c for c in plan.collectives if c.kind == "all_reduce"]
  # The kernel (largest) goes to replica 0, the rest to the one with fewer bytes, replica 1.
  assert [(c.shape.num_elements(), c.param_dict["root"]) for c in reductions] == [(600 * 600, 0),
                                                                                  (600 + 600 * 3 + 3, 1)]


def test_bucket_bytes_is_checked():
  repl = replicator.Replicator(cpus(2))
  with pytest.raises(ValueError, match=r"wrap_optimizer\(bucket_bytes=-1\): needs None or a byte count >= 0"):
    repl.wrap_optimizer(keras.optimizers.SGD(), bucket_bytes=-1)


# -- sharded update -------------------------------------------------------------


def _adam_run(update, n=4, steps=3, widths=(16, 16, 3), **adam_kwargs):
  """Trains a small MLP with Adam; returns (weights, optimizer variables, iterations, repl, wrapped, step)."""
  repl = replicator.Replicator(cpus(n)) if n > 1 else None
  x = np.random.RandomState(1).randn(8, 6).astype(np.float32)
  context = repl.context() if repl else tf.device("/cpu:0")
  with context:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(w, activation="tanh") for w in widths])
    base = keras.optimizers.Adam(0.05, **adam_kwargs)
    optimizer = repl.wrap_optimizer(base, update=update) if repl else base

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(x) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  if repl is None:
    step = tf.function(step)
  for _ in range(steps):
    if repl is None:
      step(x)
    else:
      repl.run(step, inputs=replicator.PerReplica(np.split(x, n)))
  slots = [v.numpy() for v in base.variables]  # iteration, learning rate, then slots in variable order
  return [v.numpy() for v in model.trainable_variables], slots, int(base.iterations.numpy()), repl, optimizer, step


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_update_equals_one_device(n):
  want, want_slots, _, _, _, _ = _adam_run(None, n=1)
  got, slots, iterations, repl, wrapped, step = _adam_run("sharded", n=n)
  assert wrapped.update == "sharded"
  assert iterations == 3
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Slots (read from their owner) equal one device's: checkpoints hold the real state.
  assert len(slots) == len(want_slots) == 2 + 2 * 6
  for i, (a, b) in enumerate(zip(slots, want_slots)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"optimizer variable {i}")
  # Every component of every weight is identical after the broadcast.
  for v in wrapped.optimizer._trainable_variables:  # pylint: disable=protected-access
    components = _variables.underlying(v).components
    for c in components[1:]:
      np.testing.assert_array_equal(c.numpy(), components[0].numpy())
  # Every replica counted the steps, also those that own nothing.
  assert [int(c.numpy()) for c in _variables.underlying(wrapped.iterations).components] == [3] * n
  plan = repl.explain(step, inputs=replicator.PerReplica([np.zeros([2, 6], np.float32)] * n))
  kinds = [c.kind for c in plan.collectives]
  # Each owner's small gradients share one all-reduce, reduced on the owner, and its new weights one broadcast.
  owners = {o.position for o in wrapped.owners(wrapped.optimizer._trainable_variables)}  # pylint: disable=protected-access
  assert len(owners) == min(n, 6)
  assert kinds.count("all_reduce") == len(owners) and kinds.count("broadcast") == len(owners)
  roots = sorted(c.param_dict["root"] for c in plan.collectives if c.kind == "all_reduce")
  assert roots == sorted(owners)


def test_an_owner_updates_the_weights_it_broadcasts_out_of_place():
  # In one process the broadcast gives the other devices' copies the owner's buffer: an update in place then
  # copies the whole weight first (Embedding(50000, 128) + Adam: 1.14 of one device, 1.04 out of place).
  _, _, _, repl, wrapped, step = _adam_run("sharded", n=4, steps=1)
  inputs = replicator.PerReplica([np.zeros([2, 6], np.float32)] * 4)
  compiled, _ = repl._views["local"].step(step, None, inputs)  # pylint: disable=protected-access
  weights = {id(c) for v in wrapped.optimizer._trainable_variables  # pylint: disable=protected-access
             for c in _variables.underlying(v).components}
  slots = {id(c) for v in wrapped.optimizer.variables[2:] for c in _variables.underlying(v).components}
  writes = {}
  for node in compiled.graph_def.node:
    if node.op.startswith("Assign"):
      handle = node.input[0] if ":" in node.input[0] else node.input[0] + ":0"
      component = _variables.component_of(compiled.captures._values.get(handle))  # pylint: disable=protected-access
      kind = "weight" if id(component) in weights else "slot" if id(component) in slots else None
      if kind:
        writes.setdefault(kind, set()).add(node.op)
  assert writes["weight"] == {"AssignVariableOp"}  # owners: the new value; the others: the broadcast one
  assert writes["slot"] == {"AssignAddVariableOp"}  # Adam's moments, the owner's only: in place


def test_owners_balance_bytes():
  _, _, _, repl, wrapped, _ = _adam_run("sharded", n=4, steps=1, widths=(64, 8, 3))
  variables = wrapped.optimizer._trainable_variables  # pylint: disable=protected-access
  owners = wrapped.owners(variables)
  # kernel 6x64, bias 64, kernel 64x8, bias 8, kernel 8x3, bias 3 (1536, 256, 2048, 32, 96, 12 bytes):
  # largest first, each to the least-loaded device (ties: the lowest position).
  nbytes = [v.shape.num_elements() * 4 for v in variables]
  assert nbytes == [1536, 256, 2048, 32, 96, 12]
  assert [o.position for o in owners] == [1, 2, 0, 3, 3, 3]
  loads = [sum(b for b, o in zip(nbytes, owners) if o.position == p) for p in range(4)]
  assert loads == [2048, 1536, 256, 140]
  assert all(o.axes == ("replica",) for o in owners)
  assert wrapped.owners(variables) == owners  # fixed once assigned


def test_sharded_update_checkpoint_restores_on_one_device(tmp_path):
  _, _, _, _, wrapped, _ = _adam_run("sharded", n=4)
  path = tf.train.Checkpoint(optimizer=wrapped).write(str(tmp_path / "ckpt"))
  _, want_slots, _, _, _, _ = _adam_run(None, n=1)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(w, activation="tanh") for w in (16, 16, 3)])
  fresh = keras.optimizers.Adam(0.05)
  fresh.build(model.trainable_variables)
  tf.train.Checkpoint(optimizer=fresh).read(path).assert_existing_objects_matched()
  for i, (v, value) in enumerate(zip(fresh.variables, want_slots, strict=True)):
    np.testing.assert_allclose(v.numpy(), value, rtol=1e-5, atol=1e-6, err_msg=f"optimizer variable {i}")


def test_auto_update_choice():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    assert repl.wrap_optimizer(keras.optimizers.Adam()).update == "sharded"
    assert repl.wrap_optimizer(keras.optimizers.Adam(global_clipnorm=1.0)).update == "replicated"
    assert repl.wrap_optimizer(keras.optimizers.Adam(), update="replicated").update == "replicated"
  one = replicator.Replicator(cpus(1))
  with one.context():
    assert one.wrap_optimizer(keras.optimizers.Adam()).update == "replicated"
  from replicator.state import _optimizer  # pylint: disable=import-outside-toplevel
  assert _optimizer.one_cpu_process(["/job:worker/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:1"])
  assert not _optimizer.one_cpu_process(["/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"])
  assert not _optimizer.one_cpu_process(["/device:GPU:0", "/device:GPU:1"])


def test_sharded_update_errors():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    with pytest.raises(ValueError, match=r'update="sharded"\) cannot shard the updates of Adam: global_clipnorm '
                                         r'clips by the norm of all gradients together\. Fix: use update="replicated"'):
      repl.wrap_optimizer(keras.optimizers.Adam(global_clipnorm=1.0), update="sharded")
    with pytest.raises(ValueError, match=r"cannot shard the updates of Adam: use_ema"):
      repl.wrap_optimizer(keras.optimizers.Adam(use_ema=True), update="sharded")

    class PlainSGD:
      def apply(self, updates, parameters):
        for u, p in zip(updates, parameters):
          p.assign_sub(u)

    with pytest.raises(ValueError, match=r"only Keras 3 optimizers are supported.*found PlainSGD"):
      repl.wrap_optimizer(PlainSGD(), update="sharded")
    assert repl.wrap_optimizer(PlainSGD()).update == "replicated"
    with pytest.raises(ValueError, match=r"wrap_optimizer\(update='each'\): update must be one of"):
      repl.wrap_optimizer(keras.optimizers.Adam(), update="each")


def test_replicated_and_sharded_updates_agree():
  a, slots_a, _, _, _, _ = _adam_run("replicated", n=4)
  b, slots_b, _, _, _, _ = _adam_run("sharded", n=4)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  for x, y in zip(slots_a, slots_b, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_wrapping_an_optimizer_twice_keeps_its_owners():
  # Two 4-float biases tie: a fresh assignment would follow the order it sees them in.
  _, _, _, repl, first, _ = _adam_run("sharded", n=4, steps=1, widths=(4, 4))
  variables = first.optimizer._trainable_variables  # pylint: disable=protected-access
  assert [o.position for o in first.owners(variables)] == [0, 2, 1, 3]
  second = repl.wrap_optimizer(first.optimizer)
  assert second.owners(variables[::-1]) == first.owners(variables)[::-1]


def test_sharded_update_rejects_extra_arguments():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    v = tf.Variable(np.ones(3, np.float32))
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.1), update="sharded")

  def step():
    optimizer.apply([tf.ones(3)], [v], "extra")

  with pytest.raises(TypeError, match=r"sharded optimizer update takes only gradients and variables, but found "
                                      r"the extra argument\(s\) \['extra'\]\. Fix: .*update=\"replicated\""):
    repl.run(step)


def _loss_scale_run(repl, steps=4):
  """A Keras LossScaleOptimizer built by its first apply (inside the step), the scale growing every 2 steps."""
  rng = np.random.RandomState(2)
  x, y = rng.randn(steps, 8, 6).astype(np.float32), rng.randint(0, 3, size=(steps, 8))
  with repl.context() if repl else tf.device("/cpu:0"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    base = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05), initial_scale=2.0**10,
                                               dynamic_growth_steps=2)
    optimizer = repl.wrap_optimizer(base) if repl else base

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
      scaled = optimizer.scale_loss(loss)  # before the first apply: the initial scale, as a constant
    optimizer.apply_gradients(zip(tape.gradient(scaled, model.trainable_variables), model.trainable_variables))

  _run_steps(repl, step, x, y, steps)
  return model, base


def _run_steps(repl, step, x, y, steps):
  """``steps`` steps on the batches ``(x[i], y[i])``: on one device (``repl`` None) or split over 4 replicas."""
  one_device = tf.function(step)
  for i in range(steps):
    if repl is None:
      one_device((x[i], y[i]))
    else:
      repl.run(step, inputs=replicator.PerReplica(list(zip(np.split(x[i], 4), np.split(y[i], 4)))))


def test_a_loss_scale_optimizer_built_by_the_step_equals_one_device():
  # Was: the first replica's trace built the optimizer, so replica 0 scaled its loss by the initial scale
  # forever and the others by the current one: weights 0.014 off one device after the scale grew.
  want_model, want_opt = _loss_scale_run(None)
  model, opt = _loss_scale_run(replicator.Replicator(cpus(4)))
  assert float(want_opt.dynamic_scale.numpy()) == 2.0**12
  for a, b in zip(want_model.variables + want_opt.variables, model.variables + opt.variables, strict=True):
    for r, got in enumerate(replica_values(b)):
      np.testing.assert_allclose(got, a.numpy(), rtol=0, atol=1e-5, err_msg=f"{a.path}, replica {r}")


def _mixed_float16_run(order, update="auto", steps=4):
  """Trains an MLP under "mixed_float16" with a LossScaleOptimizer and Adam: on one device (order None), or with
  the optimizers composed as ``order`` says on 4 replicas. Returns the model and the LossScaleOptimizer."""
  rng = np.random.RandomState(2)
  x, y = rng.randn(steps, 16, 6).astype(np.float32), rng.randint(0, 3, size=(steps, 16))
  repl = replicator.Replicator(cpus(4)) if order else None
  with repl.context() if repl else tf.device("/cpu:0"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(3)])
    if order == "scaled(wrapped)":
      optimizer = keras.optimizers.LossScaleOptimizer(repl.wrap_optimizer(keras.optimizers.Adam(0.01), update=update))
      scaler = optimizer
    else:
      scaler = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
      optimizer = repl.wrap_optimizer(scaler, update=update) if repl else scaler
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
      scaled = optimizer.scale_loss(loss)
    optimizer.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
    return loss

  _run_steps(repl, step, x, y, steps)
  return model, scaler


@pytest.mark.parametrize("update", ["auto", "replicated"])
def test_a_loss_scale_optimizer_around_a_wrapped_one_is_refused_with_the_order_that_works(mixed_float16, update):
  # Was: with update="auto", "A sharded optimizer update takes only gradients and variables, but found the extra
  # argument(s) ['trainable_variables']. Fix: ... update="replicated"", and with it a CollectiveInControlFlowError
  # (the wrapper's all-reduce inside the LossScaleOptimizer's tf.cond).
  with pytest.raises(replicator.UnsupportedError, match=r"LossScaleOptimizer\(repl.wrap_optimizer\(...\)\) applies the "
                     r"wrapped optimizer inside its tf.cond.*Fix: wrap the LossScaleOptimizer instead: "
                     r"repl.wrap_optimizer\(keras.optimizers.LossScaleOptimizer\(opt\)\)"):
    _mixed_float16_run("scaled(wrapped)", update=update, steps=1)
  # The fix's order equals one device. Measured: 1.1e-4 from one device; float16 noise 4.0e-3.
  want_model, want_scaler = _mixed_float16_run(None)
  keras.mixed_precision.set_global_policy("float32")
  exact_model, exact_scaler = _mixed_float16_run(None)
  noise = float16_noise(want_model.variables + want_scaler.variables, exact_model.variables + exact_scaler.variables)
  mixed_float16()
  model, scaler = _mixed_float16_run("wrapped(scaled)", update=update)
  assert_every_copy_float16(model.variables + scaler.variables, want_model.variables + want_scaler.variables, noise)
  assert scaler.dynamic_scale.numpy() == want_scaler.dynamic_scale.numpy() and scaler.iterations.numpy() == 4


def test_a_loss_scale_optimizer_of_pipelined_variables_skips_a_step_on_every_stage():
  # Two stages on {"stage": 2}, each variable on its stage's device: stage 0's weight read through sqrt, one entry
  # 0, so its gradient is not finite while stage 1's is. One device's LossScaleOptimizer skips the step (checking
  # every gradient); so does the wrapped one on both stages (one all-reduce of the flag), halving its scale on
  # both. Then, the entry 1, a finite step: the scale-seeded pipeline's update is one device's (measured equal;
  # bound 1e-6). Each stage deciding on its own gradients is refused by the step's invariance check (the scale
  # written under a predicate that differs between the stages; tried), and would update stage 1's weight.
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
  start0 = np.abs(rng.normal(size=(3, 4))).astype("float32")
  start0[1, 2] = 0.0
  start1 = rng.normal(size=(4, 1)).astype("float32")

  def make():
    w0, w1 = tf.Variable(start0, name="w0"), tf.Variable(start1, name="w1")
    return w0, w1, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 8)

  one0, one1, one_opt = make()

  @tf.function
  def one_step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, tf.tanh(x @ tf.sqrt(one0)) @ one1))
      scaled = one_opt.scale_loss(loss)
    one_opt.apply_gradients(zip(tape.gradient(scaled, [one0, one1]), [one0, one1]))

  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)))
  with repl.context():
    w0, w1, base = make()
    opt = repl.wrap_optimizer(base)
    base.build([w0, w1])  # (its scale a variable before the step reads it; SGD has no slots)
  stages = [lambda h: tf.tanh(h @ tf.sqrt(w0)), lambda h: h @ w1]

  def step():
    loss, grads = repl.pipeline(stages, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                                microbatches=2, variables=[w0, w1], loss_scale=lambda: base.scale_loss(1.0))
    opt.apply_gradients(zip(grads, [w0, w1]))
    return loss

  one_step()
  repl.run(step)
  assert float(one_opt.dynamic_scale.numpy()) == 2.0 ** 7 and int(one_opt.iterations.numpy()) == 0
  assert replica_values(base.dynamic_scale) == [2.0 ** 7] * 2
  assert [int(v) for v in replica_values(base.iterations)] == [0, 0]
  np.testing.assert_array_equal(w1.numpy(), start1)  # (stage 1's gradient was finite: skipped with stage 0's)
  for v in (one0, w0):
    v.assign(np.where(start0 == 0, 1.0, start0))
  one_step()
  repl.run(step)
  assert replica_values(base.dynamic_scale) == [2.0 ** 7] * 2
  assert [int(v) for v in replica_values(base.iterations)] == [1, 1]
  for ours, theirs in ((w0, one0), (w1, one1)):
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=1e-6)
  assert np.abs(w1.numpy() - start1).max() > 1e-3
