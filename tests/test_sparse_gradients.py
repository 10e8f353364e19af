"""Sparse gradients (tf.IndexedSlices): reduced as rows, equal to one device, for every optimizer.

The reference is always the same steps on one device with the global batch.
Batches repeat tokens (a row's gradient is the sum of several slices, which
Keras 3's Adam treats differently from their dense sum) and hold tokens that
only the first half of the replicas see.
"""

import keras
import numpy as np
import pytest
import sonnet as snt
import tensorflow as tf
from conftest import REPLICA_COUNTS
from conftest import cpus
from conftest import replica_values

import mesh
import replicator
from replicator.state import _variables

STEPS = 3
GLOBAL_BATCH = 16
TOKENS = 8
VOCAB = 20
TOL = 1e-5

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    "sgd": lambda: keras.optimizers.SGD(0.5),
}


def batches(seed=0, batch=GLOBAL_BATCH):
  """STEPS global batches: tokens 0-5 everywhere (repeats), 10-15 only in the first half of the rows."""
  rng = np.random.RandomState(seed)
  x = rng.randint(0, 6, size=(STEPS, batch, TOKENS)).astype(np.int32)
  x[:, :batch // 2, ::2] += 10
  y = rng.randint(0, 3, size=(STEPS, batch)).astype(np.int32)
  return list(zip(x, y))


def split(batch, n):
  return replicator.PerReplica(list(zip(np.split(batch[0], n), np.split(batch[1], n))))


def assert_every_replica_equals(reference, variables, tol=TOL):
  assert len(reference) == len(variables)
  for want, v in zip(reference, variables):
    for r, got in enumerate(replica_values(v)):
      np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=f"{v.path if hasattr(v, 'path') else v.name}, "
                                                                       f"replica {r}")


# -- Keras Embedding ---------------------------------------------------------------


def embedding_model():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((TOKENS,), dtype="int32"), keras.layers.Embedding(VOCAB, 4),
                           keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])


def loss_of(model, x, y):
  return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))


def train(n, optimizer, data=None, wrap=None, model_fn=embedding_model, loss_fn=loss_of, **wrap_kwargs):
  """STEPS steps of the Keras model; returns (model, optimizer, repl, step): n=None is one device."""
  data = batches() if data is None else data
  if n is None:
    model, opt = model_fn(), OPTIMIZERS[optimizer]()

    @tf.function
    def one_device_step(x, y):
      with tf.GradientTape() as tape:
        loss = loss_fn(model, x, y)
      opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for x, y in data:
      one_device_step(x, y)
    return model, opt, None, None
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    model = model_fn()
    opt = repl.wrap_optimizer(OPTIMIZERS[optimizer](), **wrap_kwargs)

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)
    opt.apply_gradients(zip(grads, model.trainable_variables))

  for batch in data:
    repl.run(step, inputs=split(batch, n))
  return model, opt, repl, step


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_keras_embedding_equals_one_device(optimizer, n):
  want_model, want_opt, _, _ = train(None, optimizer)
  model, opt, _, _ = train(n, optimizer)
  assert_every_replica_equals([v.numpy() for v in want_model.variables], model.variables)
  # Optimizer state: iterations, learning rate, every slot (the embedding's included).
  assert_every_replica_equals([v.numpy() for v in want_opt.variables], opt.variables)


def test_dense_reduction_of_slices_differs_from_one_device():
  # Why rows are gathered: the dense sum of the replicas' slices changes
  # Keras Adam's second moment (sum of squares vs square of sums).
  want_model, _, _, _ = train(None, "adam")
  model, _, repl, step = train(4, "adam", densify_above=0.0)
  difference = np.abs(model.variables[0].numpy() - want_model.variables[0].numpy()).max()
  assert difference > 1e-3
  assert [c.kind for c in repl.explain(step, inputs=split(batches()[0], 4)).collectives][:1] == ["all_reduce"]


def test_plan_shows_the_gathered_rows_and_their_bytes():
  _, _, repl, step = train(4, "sgd", update="replicated", bucket_bytes=None)
  plan = repl.explain(step, inputs=split(batches()[0], 4))
  rows = [(c.kind, c.describe(), c.dtype.name, c.shape.as_list(), c.nbytes) for c in plan.collectives]
  # 4 rows x 8 tokens per replica: 32 slices of 4 floats and their 32 indices; the Dense layer dense.
  assert rows == [
      ("all_reduce", "all_reduce(op='mean')", "float32", [4, 3], 48),
      ("all_reduce", "all_reduce(op='mean')", "float32", [3], 12),
      ("all_gather", "all_gather(concat_dimension=0, ragged=True)", "float32", [32, 4], 512),
      ("all_gather", "all_gather(concat_dimension=0, ragged=True)", "int32", [32], 128),
  ]
  assert plan.bytes_per_step == 4 * (48 + 12 + 512 + 128)
  assert "all_gather(concat_dimension=0, ragged=True)  replica  float32  [32,4]  512" in str(plan)


