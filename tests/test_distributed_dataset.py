"""distribute_dataset: global batches split across replicas, partial batches, epochs."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tree
from conftest import cpus

import replicator
from replicator.input import _distributed_dataset

GLOBAL_BATCH = 8
ROWS = 4 * GLOBAL_BATCH + 3  # 4 full global batches and a partial one of 3 rows
X = np.random.RandomState(0).randn(ROWS, 4).astype(np.float32)
Y = np.random.RandomState(1).randint(0, 3, size=ROWS).astype(np.int32)


def dataset():
  return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)


@pytest.mark.parametrize("rows, n, sizes", [(10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]), (3, 4, [1, 1, 1, 0]),
                                            (1, 8, [1] + [0] * 7), (5, 1, [5])])
def test_split_sizes(rows, n, sizes):
  assert _distributed_dataset.split_sizes(tf.constant(rows), n).numpy().tolist() == sizes


def test_iteration_yields_per_replica_rows_and_drops_nothing():
  repl = replicator.Replicator(cpus(4))
  seen = []
  for per_replica in repl.distribute_dataset(dataset()):
    assert len(per_replica) == 4
    seen.extend(np.concatenate([x.numpy() for x, _ in per_replica.values]))
  np.testing.assert_array_equal(np.array(seen), X)


def test_in_graph_split_matches_the_global_batch():
  repl = replicator.Replicator(cpus(4))

  def step_fn(batch):
    x, _ = batch
    return repl.all_gather(x), tf.shape(x)[0]

  batches = []
  global_batches = dataset()  # the same object on every call: one pass over it
  while True:
    try:
      gathered, sizes = repl.run(step_fn, global_batches)
    except replicator.EndOfInput:
      break
    batches.append(gathered[0].numpy())
    last_sizes = [int(s) for s in sizes]
  np.testing.assert_array_equal(np.concatenate(batches), X)
  assert last_sizes == [1, 1, 1, 0]  # the partial batch: one replica runs on an empty batch
  assert repl.trace_count == 1  # batch dimensions are dynamic: one trace for full and partial batches


def make_model():
  keras.utils.set_random_seed(3)
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])


def reference_epochs(epochs):
  model, opt = make_model(), keras.optimizers.Adam(0.02)
  for _ in range(epochs):
    for x, y in dataset():
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
      opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
  return [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("steps", [1, 3])
def test_training_with_partial_batches_equals_one_device(n, steps):
  want = reference_epochs(2)
  keras.backend.clear_session()
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    model = make_model()
    opt = repl.wrap_optimizer(keras.optimizers.Adam(0.02), reduction="sum")
  distributed = repl.distribute_dataset(dataset())

  def step_fn(batch):
    x, y = batch
    global_batch = tf.cast(repl.all_sum(tf.shape(x)[0]), tf.float32)  # the true global batch size
    with tf.GradientTape() as tape:
      per_example = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
      loss = tf.reduce_sum(per_example) / global_batch
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  steps_per_epoch = []
  for _ in range(2):  # two epochs: the end of input ends each loop, the next run starts a new epoch
    count = 0
    while True:
      try:
        repl.run(step_fn, distributed, steps=steps)
      except replicator.EndOfInput:
        break
      count += repl.steps_run
    steps_per_epoch.append(count)
  assert steps_per_epoch == [5, 5]
  for got, expected in zip(model.trainable_variables, want, strict=True):
    for component in got.value.components:
      np.testing.assert_allclose(component.numpy(), expected, atol=1e-5)


def test_unbatched_dataset_is_rejected():
  repl = replicator.Replicator(cpus(2))
  with pytest.raises(replicator.InputMismatchError, match=r"needs every element leaf to have a batch dimension.*Fix: batch the dataset"):
    repl.distribute_dataset(tf.data.Dataset.range(4))


def test_a_static_batch_size_that_divides_gives_parts_of_static_size():
  repl = replicator.Replicator(cpus(4))
  even = tf.data.Dataset.from_tensors((tf.ones([8, 3]), tf.zeros([8]))).repeat(2)
  assert [s.shape.as_list() for s in repl.distribute_dataset(even).element_spec] == [[2, 3], [2]]
  # Not divisible, not static (batched without drop_remainder), or leaves that disagree: unknown.
  for dataset in (tf.data.Dataset.from_tensors(tf.ones([6, 3])), tf.data.Dataset.range(8).batch(4),
                  tf.data.Dataset.from_tensors((tf.ones([8, 3]), tf.zeros([4])))):
    assert all(s.shape[0] is None for s in tree.flatten(repl.distribute_dataset(dataset).element_spec))
  seen = repl.run(lambda batch: tf.constant(batch[0].shape.as_list()), even)  # the static shape in the trace
  assert [t.numpy().tolist() for t in seen] == [[2, 3]] * 4


def test_a_loop_over_it_inside_a_tf_function_is_a_graph_loop_or_refused_never_endless():
  # Was: the loop never ended (its `next` gave symbolic batches), growing ~18 MB/s; then refused at trace time.
  repl = replicator.Replicator(cpus(2))
  dist = repl.distribute_dataset(dataset())

  def rows():
    count = tf.constant(0)
    for batch in dist:
      count += tf.shape(batch[0][0])[0] + tf.shape(batch[1][0])[0]
    return count

  assert int(tf.function(rows)()) == ROWS  # AutoGraph: a tf.while_loop over every global batch (dist.reduce)
  with pytest.raises(ValueError, match=r"only supported when AutoGraph is enabled"):  # unrolled: tf.data's guard
    tf.function(rows, autograph=False)()
  assert int(rows()) == ROWS  # from Python
