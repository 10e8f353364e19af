"""The global view: one step written for one device, partitioned over the mesh by layouts alone."""

import collections
import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import global_step_of
from conftest import keras_step
from conftest import sonnet_step

import mesh
import replicator
import rewrite
from rewrite import _expansion
from rewrite import _partition
from rewrite.rules import _base

LAYOUTS = {
    "batch": None,
    "hidden": {r"ff_in/kernel$": (None, "model"), r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)},
}
STEPS = 3
BATCH = 12


def _model_and_optimizer(context, optimizer, build=True, dropout=False):
  with context:
    keras.utils.set_random_seed(1)
    middle = [keras.layers.Dropout(0.5, seed=3)] if dropout else []
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu", name="ff_in"),
                              *middle, keras.layers.Dense(4, name="ff_out")])
    opt = {"adam": lambda: keras.optimizers.Adam(1e-2),
           "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
           "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9)}[optimizer]()
    if build:
      opt.build(model.trainable_variables)
  return model, opt


_make_step = keras_step  # the single-device step, unchanged in every case


def _dataset():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
  y = rng.integers(0, 4, size=BATCH * STEPS).astype("int32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def _global_repl(layouts, shape=(2, 2)):
  m = mesh.Mesh({"batch": shape[0], "model": shape[1]}, devices=cpus(shape[0] * shape[1]))
  return replicator.Replicator(mesh=m, layouts=None if layouts is None else mesh.LayoutMap(layouts),
                               batch_axes=("batch",), view="global")


_built = global_step_of


def _train(layouts, optimizer="adam", shape=(2, 2), build=True, dropout=False):
  one_model, one_opt = _model_and_optimizer(contextlib.nullcontext(), optimizer, dropout=dropout)
  one_step = tf.function(_make_step(one_model, one_opt))
  expected = [float(one_step(batch)) for batch in _dataset()]
  repl = _global_repl(layouts, shape)
  model, opt = _model_and_optimizer(repl.context(), optimizer, build, dropout)
  step_fn = _make_step(model, opt)
  dataset = _dataset()
  losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  return repl, (one_model, one_opt, expected), (model, opt, losses), step_fn  # step_fn keeps its step


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (4, 1), (2, 4)])
@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mlp_equals_one_device(layout, optimizer, shape):
  repl, (one_model, one_opt, expected), (model, opt, losses), _step_fn = _train(LAYOUTS[layout], optimizer, shape)
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  reference = one_model.variables + one_opt.variables
  ours = model.variables + opt.variables
  assert [re.sub(r"(sequential|adam_w|adam|sgd)_\d+", r"\1", v.path) for v in ours] == [v.path for v in reference]
  assert len(ours) >= 4 + (5 if optimizer == "sgd" else 9)
  assert_every_copy(ours, reference)
  assert repl.trace_count == 1  # traced once, at the global batch's shapes
  # No collective over a mesh axis of size 1 (it would split nothing).
  assert all(repl.mesh.axis_size(c.axes) > 1 for c in _built(repl).plan.collectives)


def test_optimizer_built_by_the_step_gets_sharded_slots():
  # The spelling: the optimizer is built by its first apply_gradients, inside the trace.
  _, (one_model, one_opt, expected), (model, opt, losses), _step_fn = _train(LAYOUTS["hidden"], build=False)
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)
  (momentum,) = [v.value for v in opt.variables if v.path.endswith("ff_in_kernel_momentum")]
  assert [c.shape.as_list() for c in momentum.components] == [[8, 8]] * 4


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dropout_with_a_seed_equals_one_device(layout):
  # One random stream (no per-device seed offsets), drawn at the global shape, then sliced.
  _, (one_model, one_opt, expected), (model, opt, losses), _step_fn = _train(LAYOUTS[layout], dropout=True)
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)