# -- a sharded embedding: rows gathered per piece ------------------------------------------


def train_sharded_embedding(repl, optimizer, use="split table"):
  """Local view on a 2-D mesh, as one device computes ``mean(embedding(x), 1) @ w``.

  ``use``: "split table": the embedding dimension and ``w``'s rows split over
  "model", per-piece sparse gradients gathered over "batch"; with the table
  replicated, "columns": each "model" device uses its columns of the rows;
  "whole": every device computes the same (``w`` replicated too); "tokens":
  each "model" device looks up its half of the tokens (a sequence split).
  """
  layouts = {"split table": {r"embedding/embeddings$": (None, "model"), r"^w$": ("model", None)},
             "columns": {r"^w$": ("model", None)}, "whole": {}, "tokens": {}}[use]
  context = repl.context(layouts=layouts) if repl else tf.device("/cpu:0")
  with context:
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(VOCAB, 4, name="embedding")
    embedding.build((None, TOKENS))
    w = tf.Variable(np.random.RandomState(4).randn(4, 3).astype(np.float32), name="w")
    opt = OPTIMIZERS[optimizer]()
    opt = repl.wrap_optimizer(opt) if repl else opt
  params = [embedding.embeddings, w]

  def piece(t, axis):  # this "model" device's half of dimension ``axis``
    return tf.gather(tf.stack(tf.split(t, 2, axis=axis)), repl.axis_index("model"))

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      if repl is None or use == "whole":
        logits = tf.reduce_mean(embedding(x), axis=1) @ w
      elif use == "tokens":
        logits = repl.all_sum(tf.reduce_sum(embedding(piece(x, 1)), axis=1) / TOKENS, axis="model") @ w
      else:  # this piece's partial product
        pooled = tf.reduce_mean(embedding(x), axis=1)
        logits = repl.all_sum((piece(pooled, 1) if use == "columns" else pooled) @ w, axis="model")
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    grads = tape.gradient(loss, params)
    assert isinstance(grads[0], tf.IndexedSlices)
    opt.apply_gradients(zip(grads, params))

  if repl is None:
    one_device = tf.function(step)
    for batch in batches():
      one_device(batch)
  else:
    for batch in batches():
      repl.run(step, tf.data.Dataset.from_tensors(batch))
  return params, opt, step


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_sharded_embedding_equals_one_device(optimizer):
  want, want_opt, _ = train_sharded_embedding(None, optimizer)
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)))
  got, opt, step = train_sharded_embedding(repl, optimizer)
  table = _variables.underlying(got[0])
  assert table.sharding.spec == (None, "model") and table.components[0].shape.as_list() == [VOCAB, 2]
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), b.numpy(), atol=TOL, rtol=0)
  for a, b in zip(opt.variables, want_opt.variables):
    np.testing.assert_allclose(np.asarray(a), b.numpy(), atol=TOL, rtol=0, err_msg=b.path)
  # Each piece's rows (8 rows x 8 tokens, 2 of the 4 columns) are gathered over "batch" only.
  plan = repl.explain(step, tf.data.Dataset.from_tensors(batches()[0]))
  gathers = [(c.axes, c.group_size, c.shape.as_list()) for c in plan.collectives if c.kind == "all_gather"]
  assert gathers == [(("batch",), 2, [64, 2]), (("batch",), 2, [64])]


@pytest.mark.parametrize("optimizer, use", [  # CI: Adam whole and columns, SGD tokens; --full-grid: all six
    pytest.param(o, u, marks=() if (o, u) in (("adam", "whole"), ("adam", "columns"), ("sgd", "tokens"))
                 else (pytest.mark.full_grid,)) for o in ("adam", "sgd") for u in ("whole", "columns", "tokens")])
