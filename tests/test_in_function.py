"""``repl.run`` inside a ``tf.function`` (``replicator/views/_in_function.py``), as tf.distribute code calls ``strategy.run``.

The idioms are those of TensorFlow's own custom-training-loop tests and
tutorial, written for this library: a Python loop over a distributed dataset
calling a ``tf.function`` step, ``next(iterator)`` inside the function, loops
of steps inside one function, AutoGraph ``for`` loops over a distributed
dataset or iterator. The references: one device (every device's copy of every
variable, Adam's slots and counter included), NumPy, and the same step called
from Python.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from mse_step import mse_step

import mesh
import replicator

X = np.random.RandomState(0).randn(48, 8).astype(np.float32)
Y = np.random.RandomState(1).randn(48, 1).astype(np.float32)
LAYOUTS = {"d1/kernel": (None, "model"), "d2/kernel": ("model", None)}


def _dataset(drop_remainder=True):
  return tf.data.Dataset.from_tensor_slices((X, Y)).batch(16, drop_remainder=drop_remainder)


def _model():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input([8]), keras.layers.Dense(16, activation="tanh", name="d1"),
                            keras.layers.Dense(1, name="d2")])
  return model, keras.optimizers.Adam(0.05)


def _one_device(batches):
  model, opt = _model()
  step_fn = mse_step(model, opt)
  losses = [float(step_fn(b)) for b in batches]
  return model, opt, losses


def _replicated(repl):
  with repl.context():
    model, opt = _model()
    if repl._config.view == "local":  # pylint: disable=protected-access
      opt = repl.wrap_optimizer(opt)
  return model, opt


def _assert_equal_to_one_device(model, opt, reference):
  ref_model, ref_opt, _ = reference
  assert_every_copy(model.weights, ref_model.weights, atol=2e-6)
  assert_every_copy(opt.variables, ref_opt.variables, atol=2e-6)  # Adam's moments and its iteration


def test_the_tutorials_loop_a_python_loop_calling_a_tf_function_step_equals_one_device():
  # TensorFlow's distributed custom-loop tutorial: `for x in dist_dataset: distributed_train_step(x)`, the step a
  # tf.function around strategy.run and strategy.reduce. Was: ReplicaContextError at trace time.
  reference = _one_device(list(_dataset()))
  repl = replicator.Replicator(cpus(4))
  model, opt = _replicated(repl)
  train_step = mse_step(model, opt)

  @tf.function
  def distributed_train_step(batch):
    per_replica_losses = repl.run(train_step, inputs=batch)
    return repl.reduce(tf.distribute.ReduceOp.MEAN, per_replica_losses, axis=None)

  losses = [float(distributed_train_step(x)) for x in repl.distribute_dataset(_dataset())]
  _assert_equal_to_one_device(model, opt, reference)
  np.testing.assert_allclose(losses, reference[2], atol=1e-6)  # the mean of equal shards: the batch's loss
  assert distributed_train_step.experimental_get_tracing_count() == 1  # a PerReplica argument: no retrace
  assert repl.trace_count == 1


def test_next_of_an_iterator_inside_the_function_and_loops_of_steps_there():
  reference = _one_device(list(_dataset()))
  repl = replicator.Replicator(cpus(2))
  model, opt = _replicated(repl)
  train_step = mse_step(model, opt)

  @tf.function
  def one_step(iterator):
    return repl.run(train_step, inputs=next(iterator))

  @tf.function
  def several(iterator, steps):
    for _ in tf.range(steps):
      repl.run(train_step, inputs=next(iterator))

  iterator = iter(repl.distribute_dataset(_dataset()))
  first = one_step(iterator)  # the iterator passed as an argument: its tf.data resource
  several(iterator, tf.constant(2))
  assert [len(first.values)] == [2]
  _assert_equal_to_one_device(model, opt, reference)
  with pytest.raises(tf.errors.OutOfRangeError):  # as tf.distribute's: the end of the data inside a function
    one_step(iterator)
  assert one_step.experimental_get_tracing_count() == 1 and several.experimental_get_tracing_count() == 1


def test_autograph_for_loops_over_a_distributed_dataset_and_its_iterator_are_staged():
  # Ported: squares of [5, 6, 7, 8] in batches of 2 over 2 replicas; the sum of a loop over the dataset.
  repl = replicator.Replicator(cpus(2))
  dist = repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0, 6.0, 7.0, 8.0]).batch(2))

  @tf.function
  def squares(batch):
    return repl.run(tf.square, inputs=batch).values

  assert [[float(v[0]) for v in squares(x)] for x in dist] == [[25.0, 36.0], [49.0, 64.0]]

  @tf.function
  def total_over_dataset():
    total = 0.0
    for batch in dist:  # AutoGraph: a tf.while_loop (DistributedDataset.reduce), not a Python loop
      total += repl.reduce("sum", repl.run(lambda x: tf.reduce_sum(tf.square(x)), inputs=batch))
    return total

  @tf.function
  def total_over_iterator(iterator):
    total = 0.0
    for batch in iterator:  # AutoGraph: a loop on get_next_as_optional
      total += repl.reduce("sum", repl.run(lambda x: tf.reduce_sum(x), inputs=batch))
    return total

  assert float(total_over_dataset()) == 25 + 36 + 49 + 64
  assert float(total_over_iterator(iter(dist))) == 5 + 6 + 7 + 8


def test_a_last_batch_smaller_than_the_others_is_split_unevenly_inside_the_function():
  # Ported: [5, 6, 7] in one batch of 4 over 2 replicas: rows 2 and 1, means 5.5 and 7.
  repl = replicator.Replicator(cpus(2))
  iterator = iter(repl.distribute_dataset(tf.data.Dataset.from_tensor_slices([5.0, 6.0, 7.0]).batch(4)))

  @tf.function
  def sizes_and_means(batch):
    return (repl.run(tf.size, inputs=batch).values, repl.run(tf.reduce_mean, inputs=batch).values)

  sizes, means = sizes_and_means(next(iterator))
  assert [int(s) for s in sizes] == [2, 1] and [float(m) for m in means] == [5.5, 7.0]

  @tf.function
  def optional_read(iterator):
    optional = iterator.get_next_as_optional()
    return optional.has_value()

  assert not bool(optional_read(iterator))  # read to its end: no value, no error


def test_the_global_view_inside_a_function_equals_one_device_and_calling_from_python():
  reference = _one_device(list(_dataset()))
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, view="global", layouts=LAYOUTS)
  model, opt = _replicated(repl)
  train_step = mse_step(model, opt)

  @tf.function
  def train(iterator, steps):
    total = 0.0
    for _ in tf.range(steps):
      total += repl.run(train_step, inputs=next(iterator))  # the global batch; the partitioner splits it
    return total

  iterator = iter(_dataset())
  total = train(iterator, tf.constant(2))
  # The third batch from Python, as a global batch (inputs=), and the layouts' sharded copies compared.
  last = repl.run(train_step, inputs=next(iterator))
  _assert_equal_to_one_device(model, opt, reference)
  np.testing.assert_allclose([float(total), float(last)], [sum(reference[2][:2]), reference[2][2]], atol=2e-6)
  assert not repl.explain(train_step, _dataset()).fallbacks  # from Python, after: the layouts split everything

  # A distributed dataset's PerReplica is joined back into the global batch (one part per input pipeline).
  repl2 = replicator.Replicator(mesh=m, view="global", layouts=LAYOUTS)
  model2, opt2 = _replicated(repl2)
  step2 = mse_step(model2, opt2)

  @tf.function
  def train_distributed(batch):
    return repl2.run(step2, inputs=batch)

  for batch in repl2.distribute_dataset(_dataset()):
    train_distributed(batch)
  _assert_equal_to_one_device(model2, opt2, reference)


def test_what_a_function_cannot_do_is_refused_at_trace_time_with_the_fix():
  repl = replicator.Replicator(cpus(2))
  ds = tf.data.Dataset.range(8).batch(4)
  dist = repl.distribute_dataset(ds)

  @tf.function
  def from_dataset():
    return repl.run(lambda x: x, dist)

  with pytest.raises(replicator.ArgumentError, match=r"inside a function the step takes the batch it runs on as "
                                                     r"inputs=.*Fix: `iterator = iter\(repl.distribute_dataset"):
    from_dataset()

  @tf.function
  def loop_of_steps(x):
    return repl.run(lambda x: x, inputs=x, steps=3)

  with pytest.raises(replicator.ArgumentError, match=r"a loop of steps is written in the function itself there. "
                                                     r"Fix: `for _ in tf.range\(3\)"):
    loop_of_steps(tf.constant([1, 2]))

  @tf.function
  def explain(x):
    return repl.explain(lambda x: x, inputs=x)

  with pytest.raises(replicator.ReplicaContextError, match=r"repl.explain\(\) was called while a tf.function is "
                                                           r"being traced.*Fix: call repl.explain"):
    explain(tf.constant([1, 2]))

  def unrolled():  # without AutoGraph a `for` over the dataset is a Python loop: refused, not endless
    count = 0
    for _ in dist:
      count += 1
    return count

  with pytest.raises(ValueError, match=r"unusually high number of `tf.data.Iterator.get_next\(\)` calls.*only "
                                       r"supported when AutoGraph is enabled"):  # tf.data's own guard
    tf.function(unrolled, autograph=False)()

  gm = mesh.Mesh({"batch": 2}, devices=cpus(2))
  global_repl = replicator.Replicator(mesh=gm, view="global")

  @tf.function
  def dynamic(iterator):
    return global_repl.run(lambda x: tf.reduce_sum(x), inputs=next(iterator))

  with pytest.raises(replicator.ArgumentError, match=r"takes global batches of a static shape.*drop_remainder=True"):
    dynamic(iter(ds))
  with pytest.raises(replicator.ArgumentError, match=r"inputs= is one global batch, for one step. Fix: pass the "
                                                     r"dataset of global batches, repl.run\(step_fn, dataset, steps=3\)"):
    global_repl.run(tf.reduce_sum, inputs=tf.ones([4, 2]), steps=3)  # from Python (was: one step, silently)
  with pytest.raises(replicator.ReplicaContextError, match=r"steps do not nest"):
    tf.function(lambda: repl.run(lambda: repl.run(lambda: tf.constant(1.0))))()