def test_hidden_split_communicates_like_megatron():
  repl, _, (model, opt, _), _step_fn = _train(LAYOUTS["hidden"])
  step = _built(repl)
  found = sorted((c.kind, c.param_dict.get("op"), c.axes, tuple(c.shape.as_list())) for c in step.plan.collectives)
  assert found == sorted([
      ("all_reduce", "sum", ("model",), (BATCH // 2, 4)),  # logits: the second kernel's split contraction
      ("all_reduce", "sum", ("batch",), ()),  # the loss's sum over the batch
      ("all_reduce", "sum", ("batch",), (4,)),  # gradients: sums over the batch
      ("all_reduce", "sum", ("batch",), (8, 4)),
      ("all_reduce", "sum", ("batch",), (8,)),
      ("all_reduce", "sum", ("batch",), (8, 8)),
      # The sharded Adam update: each variable's new value, computed by one device of each "batch" group.
      ("broadcast", None, ("batch",), (4,)),
      ("broadcast", None, ("batch",), (8, 4)),
      ("broadcast", None, ("batch",), (8,)),
      ("broadcast", None, ("batch",), (8, 8)),
  ])
  assert not step.partition.fallbacks
  # Sharded variables and their Adam slots keep half of the hidden dimension per device.
  kernel = model.layers[0].kernel.value
  slots = [v.value for v in opt.variables if "ff_in_kernel" in v.path]
  assert len(slots) == 2
  for v in [kernel] + slots:
    assert [c.shape.as_list() for c in v.components] == [[8, 8]] * 4
    assert v.shape.as_list() == [8, 16]
  assert replicator.bytes_per_device(slots) == {d: 2 * 8 * 8 * 4 for d in repl.devices}


def test_batch_only_sums_gradients_over_batch_without_gathers():
  repl, _, _, _step_fn = _train(LAYOUTS["batch"])
  step = _built(repl)
  kinds = collections.Counter((c.kind, c.axes) for c in step.plan.collectives)
  # The loss and four gradients; the sharded Adam update's four new values.
  assert kinds == {("all_reduce", ("batch",)): 5, ("broadcast", ("batch",)): 4}


def test_a_dataset_and_inputs_together_are_refused_with_both_ways_to_pass_one():
  # Was: "repl.run(step_fn, inputs=...) in the global view takes a tf.data.Dataset of global batches" (it takes
  # inputs= too: one global batch).
  repl = _global_repl(None)
  batch = next(iter(_dataset()))
  with pytest.raises(replicator.ArgumentError, match=re.escape(
      "repl.run(step_fn, dataset, inputs=...) in the global view got two inputs for one step: a dataset and inputs=. "
      "It takes one: a tf.data.Dataset of global batches (the next batch each call) or one global batch as inputs= "
      "(one step). Fix: pass one of them, repl.run(step_fn, dataset) or repl.run(step_fn, inputs=batch).")):
    repl.run(lambda b: b[0], _dataset(), inputs=batch)
  with pytest.raises(replicator.ArgumentError, match=r"got two inputs for one step: a dataset and inputs="):
    repl.run(lambda b: b[0], repl.distribute_dataset(_dataset()), inputs=batch)
  with pytest.raises(replicator.ArgumentError, match=r"repl.run\(step_fn, function, inputs=...\) .* a function and "):
    repl.run(lambda b: b[0], lambda ctx: _dataset(), inputs=batch)
  assert repl.run(lambda b: tf.reduce_sum(b[0]), inputs=batch).shape == []  # either alone runs


def test_local_view_is_the_default():
  assert replicator.Replicator(devices=cpus(2))._config.view == "local"  # pylint: disable=protected-access
  with pytest.raises(replicator.ArgumentError, match=r"view='both': expected \"local\""):
    replicator.Replicator(devices=cpus(2), view="both")


def test_global_view_traces_at_the_first_batch_s_shapes():
  repl = _global_repl(None)
  with repl.context():
    v = tf.Variable(2.0)
  ds = tf.data.Dataset.from_tensor_slices(np.ones([6, 2], "float32")).batch(4)  # no static batch size
  assert float(repl.run(lambda x: tf.reduce_sum(x) * v, ds)) == 16.0
  assert float(repl.run(lambda x: tf.reduce_sum(x) * v, ds)) == 8.0  # the last batch: a new trace


def test_global_view_refuses_variables_made_in_the_step_from_computed_values():
  repl = _global_repl(None)
  ds = tf.data.Dataset.from_tensor_slices(np.zeros([4, 2], "float32")).batch(4)
  with pytest.raises(replicator.UnsupportedError, match=re.escape(
      "from an initial value computed from the step's data (its inputs, or what a collective returns). The "
      "global view makes variables created in the step once, eagerly, before the step runs") + ".*" + re.escape(
      "Fix: make the variable before the step, inside `with repl.context():`")):
    repl.run(lambda x: tf.Variable(tf.reduce_sum(x)) * 2.0, ds)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_sonnet_mlp_built_by_its_first_call_in_the_step_equals_one_device(layout):
  # Sonnet builds its variables in the first call, from initial values computed in the step (truncated normal
  # draws of the input's shape): lifted out and drawn once, as tf.function does; the layouts apply to them.
  snt = pytest.importorskip("sonnet")
  layouts = {"hidden": {r"ff_in/w$": (None, "model"), r"ff_in/b$": ("model",), r"ff_out/w$": ("model", None)},
             "batch": None}[layout]

  def build(context):
    with context:
      tf.random.set_seed(1)
      return snt.Sequential([snt.Linear(16, name="ff_in"), tf.nn.relu, snt.Linear(4, name="ff_out")]), \
          snt.optimizers.Adam(1e-2)

  repl = _global_repl(layouts)
  net, opt = build(repl.context())
  step_fn, dataset = sonnet_step(net, opt), _dataset()
  repl.explain(step_fn, dataset)  # builds the step: the modules' variables are made, not trained yet
  assert len(net.variables) == 4
  one_net, one_opt = build(contextlib.nullcontext())
  one_net(next(iter(_dataset()))[0])
  for mine, theirs in zip(one_net.variables, net.variables):
    mine.assign(theirs.numpy())  # the lifted draws, as the initial weights of one device
  losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  one_step = tf.function(sonnet_step(one_net, one_opt))
  np.testing.assert_allclose(losses, [float(one_step(batch)) for batch in _dataset()], rtol=0, atol=1e-6)
  assert_every_copy(list(net.variables) + list(opt.variables), list(one_net.variables) + list(one_opt.variables))
  (w,) = [v for v in net.variables if v.name.startswith("ff_in/w")]
  assert w.layout.spec == ((None, "model") if layout == "hidden" else (None, None))
  assert repl.trace_count == 1
  assert not [n for n in _built(repl).graph_def.node if n.op == "TruncatedNormal"]  # drawn once, not every step


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_keras_model_built_by_its_first_call_in_the_step_equals_one_device(layout):
  # No Input layer: the layers (and Adam's slots) are built inside the first trace, as on one device.
  def model_and_optimizer(context):
    with context:
      keras.utils.set_random_seed(1)
      model = keras.Sequential([keras.layers.Dense(16, activation="relu", name="ff_in"),
                                keras.layers.Dense(4, name="ff_out")])
      return model, keras.optimizers.Adam(1e-2)

  one_model, one_opt = model_and_optimizer(contextlib.nullcontext())
  one_step = tf.function(_make_step(one_model, one_opt))
  expected = [float(one_step(batch)) for batch in _dataset()]
  repl = _global_repl(LAYOUTS[layout])
  model, opt = model_and_optimizer(repl.context())
  step_fn = _make_step(model, opt)
  dataset = _dataset()
  losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  assert len(model.variables) == 4 and len(opt.variables) == 2 + 8
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)
  if layout == "hidden":
    assert model.layers[0].kernel.value.layout.axes(1) == ("model",)  # the layouts applied to the lazy build


# -- propagation on traced graphs (rewrite._partition, no Replicator) ----------------------------

def _graph(fn, *specs):
  return tf.function(fn, autograph=False).get_concrete_function(*specs).graph


def _mesh():
  return mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))