def test_replicated_embedding_on_a_2d_mesh_equals_one_device(optimizer, use):
  # Was (before 2026-11-24), "whole" with Adam: the table 0.12 off one device. The two "model" devices
  # of a batch shard hold rows of the same tokens; gathered over all four devices, each token's row
  # came twice, at half the value, and Keras Adam's second moment sums the squares of a row's slices.
  want, want_opt, _ = train_sharded_embedding(None, optimizer)
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)))
  got, opt, step = train_sharded_embedding(repl, optimizer, use=use)
  assert _variables.underlying(got[0]).components[0].shape.as_list() == [VOCAB, 4]
  for a, b in zip(list(got) + list(opt.variables), list(want) + list(want_opt.variables)):
    if _variables.underlying(a).sharding is None or _variables.underlying(a).sharding.spec == (None, None):
      assert_every_replica_equals([b.numpy()], [a])  # the table, its slots, the counters: every copy
    else:
      np.testing.assert_allclose(np.asarray(a), b.numpy(), atol=TOL, rtol=0, err_msg=b.name)
  # The copies' rows (8 rows x 8 tokens, or half the tokens) over "model", then rows over "batch".
  plan = repl.explain(step, tf.data.Dataset.from_tensors(batches()[0]))
  rows = 32 if use == "tokens" else 64
  gathers = [(c.axes, c.shape.as_list()) for c in plan.collectives if c.kind == "all_gather"]
  assert gathers == [(("model",), [rows, 4]), (("model",), [rows]), (("batch",), [None, 4]), (("batch",), [None])]


# -- tf.gather on a tf.Variable, Sonnet 2 optimizers --------------------------------------


class Bag(tf.Module):
  """A tf.Variable table looked up with tf.gather (read by rows), mean-pooled, then a linear layer."""

  def __init__(self, vocab=VOCAB):
    super().__init__()
    rng = np.random.RandomState(3)
    self.table = tf.Variable(rng.randn(vocab, 4).astype(np.float32), name="table")
    self.w = tf.Variable(rng.randn(4, 3).astype(np.float32), name="w")

  def __call__(self, x):
    return tf.reduce_mean(tf.gather(self.table, x), axis=1) @ self.w


SONNET = {"snt_adam": lambda: snt.optimizers.Adam(0.05), "snt_sgd": lambda: snt.optimizers.SGD(0.5),
          "snt_momentum": lambda: snt.optimizers.Momentum(0.1, 0.9)}


def train_bag(n, optimizer, accumulation_steps=1, data=None, vocab=VOCAB, **wrap_kwargs):
  """Trains Bag with a Sonnet (``apply(updates, parameters)``) or Keras optimizer."""
  data = batches() if data is None else data
  repl = replicator.Replicator(cpus(n)) if n else None
  with repl.context() if repl else tf.device("/cpu:0"):
    model, opt = Bag(vocab), {**SONNET, **OPTIMIZERS}[optimizer]()
    if repl:
      opt = repl.wrap_optimizer(opt, accumulation_steps=accumulation_steps, **wrap_kwargs)
  params = [model.table, model.w]

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    grads = tape.gradient(loss, params)
    assert isinstance(grads[0], tf.IndexedSlices)
    opt.apply(grads, params)

  if repl is None:
    one_device = tf.function(step)
    for batch in data:
      one_device(batch)
  else:
    for batch in data:
      repl.run(step, inputs=split(batch, n))
  return model, opt, repl, step


@pytest.mark.parametrize("optimizer, n", [(o, n) for o in sorted(OPTIMIZERS) for n in REPLICA_COUNTS]
                         + [(o, n) for o in ("snt_adam", "snt_sgd", "snt_momentum") for n in (2, 4)])
def test_tf_gather_on_a_variable_equals_one_device(optimizer, n):
  want, want_opt, _, _ = train_bag(None, optimizer)
  got, opt, _, _ = train_bag(n, optimizer)
  assert_every_replica_equals([want.table.numpy(), want.w.numpy()], [got.table, got.w])
  if optimizer != "snt_sgd":  # the others' state: step counters, moments, momentum
    assert_every_replica_equals([v.numpy() for v in want_opt.variables], list(opt.variables))


def test_accumulated_sparse_gradients_equal_one_larger_batch():
  # Two accumulated steps on 4 replicas == one step on one device with both
  # global batches: the rows of both steps reach Adam, not their dense sum.
  data = batches(seed=5)
  big = [(np.concatenate([data[0][0], data[1][0]]), np.concatenate([data[0][1], data[1][1]]))]
  want, want_opt, _, _ = train_bag(None, "adam", data=big)
  got, opt, repl, step = train_bag(4, "adam", accumulation_steps=2, data=data[:2])
  assert_every_replica_equals([want.table.numpy(), want.w.numpy()], [got.table, got.w])
  assert_every_replica_equals([v.numpy() for v in want_opt.variables], list(opt.variables))
  assert int(opt.iterations.numpy()) == 1
  # The rows and indices accumulated are emptied by the applying step.
  rows, indices = opt._accumulators[0].values, opt._accumulators[0].indices  # pylint: disable=protected-access
  assert [c.numpy().shape for c in _variables.underlying(rows).components] == [(0, 4)] * 4
  assert [c.numpy().shape for c in _variables.underlying(indices).components] == [(0,)] * 4


