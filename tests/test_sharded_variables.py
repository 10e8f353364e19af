"""Tests for sharded variables: creation, local reads in steps, global reads, writes,
gradient reduction over replicated axes, slots, per-device bytes, input pipelines."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator


def _repl(shape, **kwargs):
  m = mesh.Mesh(shape, devices=cpus(int(np.prod(list(shape.values())))))
  return replicator.Replicator(mesh=m, **kwargs)


def _pieces(variable):
  return [c.numpy() for c in variable.components]


def test_global_initial_value_is_the_same_whatever_the_layout():
  init = keras.initializers.GlorotUniform(seed=7)
  reference = init([8, 16]).numpy()
  for shape, spec in [({"batch": 2, "model": 2}, (None, "model")), ({"batch": 2, "model": 4}, ("batch", "model")),
                      ({"x": 8}, (("x",), None))]:
    repl = _repl(shape)
    with repl.context(layouts={"w": spec}):
      w = tf.Variable(lambda: init([8, 16]), name="w")
    np.testing.assert_array_equal(w.numpy(), reference)
    layout = mesh.Layout(spec, repl.mesh)
    for d, piece in enumerate(_pieces(w)):
      begin, size = layout.shard_slices(d, [8, 16])
      np.testing.assert_array_equal(piece, reference[begin[0]:begin[0] + size[0], begin[1]:begin[1] + size[1]])
      assert w.components[d].device.endswith(f"CPU:{d}")
    assert w.shape == (8, 16) and w.sharding == layout


def test_a_keras_variable_unpacks_into_its_pieces_and_reads_into_numpy_without_warnings():
  # Was: mesh.unpack(layer.kernel) refused a Keras variable (it needed .value); np.array(variable) warned
  # "__array__ implementation doesn't accept a copy keyword" (NumPy 2's protocol; warnings are errors here).
  repl = _repl({"batch": 2, "model": 2})
  with repl.context(layouts={r"dense/kernel$": (None, "model")}):
    layer = keras.layers.Dense(6, name="dense")
    layer.build((None, 4))
  whole = layer.kernel.numpy()
  pieces = [p.numpy() for p in mesh.unpack(layer.kernel)]
  expected = mesh.split(whole, mesh.Layout((None, "model"), repl.mesh))
  assert len(pieces) == 4
  for piece, want in zip(pieces, expected):
    np.testing.assert_array_equal(piece, want.numpy())
  np.testing.assert_array_equal(np.array(layer.kernel.value), whole)  # NumPy 2: __array__(dtype, copy)
  np.testing.assert_array_equal(np.array(layer.bias.value, dtype=np.float64, copy=True), np.zeros(6))
  with pytest.raises(ValueError, match=r"copy=False.*Fix: np.asarray\(x\)"):
    np.array(layer.kernel.value, copy=False)


def test_reads_local_piece_inside_a_step_global_outside():
  repl = _repl({"batch": 2, "model": 2})
  value = np.arange(24, dtype=np.float32).reshape(2, 12)
  with repl.context(layouts=mesh.LayoutMap({"w": (None, "model")})):
    w = tf.Variable(value, name="w")

  def step():
    return tf.identity(w), tf.constant(w.shape.as_list())

  pieces, shapes = repl.run(step)
  for d in range(4):
    k = d % 2
    np.testing.assert_array_equal(pieces[d].numpy(), value[:, 6 * k:6 * k + 6])
    assert shapes[d].numpy().tolist() == [2, 12]  # shape stays global
  np.testing.assert_array_equal(tf.convert_to_tensor(w).numpy(), value)
  np.testing.assert_array_equal(w.read_value().numpy(), value)


def test_writes_inside_a_step_go_to_the_local_piece():
  repl = _repl({"model": 4})
  with repl.context(layouts={"w": ("model",)}):
    w = tf.Variable(tf.zeros([8]), name="w")
  repl.run(lambda: w.assign_add(tf.fill([2], tf.cast(repl.replica_id, tf.float32))))
  np.testing.assert_array_equal(w.numpy(), [0, 0, 1, 1, 2, 2, 3, 3])


def test_writes_outside_a_step_split_the_global_value():
  repl = _repl({"batch": 2, "model": 2})
  with repl.context(layouts={"w": ("model", None)}):
    w = tf.Variable(tf.zeros([4, 2]), name="w")
  value = np.arange(8, dtype=np.float32).reshape(4, 2)
  w.assign(value)
  np.testing.assert_array_equal(w.numpy(), value)
  np.testing.assert_array_equal(_pieces(w)[3], value[2:])
  w.assign_add(np.ones([4, 2], np.float32))
  np.testing.assert_array_equal(w.numpy(), value + 1)
  with pytest.raises(NotImplementedError, match=r"scatter_add\(\) outside a step is not supported for the sharded variable"):
    w.scatter_add(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])))


def test_layout_errors_name_the_variable():
  repl = _repl({"batch": 2, "model": 4})
  with pytest.raises(mesh.LayoutError, match=r"Cannot split variable 'dense_1/kernel' of shape \[3, 6\] with layout "
                     r"\(None, 'model'\): dimension 1 has size 6, which is not divisible by 4"):
    with repl.context(layouts={"dense_1/kernel": (None, "model")}):
      keras.layers.Dense(6, name="dense_1").build((None, 3))
  with pytest.raises(mesh.LayoutError, match="names mesh axis 'hidden'"):
    with repl.context(layouts={"w": (None, "hidden")}):
      tf.Variable(tf.zeros([2, 4]), name="w")
  with pytest.raises(replicator.VariableCreationError, match="on-read .* variable, such as a metric's"):
    with repl.context(layouts={"total": ()}):
      pass
    with repl.context(layouts={"count": ("model",)}):
      tf.Variable(tf.zeros([4]), name="count", synchronization=tf.VariableSynchronization.ON_READ,
                  aggregation=tf.VariableAggregation.SUM)


def test_keras_layer_and_adam_slots_are_sharded():
  repl = _repl({"batch": 2, "model": 2})
  with repl.context(layouts={"dense_1/kernel": (None, "model"), "dense_1/bias": ("model",)}):
    layer = keras.layers.Dense(8, name="dense_1")
    layer.build((None, 4))
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.1))

  def step(x):
    with tf.GradientTape() as tape:
      loss = repl.all_sum(tf.reduce_sum(layer(x) ** 2), axis="model")
    grads = tape.gradient(loss, layer.trainable_variables)
    optimizer.apply_gradients(zip(grads, layer.trainable_variables))
    return loss

  repl.run(step, inputs=replicator.PerReplica([tf.ones([2, 4])] * 4))
  slots = [v for v in optimizer.optimizer.variables if "dense_1_kernel" in v.path]
  assert len(slots) == 2
  for slot in slots:
    assert slot.value.sharding == layer.kernel.value.sharding
    assert [c.shape.as_list() for c in slot.value.components] == [[4, 4]] * 4
    assert slot.shape == (4, 8)


def _train_one_step(repl, layouts, reduction, x_global):
  with repl.context(layouts=layouts):
    w = tf.Variable(tf.reshape(tf.range(12.0), [3, 4]) / 10.0, name="w")
    b = tf.Variable(tf.ones([4]), name="b")
    # One all-reduce per gradient (no buckets), so the plan shows each one's axes.
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(1.0), reduction=reduction, bucket_bytes=None)

  def step(x):
    with tf.GradientTape() as tape:
      y = tf.nn.tanh(x @ w)  # [rows, 4 / model], local columns
      per_row = repl.all_sum(tf.reduce_sum(y * y, axis=1), axis="model")
      loss = tf.reduce_sum(per_row + tf.reduce_sum(b))
      loss = loss / x_global.shape[0] if reduction == "sum" else loss / tf.cast(tf.shape(x)[0], tf.float32)
    grads = tape.gradient(loss, [w, b])
    optimizer.apply_gradients(zip(grads, [w, b]))
    return loss

  n_batch = repl.num_input_pipelines
  rows = np.split(x_global, n_batch)
  repl.run(step, inputs=replicator.PerReplica([rows[repl.input_pipeline(r)] for r in range(repl.num_replicas)]))
  return repl, step, w.numpy(), b.numpy()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_reduced_only_over_replicated_axes(reduction):
  x = np.random.RandomState(0).randn(4, 3).astype(np.float32)
  # NumPy reference: loss = mean_rows(sum_cols tanh(xw)^2 + sum(b)), one SGD step of rate 1.
  w0 = np.arange(12, dtype=np.float32).reshape(3, 4) / 10.0
  y = np.tanh(x @ w0)
  grad_w = x.T @ (2 * y * (1 - y ** 2)) / 4
  expected_w, expected_b = w0 - grad_w, np.ones(4, np.float32) - 1.0
  for shape in [{"batch": 2, "model": 2}, {"batch": 1, "model": 4}, {"batch": 4, "model": 1}, {"batch": 2, "model": 4}]:
    if 4 % shape["model"]:
      continue
    repl, step, w, b = _train_one_step(_repl(shape), {"w": (None, "model")}, reduction, x)
    np.testing.assert_allclose(w, expected_w, rtol=1e-5, atol=1e-6, err_msg=str(shape))
    np.testing.assert_allclose(b, expected_b, rtol=1e-5, atol=1e-6, err_msg=str(shape))
    plan = repl.explain(step, inputs=replicator.PerReplica([x[:1]] * repl.num_replicas))
    w_reductions = [c.axes for c in plan.collectives if c.kind == "all_reduce" and c.shape.as_list() == [3, 4 // shape["model"]]]
    b_reductions = [c.axes for c in plan.collectives if c.kind == "all_reduce" and c.shape.as_list() == [4]]
    # w is sharded on "model": reduced over "batch" only (nothing to reduce on a 1-device batch axis)
    assert w_reductions == ([("batch",)] if shape["batch"] > 1 else []), plan
    assert b_reductions == [tuple(a for a in ("batch", "model") if shape[a] > 1)], plan


def test_bytes_per_device_of_sharded_variables():
  repl = _repl({"batch": 2, "model": 4})
  with repl.context(layouts={"sharded": (None, "model"), "both": ("batch", "model")}):
    replicated = tf.Variable(tf.zeros([64, 32]), name="replicated")
    sharded = tf.Variable(tf.zeros([64, 32]), name="sharded")
    both = tf.Variable(tf.zeros([64, 32]), name="both")
  full = 64 * 32 * 4
  assert replicator.bytes_per_device([replicated]) == {d: full for d in cpus(8)}
  assert replicator.bytes_per_device([sharded]) == {d: full // 4 for d in cpus(8)}
  assert replicator.bytes_per_device([both]) == {d: full // 8 for d in cpus(8)}
  for d, c in zip(cpus(8), sharded.components):  # the buffers live on their devices, at 1/4 of the size
    assert mesh.canonical_name(c.handle.device) == d
    with tf.device(d):
      value = c.read_value()
    assert mesh.canonical_name(value.device) == d and value.numpy().nbytes == full // 4


def test_input_fn_once_per_pipeline_and_shared_along_model():
  repl = _repl({"batch": 2, "model": 4})
  calls = []

  def input_fn(ctx):
    calls.append((ctx.replica_id, ctx.num_replicas))
    return tf.data.Dataset.range(100).map(lambda i: i * 10 + ctx.replica_id).batch(2)

  values = repl.run(tf.identity, input_fn)
  assert sorted(calls) == [(0, 2), (1, 2)]
  got = [v.numpy().tolist() for v in values]
  assert got == [[0, 10]] * 4 + [[1, 11]] * 4
  assert repl.num_input_pipelines == 2 and [repl.input_pipeline(r) for r in range(8)] == [0] * 4 + [1] * 4


def test_distributed_dataset_split_along_batch_axes():
  repl = _repl({"model": 2, "batch": 2})  # batch is the fast axis here
  ds = tf.data.Dataset.range(8).batch(4)
  values = repl.run(tf.identity, ds)
  assert [v.numpy().tolist() for v in values] == [[0, 1], [2, 3], [0, 1], [2, 3]]
  assert [[t.numpy().tolist() for t in p] for p in repl.distribute_dataset(ds)][0] == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_mesh_without_batch_axis_needs_batch_axes():
  repl = _repl({"x": 2, "y": 2})
  with pytest.raises(ValueError, match=r"mesh \{'x': 2, 'y': 2\} has no 'batch' or 'replica' axis, so it cannot tell how "
                     r"to split input batches across devices\. Fix: pass Replicator\(mesh=\.\.\., batch_axes=\.\.\.\)"):
    repl.run(tf.identity, lambda ctx: tf.data.Dataset.range(4))
  repl = _repl({"x": 2, "y": 2}, batch_axes=())
  assert [v.numpy() for v in repl.run(tf.identity, lambda ctx: tf.data.Dataset.range(4))] == [0] * 4


def test_unpack_and_relayout_of_a_sharded_variable():
  repl = _repl({"batch": 2, "model": 2})
  value = np.arange(16, dtype=np.float32).reshape(4, 4)
  with repl.context(layouts={"w": ("batch", "model")}):
    w = tf.Variable(value, name="w")
  pieces = mesh.unpack(w)
  np.testing.assert_array_equal(pieces[1].numpy(), value[:2, 2:])
  moved = mesh.relayout(w, mesh.Layout((None, "batch"), repl.mesh))
  np.testing.assert_array_equal(mesh.unpack(moved)[2].numpy(), value[:, 2:])
  np.testing.assert_array_equal(moved.numpy(), value)


def test_sonnet_optimizer_slots_follow_the_layout_map():
  snt = pytest.importorskip("sonnet")
  repl = _repl({"batch": 2, "model": 2})
  with repl.context(layouts=mesh.LayoutMap({r"w1$": (None, "model")})):
    w1 = tf.Variable(tf.ones([4, 8]), name="w1")
    optimizer = repl.wrap_optimizer(snt.optimizers.Adam(0.1))

  def step(x):
    with tf.GradientTape() as tape:
      loss = repl.all_sum(tf.reduce_sum((x @ w1) ** 2), axis="model")
    optimizer.apply([tape.gradient(loss, w1)], [w1])

  repl.run(step, inputs=replicator.PerReplica([tf.ones([2, 4])] * 4))
  slots = optimizer.optimizer.m + optimizer.optimizer.v  # named after the parameter: they match "w1$"
  assert [s.sharding for s in slots] == [w1.sharding] * 2
  assert [c.shape.as_list() for c in slots[0].components] == [[4, 4]] * 4


def test_gather_outside_a_step_reads_the_global_value():
  repl = _repl({"model": 4})
  table = np.arange(16, dtype=np.float32).reshape(8, 2)
  with repl.context(layouts={"emb": ("model", None)}):
    emb = tf.Variable(table, name="emb")
  np.testing.assert_array_equal(tf.gather(emb, [7, 0]).numpy(), table[[7, 0]])
  np.testing.assert_array_equal(emb.sparse_read([5]).numpy(), table[[5]])
  np.testing.assert_array_equal(emb.gather_nd([[6, 1]]).numpy(), [table[6, 1]])
  # inside a step each device gathers from its own rows
  rows = repl.run(lambda: tf.gather(emb, [1]))
  assert [r.numpy().tolist() for r in rows] == [[table[2 * d + 1].tolist()] for d in range(4)]


def test_wrapped_optimizer_variables_are_the_wrapped_optimizers():
  repl = _repl({"batch": 2})
  with repl.context():
    w = tf.Variable(tf.ones([2]))
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.1))
  optimizer.build([w])
  assert len(optimizer.variables) == len(optimizer.optimizer.variables) == 4