def test_matmul_over_a_split_contraction_all_reduces():
  graph = _graph(lambda h, w: tf.matmul(h, w), tf.TensorSpec([6, 8]), tf.TensorSpec([8, 4]))
  h, w = graph.inputs
  part = _partition.propagate(graph, _mesh(), {h.name: (("batch",), ("model",)), w.name: (("model",), ())})
  (decision,) = [d for name, d in part.decisions.items() if "MatMul" in name]
  assert decision.outputs == [(("batch",), ())]
  assert decision.reduce == [("sum", ("model",))]


def test_transposed_matmul_gradient_sums_over_batch():
  graph = _graph(lambda x, d: tf.matmul(x, d, transpose_a=True), tf.TensorSpec([6, 8]), tf.TensorSpec([6, 4]))
  x, d = graph.inputs
  part = _partition.propagate(graph, _mesh(), {x.name: (("batch",), ()), d.name: (("batch",), ("model",))})
  (decision,) = [d for n, d in part.decisions.items() if graph.get_operation_by_name(n).type == "MatMul"]
  assert decision.outputs == [((), ("model",))]
  assert decision.reduce == [("sum", ("batch",))]


def test_elementwise_slices_a_replicated_operand_for_free():
  graph = _graph(lambda a, b: a * b, tf.TensorSpec([6, 1]), tf.TensorSpec([6, 4]))
  a, b = graph.inputs
  part = _partition.propagate(graph, _mesh(), {a.name: ((), ()), b.name: (("batch",), ())})
  (decision,) = [d for n, d in part.decisions.items() if graph.get_operation_by_name(n).type == "Mul"]
  assert decision.inputs == [(("batch",), ()), (("batch",), ())]
  assert decision.outputs == [(("batch",), ())]