def test_accumulating_rows_then_a_dense_gradient_is_an_error():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    table = tf.Variable(tf.ones([5, 2]))
    opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1), accumulation_steps=2)

  def sparse_step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.gather(table, [1, 2]))
    opt.apply(tape.gradient(loss, [table]), [table])

  def dense_step():
    opt.apply([tf.ones([5, 2])], [table])

  repl.run(sparse_step)
  with pytest.raises(TypeError, match=r"accumulates the rows of '.*'s sparse gradient \(tf.IndexedSlices, as its "
                                      r"first accumulated step gave\), but this step gives a dense gradient\. Fix:"):
    repl.run(dense_step)


# -- how the update reaches every replica (sharded update) -----------------------------------


@pytest.mark.parametrize("model, optimizer, vocab, broadcasts_table", [
    # Keras Embedding reads the table whole: the owner applies and broadcasts.
    ("embedding", "sgd", VOCAB, True),
    ("embedding", "adam", VOCAB, True),
    # tf.gather reads rows; SGD writes rows: every replica applies them to a
    # table of at least 8 times the gathered bytes (2 KB here), else the owner.
    ("gather", "sgd", 2000, False),
    ("gather", "sgd", VOCAB, True),
    # Adam decays every row: the whole table changes.
    ("gather", "adam", 2000, True),
])
def test_sharded_update_chooses_between_rows_everywhere_and_one_owner(model, optimizer, vocab, broadcasts_table):
  # Without buckets, a broadcast of the table's shape is the table's (an owner's new weights share one otherwise).
  if model == "embedding":
    trained, opt, repl, step = train(4, optimizer, update="sharded", bucket_bytes=None)
    table = trained.variables[0]
    want = train(None, optimizer)[0].variables[0].numpy()
  else:
    trained, opt, repl, step = train_bag(4, optimizer, vocab=vocab, update="sharded", bucket_bytes=None)
    table = trained.table
    want = train_bag(None, optimizer, vocab=vocab)[0].table.numpy()
  plan = repl.explain(step, inputs=split(batches()[0], 4))
  broadcasts = [c for c in plan.collectives if c.kind == "broadcast"]
  assert any(c.shape == table.shape for c in broadcasts) == broadcasts_table
  assert (opt.owners([table])[0] is None) == (not broadcasts_table)
  # Either way: the table is equal on every replica and to one device.
  assert_every_replica_equals([want], [table])


# -- different numbers of rows per replica ------------------------------------------------


@pytest.mark.parametrize("implementation", ["one_device", "collective_ops"])
def test_replicas_with_different_numbers_of_rows(implementation):
  # 16 rows split 2, 6, 3, 5: each replica gathers a different number of
  # slices. A loss summed over the local rows and divided by the global row
  # count, reduced with "sum", is one device's mean.
  sizes = [2, 6, 3, 5]
  data = batches(seed=2)
  rows = np.cumsum([0] + sizes)

  def summed_loss(model, x, y):
    return tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)) / GLOBAL_BATCH

  want_model, want_opt, _, _ = train(None, "adam", data=data)
  repl = replicator.Replicator(cpus(4), implementation=implementation)
  with repl.context():
    model = embedding_model()
    opt = repl.wrap_optimizer(OPTIMIZERS["adam"](), reduction="sum")

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = summed_loss(model, x, y)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  def per_replica(batch):
    return replicator.PerReplica([(batch[0][a:b], batch[1][a:b]) for a, b in zip(rows[:-1], rows[1:])])

  for batch in data:
    repl.run(step, inputs=per_replica(batch))
  assert_every_replica_equals([v.numpy() for v in want_model.variables], model.variables)
  assert_every_replica_equals([v.numpy() for v in want_opt.variables], opt.variables)
  plan = repl.explain(step, inputs=per_replica(data[0]))
  gathered = [c for c in plan.collectives if c.kind == "all_gather"]
  assert [c.shape.as_list() for c in gathered] == [[None, 4], [None]]
  assert gathered[0].bytes_str() == f"{2 * TOKENS * 4 * 4:,}-{6 * TOKENS * 4 * 4:,}"
  assert plan.bytes_per_step >= sum(sizes) * TOKENS * (16 + 4)


