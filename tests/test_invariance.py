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
from replicator.state import _invariance
from replicator.state import _variables

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


PER_REPLICA = replicator.PerReplica([tf.constant([1.0, 2.0]), tf.constant([3.0, 0.0]), tf.constant([2.0, 2.0]),
                                     tf.constant([-4.0, 1.0])])  # sums 3, 3, 4, -3: positive on replicas 0-2


def _if_on_a_tensor(seen, x):
  if tf.reduce_sum(x) > 0:  # AutoGraph: a tf.cond
    seen.assign_add(1)


def _tf_cond(seen, x):
  tf.cond(tf.reduce_sum(x) > 0, lambda: seen.assign_add(1), lambda: seen.assign_add(0))


def _while_on_a_tensor(seen, x):
  i = 0
  while i < tf.cast(tf.reduce_max(x), tf.int32):  # 2, 3, 2, 1 iterations
    seen.assign_add(1)
    i += 1


@pytest.mark.parametrize("write, construct, decider", [
    (_if_on_a_tensor, r"a tf.cond \(an `if` on a tensor\)", "predicate"),
    (_tf_cond, r"a tf.cond \(an `if` on a tensor\)", "predicate"),
    (_while_on_a_tensor, r"a tf.while_loop \(a `while` or `for` on a tensor\)", "trip count"),
], ids=["if", "tf.cond", "while"])
def test_a_write_under_a_condition_that_differs_between_replicas_is_refused(write, construct, decider):
  # Was: no error, and the copies diverged ([1, 1, 1, 0] for the `if`): the write's value is the same on every
  # replica, but whether (or how often) it runs is decided per replica.
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    seen = tf.Variable(0, name="seen")

  def step(x):
    write(seen, x)
    return x

  with pytest.raises(replicator.ReplicaInvarianceError,
                     match=rf"writes the replicated variable 'seen:0' at .*test_invariance.py:\d+ in {write.__name__} "
                           rf"inside {construct} at .*test_invariance.py:\d+ in {write.__name__} whose {decider} "
                           rf"differs between replicas \(it depends on per-replica data along mesh axes "
                           rf"\['replica'\]\).*must be written on every replica or on none.*Fix: compute the "
                           rf"{decider} from values reduced across replicas.*repl.all_reduce.*tf.where.*ON_READ"):
    repl.run(step, inputs=PER_REPLICA)
  assert _components(seen) == [0] * 4  # refused before anything ran


def test_writes_under_conditions_every_replica_agrees_on_are_accepted():
  # The predicate or trip count is the same on every replica: a reduced value, a variable, a constant.
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    reduced = tf.Variable(0, name="reduced")
    by_variable = tf.Variable(0, name="by_variable")
    looped = tf.Variable(0.0, trainable=False, name="looped")
    summed = tf.Variable(0.0, trainable=False, aggregation=tf.VariableAggregation.SUM, name="summed")
    own = tf.Variable(0, synchronization=tf.VariableSynchronization.ON_READ,
                      aggregation=tf.VariableAggregation.SUM, name="own")  # each replica's own count

  def step(x):
    total = repl.all_reduce(tf.reduce_sum(x), "sum")
    if total > 0:  # 7 on every replica
      reduced.assign_add(1)
    if by_variable < 1:
      by_variable.assign_add(2)
    else:
      by_variable.assign_add(3)
    for i in tf.range(3):  # a constant trip count; the loop variable is the same everywhere
      looped.assign(looped * 10.0 + tf.cast(i, tf.float32) + total)
    tf.cond(total > 0, lambda: summed.assign_add(1.5), lambda: summed.assign_add(0.0))
    if tf.reduce_sum(x) > 0:  # per replica, of a per-replica variable
      own.assign_add(1)
    return x

  for _ in range(2):
    repl.run(step, inputs=PER_REPLICA)
  expected = 0.0
  for _ in range(2):
    for i in range(3):
      expected = expected * 10.0 + i + 7.0
  assert _components(reduced) == [2] * 4
  assert _components(by_variable) == [5] * 4
  np.testing.assert_allclose(_components(looped), [expected] * 4, rtol=1e-6)
  assert _components(summed) == [12.0] * 4  # tf.distribute's SUM: 4 replicas' 1.5, twice
  assert _components(own) == [2, 2, 2, 0] and int(own.numpy()) == 6


def test_a_keras_metric_under_a_per_replica_condition_counts_every_example():
  # A metric's variables are on-read: each replica keeps its own part.
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    metric = keras.metrics.Mean()

  def step(x):
    if tf.reduce_sum(x) > 0:
      metric.update_state(x)
    return x

  repl.run(step, inputs=PER_REPLICA)
  np.testing.assert_allclose(float(metric.result()), np.mean([1.0, 2.0, 3.0, 0.0, 2.0, 2.0]), rtol=1e-6)


def test_a_differing_value_written_inside_control_flow_is_refused_with_the_fix():
  # Combining the replicas' values takes a collective, which cannot run inside a tf.cond branch. Was: the
  # CollectiveInControlFlowError of an all_reduce the user never called.
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    stat = tf.Variable(0.0, trainable=False, name="stat")

  def step(x):
    if repl.all_reduce(tf.reduce_sum(x), "sum") > 0:
      stat.assign(tf.reduce_mean(x))
    return x

  with pytest.raises(replicator.ReplicaInvarianceError,
                     match=r"writes the replicated variable 'stat:0' \(aggregation NONE\) at .*test_invariance.py:\d+ "
                           r"in step inside a tf.cond .* at .*test_invariance.py:\d+ in step with a value that "
                           r"differs between replicas \(along mesh axes \['replica'\]\).*Fix: compute the new value "
                           r"inside the control flow and write the variable after it"):
    repl.run(step, inputs=PER_REPLICA)


def test_analysis_of_loops():
  seen = {}
  all_axes = frozenset({"a"})

  @tf.function
  def trace(x):
    analysis = _invariance.Analysis(all_axes, all_axes, {x.op.name}, lambda handle: frozenset())
    bodies = {}

    def loop(name, trip, step):
      def body(i, s):
        bodies[name] = tf.compat.v1.get_default_graph()
        return i + 1, step(s)

      i, s = tf.while_loop(lambda i, s: i < trip, body, [tf.constant(0), tf.constant(0.0)])
      seen[name] = (analysis.varying(i), analysis.varying(s))

    loop("constant", 3, lambda s: s + 1.0)
    loop("data in the body", 3, lambda s: s + x[0])
    loop("per-replica trip count", tf.cast(x[0], tf.int32), lambda s: s + 1.0)
    for name, body in bodies.items():
      seen[name] += ([axes for _, axes in analysis.conditions(body)],)
    return x

  trace.get_concrete_function(tf.TensorSpec([2]))
  assert seen == {"constant": (set(), set(), [set()]),
                  "data in the body": (set(), {"a"}, [set()]),
                  "per-replica trip count": ({"a"}, {"a"}, [{"a"}])}