def test_reshape_rewrites_its_shape_to_the_local_one():
  graph = _graph(lambda a: tf.reshape(a, [6, 2, 2]), tf.TensorSpec([6, 4]))
  (a,) = graph.inputs
  part = _partition.propagate(graph, _mesh(), {a.name: (("batch",), ())})
  (decision,) = [d for d in part.decisions.values() if d.consts]
  assert decision.outputs == [(("batch",), (), ())]
  assert decision.consts[1].tolist() == [3, 2, 2]


def test_an_op_without_a_rule_runs_replicated_and_is_recorded():
  graph = _graph(lambda a: tf.reverse(a, axis=[0]), tf.TensorSpec([6, 4]))
  (a,) = graph.inputs
  part = _partition.propagate(graph, _mesh(), {a.name: (("batch",), ())})
  assert [graph.get_operation_by_name(n).type for n in part.fallbacks] == ["ReverseV2"]
  (decision,) = [d for d in part.decisions.values() if d.fallback]
  assert decision.inputs[0] == ((), ()) and decision.outputs == [((), ())]


def test_expanded_graph_equals_the_global_one():
  m = _mesh()

  def fn(x, w):
    return tf.reduce_sum(tf.nn.relu(tf.matmul(x, w)), axis=0)

  specs = (tf.TensorSpec([6, 8]), tf.TensorSpec([8, 4]))
  graph = _graph(fn, *specs)
  x, w = graph.inputs
  given = {x.name: (("batch",), ()), w.name: ((), ("model",))}
  part = _partition.propagate(graph, m, given)
  with tf.Graph().as_default():  # the expansion's inputs: placeholders of a plain graph
    inputs = [tf.raw_ops.Placeholder(dtype=s.dtype, shape=s.shape, name=f"input_{i}") for i, s in enumerate(specs)]
    local = {p.name: [_expansion.local_piece(v, given[p.name], m, r) for r in range(4)]
             for p, v in zip((x, w), inputs)}
    expansion = _expansion.expand(graph, m, part, local, graph.outputs)
  plan = rewrite.plan(expansion.records, m, lambda c: "one_device")
  rewritten = rewrite.apply(expansion.graph_def, plan, {})
  xv, wv = tf.random.normal([6, 8]), tf.random.normal([8, 4])

  @tf.function(autograph=False)
  def run(xv, wv):
    return tf.graph_util.import_graph_def(
        rewritten.graph_def, input_map={inputs[0].name: xv, inputs[1].name: wv},
        return_elements=[rewritten.output_name(name) for name in expansion.outputs[0]])  # every device's

  outs = run(xv, wv)
  assert len(outs) == 4
  for out in outs:
    np.testing.assert_allclose(out.numpy(), fn(xv, wv).numpy(), rtol=1e-6, atol=1e-6)
  kinds = sorted((c.kind, c.axes) for c in plan.collectives)
  assert kinds == [("all_gather", ("model",)), ("all_reduce", ("batch",))]