# -- very dense slices ---------------------------------------------------------------------


@pytest.mark.parametrize("densify_above, kind", [(0.9, "all_reduce"), (1.8, "all_gather")])
def test_densify_above_chooses_by_the_gathered_rows(densify_above, kind):
  data = batches()

  def bigger_vocab_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((TOKENS,), dtype="int32"), keras.layers.Embedding(75, 4),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])

  # 4 replicas x 32 slices = 128 gathered rows for a 75-row table: 1.71 times its rows.
  want_model, _, _, _ = train(None, "sgd", data=data, model_fn=bigger_vocab_model)
  model, _, repl, step = train(4, "sgd", data=data, model_fn=bigger_vocab_model, densify_above=densify_above,
                               bucket_bytes=None)
  plan = repl.explain(step, inputs=split(data[0], 4))
  table_collective = [c for c in plan.collectives if c.dtype == tf.float32 and c.shape.rank == 2
                      and c.shape[1] == 4 and c.kind != "broadcast"]
  assert [c.kind for c in table_collective] == [kind]
  # SGD is linear in the gradient: the dense sum is exact too.
  assert_every_replica_equals([v.numpy() for v in want_model.variables], model.variables)


def test_densify_above_is_checked():
  repl = replicator.Replicator(cpus(2))
  with pytest.raises(ValueError, match=r"wrap_optimizer\(densify_above=-1\): needs None or a fraction >= 0"):
    repl.wrap_optimizer(keras.optimizers.SGD(), densify_above=-1)


# -- the local view: repl.all_reduce of IndexedSlices ------------------------------------------


def test_all_reduce_of_indexed_slices_gathers_rows():
  repl = replicator.Replicator(cpus(3))

  def step():
    r = repl.replica_id
    slices = tf.IndexedSlices(tf.fill([r + 1, 2], float(r + 1)), tf.range(r + 1) + 10 * r, tf.constant([40, 2]))
    total, mean = repl.all_reduce(slices, "sum"), repl.all_reduce({"m": slices}, "mean")["m"]
    assert isinstance(total, tf.IndexedSlices) and isinstance(mean, tf.IndexedSlices)
    return total.values, total.indices, mean.values, total.dense_shape

  values, indices, mean, dense_shape = repl.run(step)
  for r in range(3):
    np.testing.assert_array_equal(values[r], [[1, 1], [2, 2], [2, 2], [3, 3], [3, 3], [3, 3]])
    np.testing.assert_array_equal(indices[r], [0, 10, 11, 20, 21, 22])
    np.testing.assert_allclose(mean[r], values[r] / 3)
    np.testing.assert_array_equal(dense_shape[r], [40, 2])


def test_all_reduce_max_of_indexed_slices_is_an_error():
  repl = replicator.Replicator(cpus(2))

  def step():
    return repl.all_reduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2])), "max")

  with pytest.raises(TypeError, match=r"repl.all_reduce\(op='max'\) got a tf.IndexedSlices at .*Sparse values are "
                                      r"reduced by \"sum\" or \"mean\".*Fix: use op=\"sum\"/\"mean\", or reduce a "
                                      r"dense tensor"):
    repl.run(step)


def test_gradient_through_a_ragged_gather():
  # d/dx of sum(all_gather(x) * w) for replicas holding 1, 2 and 3 rows (a
  # batch dimension without static size: the gather is ragged): each
  # replica's rows get the sum over replicas of w at their place in the gather.
  repl = replicator.Replicator(cpus(3))
  sizes = [1, 2, 3]
  w = np.arange(1.0, 7.0, dtype=np.float32)[:, None]

  def input_fn(ctx):
    size = sizes[ctx.replica_id]
    return tf.data.Dataset.from_tensor_slices(np.ones([size, 1], np.float32)).batch(size)

  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      gathered = repl.all_gather(x)
      loss = tf.reduce_sum(gathered * w)
    return gathered, tape.gradient(loss, x)

  gathered, grads = repl.run(step, input_fn)
  offsets = np.cumsum([0] + sizes)
  for r in range(3):
    np.testing.assert_array_equal(gathered[r], np.ones([6, 1]))
    np.testing.assert_allclose(grads[r], 3 * w[offsets[r]:offsets[r + 1]])
