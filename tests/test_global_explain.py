"""What ``repl.explain`` reports in the global view (``rewrite.PartitionReport``), and ``strict=True``."""

import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator
import rewrite
from rewrite import _expansion
from rewrite import _partition
from rewrite import _partition_report

HIDDEN = {r"ff_in/kernel$": (None, "model"), r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)}
BATCH = 12


def _line(marker: str) -> int:
  """The line of this file that holds ``marker`` (once)."""
  with open(__file__, encoding="utf-8") as f:
    (line,) = [i for i, text in enumerate(f, 1) if marker in text and "_line(" not in text]
  return line


def _repl(layouts, strict=False, update="replicated"):
  # The tables below pin the partition's collectives; the sharded update's broadcasts have their own test.
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  return replicator.Replicator(mesh=m, layouts=None if layouts is None else mesh.LayoutMap(layouts),
                               batch_axes=("batch",), view="global", strict=strict, update=update)


def _mlp_step(repl):
  with repl.context():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu", name="ff_in"),
                              keras.layers.Dense(4, name="ff_out")])
    opt = keras.optimizers.Adam(1e-2)
    opt.build(model.trainable_variables)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))  # the forward line
    grads = tape.gradient(loss, model.trainable_variables)  # the gradients line
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step_fn


def _dataset():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2 * BATCH, 8)).astype("float32")
  y = rng.integers(0, 4, size=2 * BATCH).astype("int32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def _row(rows, pattern):
  (row,) = [r for r in rows if re.search(pattern, r.name)]
  return row


def test_mlp_variables_and_inputs_show_layouts_and_bytes_per_device():
  repl = _repl(HIDDEN)
  report = repl.explain(_mlp_step(repl), _dataset())
  assert isinstance(report, rewrite.PartitionReport)
  kernel = _row(report.variables, r"ff_in/kernel$")
  assert (kernel.shape, kernel.dtype, kernel.layout) == ((8, 16), "float32", ((), ("model",)))
  assert kernel.bytes_per_device == 8 * 8 * 4  # half of the hidden dimension per device
  for slot in ("momentum", "velocity"):  # Adam's slots take their variable's layout
    row = _row(report.variables, rf"ff_in_kernel_{slot}$")
    assert (row.shape, row.layout, row.bytes_per_device) == ((8, 16), ((), ("model",)), 256)
    row = _row(report.variables, rf"ff_out_kernel_{slot}$")
    assert (row.shape, row.layout, row.bytes_per_device) == ((16, 4), (("model",), ()), 8 * 4 * 4)
  assert _row(report.variables, r"ff_in/bias$").bytes_per_device == 8 * 4
  assert _row(report.variables, r"ff_out/bias$").layout == ((),)  # replicated: whole on every device
  assert _row(report.variables, r"ff_out/bias$").bytes_per_device == 4 * 4
  assert _row(report.variables, r"iteration$").dtype == "int64"
  assert len(report.variables) == 4 + 2 + 8  # weights, Adam's iteration and learning rate, 8 slots
  assert [(r.name, r.shape, r.dtype, r.layout, r.bytes_per_device) for r in report.inputs] == [
      ("input[0]", (BATCH, 8), "float32", (("batch",), ()), BATCH // 2 * 8 * 4),
      ("input[1]", (BATCH,), "int32", (("batch",),), BATCH // 2 * 4)]
  # What chose each layout: the layouts key that matched, a slot's variable, or no key (replicated).
  assert _row(report.variables, r"ff_in/kernel$").chosen_by == "key 'ff_in/kernel$'"
  assert re.fullmatch(r"as sequential\w*/ff_in/kernel \(a slot\)", _row(report.variables, r"ff_in_kernel_momentum$").chosen_by)
  assert _row(report.variables, r"ff_out/bias$").chosen_by == "no key matched"
  text = str(report)
  assert re.search(r"\n  sequential\w*/ff_in/kernel +\[8,16\] +float32 +\[-, model\] +256 +key 'ff_in/kernel\$'\n", text)
  assert re.search(r"\n  sequential\w*/ff_out/bias +\[4\] +float32 +\[-\] +16 +no key matched\n", text)
  assert re.search(r"\n  input\[0\] +\[12,8\] +float32 +\[batch, -\] +192\n", text)


def test_mlp_collectives_name_the_op_and_the_line_that_required_them():
  repl = _repl(HIDDEN)
  report = repl.explain(_mlp_step(repl), _dataset())
  rows = report.collective_rows
  assert [r.index for r in rows] == list(range(6))  # call order
  logits = rows[0]
  assert (logits.kind, logits.op, logits.axes, logits.shape) == ("all_reduce", "sum", ("model",), (BATCH // 2, 4))
  assert logits.op_type == "MatMul" and re.search(r"ff_out\w*/MatMul$", logits.op_name)
  assert logits.why == "partial sum"
  assert (logits.bytes_per_device, logits.bytes_per_step) == (6 * 4 * 4, 4 * 6 * 4 * 4)
  assert logits.location.endswith(f"test_global_explain.py:{_line('# the forward line')} in step_fn")
  kernel_grad = rows[5]  # the first kernel's gradient: summed over the batch, half of it per device
  assert (kernel_grad.op_type, kernel_grad.axes, kernel_grad.shape) == ("MatMul", ("batch",), (8, 8))
  assert kernel_grad.location.endswith(f"test_global_explain.py:{_line('# the gradients line')} in step_fn")
  # Bytes per step: every device's input to every collective.
  assert report.bytes_per_step == sum(b for c in report.plan.collectives for b in c.member_nbytes)
  assert report.bytes_per_step == sum(r.bytes_per_step for r in rows) == 4 * (96 + 4 + 16 + 128 + 32 + 256)
  by_type = {t.op_type: t for t in report.by_op_type()}
  assert by_type["MatMul"].counts == (("all_reduce", 3),)
  assert by_type["MatMul"].bytes_per_step == 4 * (96 + 128 + 256)
  assert by_type["BiasAddGrad"].counts == (("all_reduce", 2),)
  assert report.by_op_type()[0].op_type == "MatMul"  # most bytes first
  assert not report.fallbacks and all(r.free for r in report.relayouts)
  text = str(report)
  assert "6 collective(s), 2,128 bytes/step" in text
  assert re.search(r"\n  0  all_reduce\(sum\)  model  \[6,4\]  96  +384  +MatMul \S+ff_out\S*/MatMul +partial sum "
                   r"+\S+test_global_explain.py:\d+ in step_fn\n", text)
  assert re.search(r"\n  MatMul +3 all_reduce +1,920\n", text)


def test_report_keeps_the_plan_s_interface():
  repl = _repl(HIDDEN)
  report = repl.explain(_mlp_step(repl), _dataset())
  assert isinstance(report.plan, rewrite.Plan)
  assert report.collectives == report.plan.collectives and len(report.collectives) == 6
  assert report.bytes_per_step == report.plan.bytes_per_step == 2128
  assert report.devices == repl.devices and report.num_replicas == 4
  summary = json.loads(json.dumps(report.summary()))  # JSON-able as it is
  assert summary["bytes_per_step"] == 2128 and summary["mesh"] == {"batch": 2, "model": 2}
  assert len(summary["collectives"]) == 6 and summary["collectives"][0]["op_type"] == "MatMul"
  kernel = [v for v in summary["variables"] if v["name"].endswith("ff_in/kernel")][0]
  assert kernel["layout"] == [[], ["model"]] and kernel["bytes_per_device"] == 256
  assert summary["by_op_type"][0] == {"op_type": "MatMul", "counts": {"all_reduce": 3}, "bytes_per_step": 1920}


def test_a_reverse_of_the_batch_is_a_fallback_with_a_gathered_input():
  repl = _repl(None)
  with repl.context():
    v = tf.Variable(2.0)
  x = np.arange(8.0, dtype="float32").reshape(4, 2)
  ds = tf.data.Dataset.from_tensor_slices(x).batch(4, drop_remainder=True)

  def step_fn(batch):
    return tf.reduce_sum(tf.reverse(batch, axis=[0])[0]) * v  # the reverse line

  with pytest.warns(UserWarning, match=r"no layout rule for ReverseV2"):
    report = repl.explain(step_fn, ds)
  where = f"test_global_explain.py:{_line('# the reverse line')} in step_fn"
  (fallback,) = report.fallbacks
  assert fallback.op_type == "ReverseV2" and fallback.location.endswith(where)
  assert fallback.input_layouts[0] == (("batch",), ())
  (gathered,) = [r for r in report.relayouts if r.op_type == "ReverseV2"]
  assert (gathered.source, gathered.target, gathered.input) == ((("batch",), ()), ((), ()), 0)
  assert gathered.gathered == ((0, ("batch",)),) and not gathered.free
  (gather,) = [r for r in report.collective_rows if r.kind == "all_gather"]
  assert (gather.op_type, gather.axes, gather.shape) == ("ReverseV2", ("batch",), (2, 2))
  assert gather.why == f"gather {gathered.tensor} dim 0 (input 0)" and gather.location.endswith(where)
  text = str(report)
  assert re.search(r"\[batch, -\] +\[-, -\] +all_gather dim 0 over batch +ReverseV2 \S+ input 0 ", text)
  assert re.search(r"\n  ReverseV2 \S+ +\[batch, -\], \[-\] +\S+" + re.escape(where), text)


def test_relayouts_say_which_slice_for_free_and_which_gather():
  repl = _repl({r"w1$": (None, "model")})
  with repl.context():
    w1 = tf.Variable(tf.reshape(tf.range(8.0), [2, 4]), name="w1")
    c = tf.Variable(tf.fill([4, 2], 3.0), name="c")  # replicated: each device slices its batch rows
  x = np.arange(8.0, dtype="float32").reshape(4, 2)
  ds = tf.data.Dataset.from_tensor_slices(x).batch(4, drop_remainder=True)

  def step_fn(batch):
    h = tf.matmul(batch * c, w1)  # the matmul line: a model-split activation
    return tf.reverse(h, axis=[1])  # no rule: h gathered whole

  with pytest.warns(UserWarning, match=r"no layout rule for ReverseV2"):
    report = repl.explain(step_fn, ds)
    out = repl.run(step_fn, ds)
  np.testing.assert_allclose(out.numpy(), ((x * 3.0) @ np.arange(8.0).reshape(2, 4))[:, ::-1])
  (free,) = [r for r in report.relayouts if r.free]
  assert (free.op_type, free.input, free.source, free.target) == ("Mul", 1, ((), ()), (("batch",), ()))
  assert free.location.endswith(f"test_global_explain.py:{_line('# the matmul line')} in step_fn")
  (gathered,) = [r for r in report.relayouts if not r.free]
  assert (gathered.op_type, gathered.source, gathered.target) == ("ReverseV2", (("batch",), ("model",)), ((), ()))
  assert gathered.gathered == ((0, ("batch",)), (1, ("model",)))  # one all_gather per split dimension
  assert [(r.kind, r.axes, r.shape, r.why) for r in report.collective_rows] == [
      ("all_gather", ("batch",), (2, 2), f"gather {gathered.tensor} dim 0 (input 0)"),
      ("all_gather", ("model",), (4, 2), f"gather {gathered.tensor} dim 1 (input 0)")]
  assert [r.name for r in report.variables] == ["c", "w1"]
  assert [r.bytes_per_device for r in report.variables] == [4 * 2 * 4, 2 * 2 * 4]
  text = str(report)
  assert re.search(r"\[-, -\] +\[batch, -\] +free \(local slice\) +Mul \S+ input 1 ", text)
  assert "Relayouts (2, 1 communicating):" in text


STRICT_MESSAGE = (
    "Replicator(strict=True): the global view has no layout rule for 1 op(s) whose inputs are split; each "
    "would gather its inputs and run on whole values on every device:\n"
    "  ReverseV2 (ReverseV2, at {where}): input layouts [batch, -], [-]\n"
    "Fix: add a layout rule for the op type (rewrite/rules/_*.py), keep the op's inputs replicated (leave the "
    "variables they come from out of the layouts), or pass Replicator(strict=False) to run it on gathered "
    "inputs, with a warning.")


def test_strict_refuses_a_fallback_naming_the_op_its_layouts_and_the_line():
  repl = _repl(None, strict=True)
  ds = tf.data.Dataset.from_tensor_slices(np.ones([4, 2], "float32")).batch(4, drop_remainder=True)

  def step_fn(batch):
    return tf.reverse(batch, axis=[0])  # the strict line

  where = f"{__file__}:{_line('# the strict line')} in step_fn"
  for call in (repl.explain, repl.run):  # refused when the step is built, each time
    with pytest.raises(replicator.UnsupportedError) as raised:
      call(step_fn, ds)
    assert str(raised.value) == STRICT_MESSAGE.format(where=where)


def test_strict_accepts_the_mlp():
  repl = _repl(HIDDEN, strict=True)
  step_fn = _mlp_step(repl)
  report = repl.explain(step_fn, _dataset())
  assert not report.fallbacks
  assert np.isfinite(float(repl.run(step_fn, _dataset())))


def test_report_of_a_partition_without_keras():
  # rewrite alone: a global graph, its partition, the expanded plan and labels.
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  specs = (tf.TensorSpec([6, 8]), tf.TensorSpec([8, 4]))
  graph = tf.function(lambda x, w: tf.reduce_sum(tf.nn.relu(tf.matmul(x, w)), axis=0),
                      autograph=False).get_concrete_function(*specs).graph
  x, w = graph.inputs
  given = {x.name: (("batch",), ()), w.name: ((), ("model",))}
  part = _partition.propagate(graph, m, given)
  with tf.Graph().as_default():
    inputs = [tf.raw_ops.Placeholder(dtype=s.dtype, shape=s.shape) for s in specs]
    local = {p.name: [_expansion.local_piece(v, given[p.name], m, r) for r in range(4)] for p, v in zip((x, w), inputs)}
    expansion = _expansion.expand(graph, m, part, local, graph.outputs)
  plan = rewrite.plan(expansion.records, m, lambda c: "one_device")
  report = rewrite.PartitionReport.from_partition(graph, part, plan, m.shape, inputs={x.name: "x", w.name: "w"},
                                                  variables={}, outputs=graph.outputs)
  assert [(r.name, r.layout, r.bytes_per_device) for r in report.inputs] == [
      ("x", (("batch",), ()), 3 * 8 * 4), ("w", ((), ("model",)), 8 * 2 * 4)]
  reduce, gather = report.collective_rows  # the sum over the batch, then the output returned whole
  assert (reduce.kind, reduce.op_type, reduce.axes, reduce.why) == ("all_reduce", "Sum", ("batch",), "partial sum")
  (output,) = report.relayouts
  assert (output.op_type, output.op_name, output.source, output.target) == ("return", "output 0", (("model",),), ((),))
  assert (gather.kind, gather.axes, gather.why) == ("all_gather", ("model",), f"gather {output.tensor} dim 0 to return it")
  assert _partition_report.format_layout((("batch", "model"), (), ("model",))) == "[(batch,model), -, model]"
  assert _partition_report.format_layout(None) == "?"


def test_a_tensor_relayouted_for_several_consumers_is_gathered_once():
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap({r"w$": (None, "model")}), batch_axes=("batch",),
                               view="global")
  with repl.context():
    w = tf.Variable(np.arange(12.0, dtype="float32").reshape(3, 4), name="w")
  x = np.arange(24.0, dtype="float32").reshape(8, 3)
  ds = tf.data.Dataset.from_tensors(x)

  def step_fn(batch):
    h = tf.matmul(batch, w)  # [batch, model]
    return tf.reverse(h, axis=[0]) + tf.reverse(h, axis=[1])  # two unruled consumers want h whole

  with pytest.warns(UserWarning, match="no layout rule"):
    report = repl.explain(step_fn, ds)
  gathers = [c for c in report.collectives if c.kind == "all_gather" and c.members[0].call.startswith("ReverseV2")]
  assert len(gathers) == 2  # h gathered over "model" and "batch" once, for both consumers
  assert sum(not r.free for r in report.relayouts if r.op_type == "ReverseV2") == 1
  out = repl.run(step_fn, ds)  # the step explain built (it warned then)
  h = x @ np.asarray(w)
  np.testing.assert_allclose(out.numpy(), h[::-1] + h[:, ::-1], rtol=1e-6)