def test_the_keras_mlp_step_is_covered():
  for op_type in ("MatMul", "BiasAdd", "BiasAddGrad", "Relu", "ReluGrad", "SparseSoftmaxCrossEntropyWithLogits",
                  "Sum", "Prod", "Reshape", "Tile", "ExpandDims", "IdentityN", "DivNoNan", "Pow", "Sqrt",
                  "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
    assert op_type in _base.covered()


def test_backward_pass_tiles_locally_what_consumers_want_split():
  def fn(s, b):  # the gradient of a mean: a scalar tiled over the batch, times a batch-split tensor
    return tf.expand_dims(tf.tile(tf.reshape(s, [1]), [6]), 1) * b

  graph = _graph(fn, tf.TensorSpec([]), tf.TensorSpec([6, 4]))
  s, b = graph.inputs
  part = _partition.propagate(graph, _mesh(), {s.name: (), b.name: (("batch",), ())})
  by_type = {graph.get_operation_by_name(n).type: d for n, d in part.decisions.items()}
  assert by_type["Tile"].outputs == [(("batch",),)]
  assert by_type["Tile"].consts[1].tolist() == [3]  # local multiples: no slice of a whole tensor
  assert by_type["ExpandDims"].outputs == [(("batch",), ())]
  assert by_type["Mul"].inputs == [(("batch",), ()), (("batch",), ())]


def test_global_stand_in_holds_no_value():
  from replicator.state import _global_handles  # pylint: disable=import-outside-toplevel
  v = _global_handles.global_variable(tf.TensorShape([1024, 1024]), tf.float32, "w", True)
  assert v.shape.as_list() == [1024, 1024]
  assert not bool(v.is_initialized())


def test_fallback_is_right_and_warns():
  repl = _global_repl(None)
  with repl.context():
    v = tf.Variable(2.0)
  x = np.arange(8.0, dtype="float32").reshape(4, 2)
  ds = tf.data.Dataset.from_tensor_slices(x).batch(4, drop_remainder=True)

  def step_fn(batch):
    return tf.reduce_sum(tf.reverse(batch, axis=[0])[0]) * v  # the last row first

  with pytest.warns(UserWarning, match=r"no layout rule for ReverseV2 .* at .*test_global_view.py"):
    out = repl.run(step_fn, ds)
  assert float(out) == float(x[-1].sum() * 2.0)


def test_explain_and_reduce_in_the_global_view():
  repl = _global_repl(LAYOUTS["hidden"])
  model, opt = _model_and_optimizer(repl.context(), "adam")
  step_fn = _make_step(model, opt)
  plan = repl.explain(step_fn, _dataset())
  assert len(plan.collectives) == 6 + 4  # and the sharded Adam update's four broadcasts
  loss = repl.run(step_fn, _dataset())
  assert repl.trace_count == 1  # explain built the step that run uses
  assert float(repl.reduce("mean", loss)) == float(loss)


def test_shape_queries_answer_with_global_shapes():
  repl = _global_repl(None)
  with repl.context():
    v = tf.Variable(1.0)
  ds = tf.data.Dataset.from_tensor_slices(np.ones([8, 3], "float32")).batch(8, drop_remainder=True)

  def step_fn(x):  # raw ops: tf.shape of a static shape would fold to a constant while tracing
    shape = tf.raw_ops.Shape(input=x, out_type=tf.int32)
    return tf.cast(shape, tf.float32) * v, tf.cast(tf.raw_ops.Size(input=x), tf.float32) * v

  shape, size = repl.run(step_fn, ds)
  assert shape.numpy().tolist() == [8.0, 3.0] and float(size) == 24.0


def test_unused_values_are_not_computed_or_communicated():
  repl = _global_repl(None)
  with repl.context():
    v = tf.Variable(2.0)
  ds = tf.data.Dataset.from_tensor_slices(np.arange(8.0, dtype="float32")).batch(8, drop_remainder=True)

  def step_fn(x):
    unused = tf.reduce_sum(x * v)  # a sum over the split batch: an all-reduce, were it kept
    del unused
    v.assign_add(1.0)  # an effect: kept
    return tf.reduce_max(x)  # over the split batch: one all-reduce (max)

  assert float(repl.run(step_fn, ds)) == 7.0
  step = _built(repl)
  assert [(c.kind, c.param_dict.get("op")) for c in step.plan.collectives] == [("all_reduce", "max")]
  assert float(v) == 3.0


def test_an_unruled_op_on_a_sharded_variable_is_refused_not_wrong():
  repl = _global_repl({r"table$": ("model", None)})
  with repl.context():
    table = tf.Variable(tf.reshape(tf.range(8.0), [4, 2]), name="table")
  ds = tf.data.Dataset.from_tensor_slices(np.array([0, 3, 1, 2], "int32")).batch(4, drop_remainder=True)

  def step_fn(ids):
    table.scatter_add(tf.IndexedSlices(tf.ones([4, 2]), ids))
    return tf.reduce_sum(table)

  with pytest.raises(replicator.UnsupportedError, match=r"cannot partition ResourceScatterAdd .* sharded variable"):
    repl.run(step_fn, ds)


@pytest.mark.parametrize("layout", [("model", None), (None, "model"), ("batch", "model")])
def test_gather_from_a_sharded_table_equals_numpy(layout):
  # tf.gather on a variable (ResourceGather): rows split (masked lookups, summed) or columns split.
  repl = _global_repl({r"table$": layout})
  values = np.arange(16.0, dtype="float32").reshape(8, 2) ** 1.5
  with repl.context():
    table = tf.Variable(values, name="table")
  ids = np.array([0, 7, 3, 3, 6, 1, 2, 5], "int32")
  ds = tf.data.Dataset.from_tensor_slices(ids).batch(8, drop_remainder=True)

  def step_fn(batch):
    with tf.GradientTape() as tape:
      rows = tf.gather(table, batch)
      loss = tf.reduce_sum(rows * rows)
    table.assign_sub(0.01 * tf.convert_to_tensor(tape.gradient(loss, table)))
    return rows

  rows = repl.run(step_fn, ds)
  np.testing.assert_allclose(rows.numpy(), values[ids], rtol=0, atol=0)
  grad = np.zeros_like(values)
  np.add.at(grad, ids, 2 * values[ids])
  np.testing.assert_allclose(np.asarray(table), values - 0.01 * grad, rtol=1e-6)


def test_run_view_overrides_the_replicator_s_view():
  repl = replicator.Replicator(devices=cpus(2))  # the local view by default
  with repl.context():
    w = tf.Variable([[1.0], [2.0]])
  x = np.arange(8.0, dtype="float32").reshape(4, 2)
  ds = tf.data.Dataset.from_tensor_slices(x).batch(4, drop_remainder=True)

  def step_fn(batch):  # a global mean over the global batch: no hand-written all-reduce
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.matmul(batch, w))
    w.assign_sub(0.1 * tape.gradient(loss, w))
    return loss

  loss = repl.run(step_fn, ds, view="global")
  assert float(loss) == float(np.mean(x @ [[1.0], [2.0]]))
  np.testing.assert_allclose(np.asarray(w.components[1]), [[1.0], [2.0]] - 0.1 * x.mean(0)[:, None], rtol=1e-6)


