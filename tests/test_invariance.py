"""Writes to replicated variables: equal on every replica, or combined by the variable's aggregation.

References: one device (BatchNormalization's moving statistics), and
tf.distribute's documented aggregation semantics (SUM sums the replicas'
updates, MEAN averages them, ONLY_FIRST_REPLICA takes replica 0's).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator
from replicator import _invariance
from replicator import _variables

X = (np.arange(48, dtype=np.float32).reshape(16, 3) / 10) ** 1.5


def _components(v):
  return [c.numpy() for c in _variables.underlying(v).components]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_batch_norm_moving_statistics_are_the_mean_of_the_replicas(n):
  # Was: each replica kept its own (moving_mean 0.105, 0.345, 0.585, 0.825 where one device gives 0.465).
  # The mean of the replicas' moving means is one device's (equal batches); the moving
  # variance is the mean of the replicas' variances (replicator.CrossReplicaBatchNorm
  # computes the global batch's).
  keras.utils.set_random_seed(0)
  reference = keras.layers.BatchNormalization(momentum=0.9)
  reference.build((None, 3))
  step = tf.function(lambda x: reference(x, training=True))
  for _ in range(3):
    step(X)
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    bn = keras.layers.BatchNormalization(momentum=0.9)
    bn.build((None, 3))
  inputs = replicator.PerReplica(np.split(X, n))
  for _ in range(3):
    repl.run(lambda x: bn(x, training=True), inputs=inputs)
  variance = np.ones(3)
  for _ in range(3):
    variance = 0.9 * variance + 0.1 * np.mean([part.var(axis=0) for part in np.split(X, n)], axis=0)
  for component in _components(bn.moving_mean):
    np.testing.assert_allclose(component, reference.moving_mean.numpy(), rtol=1e-5, atol=1e-6)
  for component in _components(bn.moving_variance):
    np.testing.assert_allclose(component, variance, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aggregation, expected", [
    (tf.VariableAggregation.SUM, 26.0),  # tf.distribute: the updates summed, 0 + 11 + 15
    (tf.VariableAggregation.MEAN, 13.0),  # their mean
    (tf.VariableAggregation.NONE, 13.0),  # the mean (Keras's moving statistics use NONE)
    (tf.VariableAggregation.ONLY_FIRST_REPLICA, 11.0),  # replica 0's
])
def test_aggregation_combines_differing_writes(aggregation, expected):
  # Was: the variable read 12.0 and its components held 12.0 and 14.0 (SUM ignored).
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    v = tf.Variable(0.0, trainable=False, aggregation=aggregation)
  repl.run(lambda b: v.assign_add(tf.reduce_sum(b)),
           inputs=replicator.PerReplica([tf.constant([5.0, 6.0]), tf.constant([7.0, 8.0])]))
  assert float(v.numpy()) == expected
  assert _components(v) == [expected, expected]


def test_equal_writes_need_no_communication():
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    counter = tf.Variable(0, trainable=False)
    w = tf.Variable([1.0, 2.0])

  def step(x):
    counter.assign_add(1)  # a constant: the same on every replica
    w.assign(w * 2.0 + repl.all_reduce(x, "mean"))  # variables and collectives: the same everywhere
    return w.read_value()

  inputs = replicator.PerReplica([tf.fill([2], float(r)) for r in range(4)])
  plan = repl.explain(step, inputs=inputs)
  assert [c.kind for c in plan.collectives] == ["all_reduce"]  # only the user's
  repl.run(step, inputs=inputs)
  assert _components(counter) == [1] * 4
  assert [c.tolist() for c in _components(w)] == [[3.5, 5.5]] * 4


def test_a_plain_keras_optimizer_in_a_step_names_wrap_optimizer():
  # Was: the replicas' kernels drifted apart silently (0.31 after 4 steps).
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    optimizer = keras.optimizers.SGD(0.1)

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(layer(x) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables))

  with pytest.raises(replicator.ReplicaInvarianceError,
                     match=r"writes the trainable variable 'dense/kernel:0' with a value that differs between "
                           r"replicas \(it depends on per-replica data along mesh axes \['replica'\]\).*its gradients "
                           r"were not reduced.*Fix: wrap the optimizer, opt = repl.wrap_optimizer\("):
    repl.run(step, inputs=replicator.PerReplica(np.split(X[:4], 2)))


def test_writes_are_checked_per_mesh_axis():
  # On a 2x2 mesh, a variable sharded over "model" may differ along "model"
  # (its pieces), and its update must agree along "batch" only.
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m)
  with repl.context(layouts=mesh.LayoutMap({"w": ("model",)})):
    w = tf.Variable([1.0, 2.0, 3.0, 4.0], name="w", trainable=False)
    stat = tf.Variable(0.0, trainable=False, name="stat")

  def step(x):
    w.assign(w * 10.0 + tf.cast(repl.axis_index("model"), tf.float32))  # varies along "model" only: kept
    stat.assign(tf.reduce_mean(x))  # each batch shard's mean: averaged over "batch"
    return w.read_value()

  repl.run(step, tf.data.Dataset.from_tensors(tf.constant([[1.0], [3.0]])))
  assert np.asarray(w).tolist() == [10.0, 20.0, 31.0, 41.0]
  assert _components(stat) == [2.0] * 4


def test_per_replica_random_streams_stay_per_replica():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    dropout = keras.layers.Dropout(0.5, seed=1)
  masks = repl.run(lambda: dropout(tf.ones([64]), training=True))
  assert not np.array_equal(masks[0], masks[1])  # the seed state kept its per-replica offsets


def test_analysis_rules():
  seen = {}
  all_axes = frozenset({"a", "b"})

  @tf.function
  def trace(x):
    analysis = _invariance.Analysis(all_axes, frozenset({"a"}), {x.op.name}, lambda handle: frozenset())
    y = tf.reduce_sum(x * 2.0)
    seen["input"] = analysis.varying(y)
    seen["constant"] = analysis.varying(tf.constant(3.0) * 2.0)
    seen["random"] = analysis.varying(tf.random.normal([2]))
    index = tf.constant(1)
    analysis.set(index, {"b"})
    seen["axis_index"] = analysis.varying(tf.cast(index, tf.float32) + y)
    reduced = tf.identity(y)
    analysis.collective("all_reduce", y, reduced, ("a",))
    seen["all_reduce"] = analysis.varying(reduced + 1.0)
    scattered = tf.identity(tf.constant(1.0))
    analysis.collective("reduce_scatter", tf.constant(1.0), scattered, ("b",))
    seen["reduce_scatter"] = analysis.varying(scattered)
    seen["cond"] = analysis.varying(tf.cond(x[0] > 0, lambda: y, lambda: tf.constant(0.0)))
    return x

  trace.get_concrete_function(tf.TensorSpec([2]))
  assert seen == dict(input={"a"}, constant=set(), random={"a", "b"}, axis_index={"a", "b"}, all_reduce=set(),
                      reduce_scatter={"b"}, cond={"a"})


def test_writing_a_variable_made_outside_every_context_is_an_error():
  # Was: 4.0 after one step on 4 replicas (one device: 1.0).
  repl = replicator.Replicator(cpus(4))
  counter = tf.Variable(0.0, name="steps_seen")

  def step():
    counter.assign_add(1.0)
    return tf.constant(0.0)

  with pytest.raises(replicator.UnreplicatedStateError,
                     match=r"The step writes the variable 'steps_seen:0' at .*test_invariance.py:\d+ in step, but it "
                           r"was created outside every Replicator context.*Fix: create it inside `with "
                           r"repl.context\(\):`"):
    repl.run(step)
  assert float(counter.numpy()) == 0.0  # refused before anything ran
  # Reading it is fine: it is one value.
  assert [float(x) for x in repl.run(lambda: counter.read_value() + 1.0)] == [1.0] * 4


def test_an_optimizer_made_outside_the_context_is_an_error():
  # Was: iterations == 20 after 5 steps on 4 replicas (Adam's bias correction wrong).
  repl = replicator.Replicator(cpus(4))
  optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.1))  # outside the context
  with repl.context():
    w = tf.Variable([1.0, 2.0])

  def step():
    optimizer.apply_gradients([(tf.ones([2]), w)])

  with pytest.raises(replicator.UnreplicatedStateError, match=r"writes the variable '.*iteration.*'.*an optimizer's own "
                                                              r"variables \(its step counter\) are created with it"):
    repl.run(step)


def test_writes_inside_control_flow_are_found():
  repl = replicator.Replicator(cpus(2))
  flag = tf.Variable(0, name="flag")

  def step(x):
    tf.cond(tf.reduce_sum(x) > 0, lambda: flag.assign(1), lambda: flag.assign(2))
    return x

  with pytest.raises(replicator.UnreplicatedStateError, match=r"writes the variable 'flag:0'"):
    repl.run(step, inputs=tf.constant([1.0]))