# -- errors a user can cause (pinned wording, never a hang) --------------------------------------

def test_a_layout_that_does_not_divide_a_dimension_is_refused():
  repl = _global_repl({r"w$": (None, "model")})
  with pytest.raises(mesh.LayoutError, match=r"dimension 1 has size 3, which is not divisible by 2, the size of mesh "
                                             r"axis 'model'. Fix: make dimension 1 a multiple of 2"):
    with repl.context():
      tf.Variable(np.ones([3, 3], "float32"), name="w")


def test_a_layout_naming_an_unknown_axis_is_refused():
  repl = _global_repl({r"w$": ("modle", None)})
  with pytest.raises(mesh.LayoutError, match=r"names mesh axis 'modle' .* but the mesh has axes \('batch', 'model'\)"):
    with repl.context():
      tf.Variable(np.ones([4, 3], "float32"), name="w")


def test_a_step_that_changes_a_sharded_variable_s_shape_is_refused():
  repl = _global_repl({r"w$": ("model", None)})
  with repl.context():
    w = tf.Variable(np.ones([4, 3], "float32"), name="w")
  ds = tf.data.Dataset.from_tensor_slices(np.ones([4, 3], "float32")).batch(4, drop_remainder=True)
  with pytest.raises(replicator.ArgumentError, match=r"step_fn assigns a value of shape \(2, 3\) to the variable 'w' "
                                                     r"of global shape \(4, 3\): in the global view every variable"):
    repl.run(lambda x: w.assign(x[:2]), ds)
  with pytest.raises(replicator.VariableCreationError, match=r"matches a layout .* but was made with shape=<unknown>"):
    with repl.context():
      tf.Variable(np.ones([4, 3], "float32"), name="w", shape=tf.TensorShape(None))


def test_keras_distribution_mesh_and_layout_map_carry_over():
  # Code written for Keras 3's distribution API: its DeviceMesh and LayoutMap, unchanged.
  device_mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=cpus(4))
  layout_map = keras.distribution.LayoutMap(device_mesh)
  layout_map[r".*ff_in/kernel"] = (None, "model")  # matched as Keras matches: the whole path (re.fullmatch)
  layout_map[r".*ff_in/bias"] = keras.distribution.TensorLayout(("model",))
  layout_map[r".*ff_out/kernel"] = ("model",)  # shorter than the kernel's rank: padded with None, as Keras-JAX does
  converted = replicator.Replicator(mesh=device_mesh, layouts=layout_map, view="global").layouts
  assert converted.lookup("sequential/ff_in/kernel") == (None, "model")
  assert converted.spec_for(converted.lookup("sequential/ff_out/kernel"), 2) == ("model", None)
  keras_style = keras.distribution.LayoutMap(device_mesh)
  keras_style["ff_in/kernel"] = (None, "model")  # Keras 3.15 does not match it to sequential/ff_in/kernel: nor do we
  assert keras_style["sequential/ff_in/kernel"] is None
  assert replicator.Replicator(mesh=device_mesh, layouts=keras_style).layouts.lookup("sequential/ff_in/kernel") is None
  repl = replicator.Replicator(mesh=device_mesh, layouts=layout_map, batch_axes=("batch",), view="global")
  assert repl.mesh.shape == {"batch": 2, "model": 2}
  assert list(repl.mesh.devices) == [f"/device:CPU:{i}" for i in range(4)]
  one_model, one_opt = _model_and_optimizer(contextlib.nullcontext(), "adam")
  one_step = tf.function(_make_step(one_model, one_opt))
  expected = [float(one_step(batch)) for batch in _dataset()]
  model, opt = _model_and_optimizer(repl.context(), "adam")
  step_fn = _make_step(model, opt)
  dataset = _dataset()
  losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  assert [c.shape.as_list() for c in model.layers[0].kernel.value.components] == [[8, 8]] * 4
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)


def test_a_split_gradient_of_a_replicated_variable_is_gathered_once_for_adam():
  # s is replicated, its gradient comes out split over "model": Adam's two slot updates (and the variable's)
  # share one all_gather of the gradient, instead of gathering each update.
  repl = _global_repl({r"w$": (None, "model")})
  rng = np.random.default_rng(0)
  w0, s0 = rng.normal(size=[3, 4]).astype("float32"), rng.normal(size=[4]).astype("float32")
  x = rng.normal(size=[8, 3]).astype("float32")
  with repl.context():
    w, s = tf.Variable(w0, name="w"), tf.Variable(s0, name="s")
    opt = keras.optimizers.Adam(0.1)
    opt.build([w, s])
  one_w, one_s, one_opt = tf.Variable(w0), tf.Variable(s0), keras.optimizers.Adam(0.1)

  def make_step(w, s, opt):
    def step_fn(batch):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(tf.matmul(batch, w) * s))
      opt.apply_gradients(zip(tape.gradient(loss, [w, s]), [w, s]))
      return loss
    return step_fn

  step_fn = make_step(w, s, opt)
  plan = repl.explain(step_fn, tf.data.Dataset.from_tensors(x))
  gathers = [c for c in plan.collectives if c.kind == "all_gather"]
  assert [c.shape.as_list() for c in gathers] == [[2]]  # one gather of each device's half of the gradient
  repl.run(step_fn, tf.data.Dataset.from_tensors(x))
  tf.function(make_step(one_w, one_s, one_opt))(tf.constant(x))
  assert_every_copy([w, s] + opt.variables, [one_w, one_s] + one_opt.variables, atol=1e-6)


def test_steps_runs_several_global_steps_in_one_call():
  _, (one_model, one_opt, expected), _, _ = _train(LAYOUTS["hidden"])
  repl = _global_repl(LAYOUTS["hidden"])
  model, opt = _model_and_optimizer(repl.context(), "adam")
  step_fn = _make_step(model, opt)
  dataset = _dataset()
  loss = repl.run(step_fn, dataset, steps=2)  # batches 0 and 1: the second loss
  assert repl.steps_run == 2
  np.testing.assert_allclose(float(loss), expected[1], rtol=0, atol=1e-6)
  loss = repl.run(step_fn, dataset, steps=5)  # one batch left: stops at the end of the dataset
  assert repl.steps_run == 1
  np.testing.assert_allclose(float(loss), expected[2], rtol=0, atol=1e-6)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)
  with pytest.raises(replicator.EndOfInput):
    repl.run(step_fn, dataset, steps=2)
  with pytest.raises(replicator.ArgumentError, match="loops over global batches of one static shape"):
    repl.run(step_fn, _dataset().unbatch().batch(BATCH), steps=2)


def test_all_steps_stacks_every_step_of_the_call():
  _, (one_model, one_opt, expected), _, _ = _train(LAYOUTS["hidden"])
  repl = _global_repl(LAYOUTS["hidden"])
  model, opt = _model_and_optimizer(repl.context(), "adam")
  dataset = _dataset()

  def step_fn(batch):  # a nest of outputs: the loss and the step's batch size
    return {"loss": _make_step(model, opt)(batch), "n": tf.shape(batch[0])[0]}

  out = repl.run(step_fn, dataset, steps=2, all_steps=True)
  assert repl.steps_run == 2 and out["loss"].shape == [2] and out["n"].numpy().tolist() == [BATCH, BATCH]
  np.testing.assert_allclose(out["loss"].numpy(), expected[:2], rtol=0, atol=1e-6)
  out = repl.run(step_fn, dataset, steps=4, all_steps=True)  # one batch left: one entry
  assert repl.steps_run == 1 and out["loss"].shape == [1]
  np.testing.assert_allclose(out["loss"].numpy(), expected[2:], rtol=0, atol=1e-6)
  assert_every_copy(model.variables + opt.variables, one_model.variables + one_opt.variables)
  dataset = _dataset()
  out = repl.run(step_fn, dataset, all_steps=True)  # steps=1: one entry too
  assert out["loss"].shape == [1]


class _Trainer:
  """A research habit: the step is a bound method, its forward pass a ``tf.function`` helper."""

  def __init__(self, model, opt):
    self.model, self.opt = model, opt
    self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def loss(self, x, y):
    return self.loss_fn(y, self.model(x, training=True))

  def step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.loss(x, y)
    grads = tape.gradient(loss, self.model.trainable_variables)
    self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
    return loss


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_trainer_method_with_a_tf_function_helper_equals_one_device(layout):
  # The helper is traced into the step (not a call op the layout rules cannot see into).
  one = _Trainer(*_model_and_optimizer(contextlib.nullcontext(), "adam"))
  one_step = tf.function(one.step)
  expected = [float(one_step(batch)) for batch in _dataset()]
  repl = _global_repl(LAYOUTS[layout])
  trainer = _Trainer(*_model_and_optimizer(repl.context(), "adam"))
  dataset = _dataset()
  losses = [float(repl.run(trainer.step, dataset)) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-6)
  assert_every_copy(trainer.model.variables + trainer.opt.variables, one.model.variables + one.opt.variables)
  step = _built(repl)
  assert not step.partition.fallbacks
  assert tf.config.functions_run_eagerly() is False  # restored after the trace


def test_a_reduction_of_a_tensor_of_unknown_rank_runs_whole():
  # (Was a TypeError in the rule: found in a gradient's loop of a loop in a loop, whose sums' ranks are unknown.)
  graph = _graph(lambda a, shape: tf.reduce_sum(tf.reshape(a, shape), axis=0), tf.TensorSpec([6, 4]),
                 tf.TensorSpec([None], tf.int32))
  a, _ = graph.inputs
  part = _partition.propagate(graph, _mesh(), {a.name: (("batch",), ())})
  (decision,) = [d for name, d in part.decisions.items() if graph.get_operation_by_name(name).type == "Sum"]
  assert decision.outputs == [None] and not decision.reduce[0]
