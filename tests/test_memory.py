"""rewrite._memory: saved-for-backward tensors and the peak of live bytes, on graphs built by hand.

Every figure is derived by hand in the test's comments: float32 [10, 10]
tensors of 400 bytes, in the order the liveness pass assumes.
"""

import json

import pytest
import tensorflow as tf

from rewrite import _memory

CPU0, CPU1 = "/device:CPU:0", "/device:CPU:1"


def _mlp_graph():
  """x @ w, relu, sum; the backward under gradient_tape/: OnesLike, ReluGrad and the two products."""
  g = tf.Graph()
  with g.as_default(), tf.device(CPU0):
    x = tf.compat.v1.placeholder(tf.float32, [10, 10], name="x")                      # 0: 400
    handle = tf.compat.v1.placeholder(tf.resource, [], name="w")                      # 1: a variable's handle
    w = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32, name="read")     # 2: the variable's buffer
    h = tf.matmul(x, w, name="h")                                                     # 3: 400
    r = tf.nn.relu(h, name="r")                                                       # 4: into h's buffer
    loss = tf.reduce_sum(r, axis=[0, 1], name="loss")                                 # 5: 4 (its axes: a Const)
    with tf.name_scope("gradient_tape"):
      g0 = tf.raw_ops.OnesLike(x=r, name="g0")                                        # 400
      g1 = tf.raw_ops.ReluGrad(gradients=g0, features=r, name="g1")                   # into g0's buffer
      tf.matmul(x, g1, transpose_a=True, name="gw")                                   # 400
      tf.matmul(g1, w, transpose_b=True, name="gx")                                   # 400
  return g, loss


def _analyze(graph, **kwargs):
  kwargs.setdefault("variable_shapes", {"w:0": [10, 10]})
  kwargs.setdefault("outputs", ["gradient_tape/gw:0", "gradient_tape/gx:0", "loss:0"])
  return _memory.analyze(graph.as_graph_def(), **kwargs)


def test_saved_for_backward_by_hand():
  graph, _ = _mlp_graph()
  report = _analyze(graph, base_bytes={CPU0: 1000})
  saved = {s.tensor: s for s in report.saved}
  # x (read by gw), the variable's read (by gx) and r (by OnesLike and ReluGrad); h only by the forward Relu.
  assert set(saved) == {"x:0", "read:0", "r:0"}
  assert (saved["x:0"].kind, saved["x:0"].bytes, saved["x:0"].readers) == ("input", 400, 1)
  assert (saved["read:0"].kind, saved["read:0"].bytes, saved["read:0"].shape) == ("variable read", 0, (10, 10))
  assert (saved["r:0"].kind, saved["r:0"].bytes, saved["r:0"].readers, saved["r:0"].op_type) == (
      "activation", 400, 2, "Relu")
  assert report.device().saved_bytes == 800


def test_peak_by_hand():
  graph, _ = _mlp_graph()
  report = _analyze(graph, base_bytes={CPU0: 1000})
  # In order: x 400; h +400 (800); r writes into h's buffer; loss +4 (804); g0 +400 (1204, the peak); g1 into
  # g0's buffer, r's buffer freed (804); gw +400, x freed (804); gx +400 (1204 again, not above).
  device = report.device(CPU0)
  assert (device.variable_bytes, device.step_peak_bytes, device.peak_bytes) == (1000, 1204, 2204)
  assert device.peak_op == "gradient_tape/g0"
  assert {t.tensor: t.bytes for t in device.live_at_peak} == {"x:0": 400, "h:0": 400, "gradient_tape/g0:0": 400,
                                                              "loss:0": 4}
  assert [t.tensor for t in device.live_at_peak][-1] == "loss:0"  # largest first


def test_peak_without_forwarding_by_hand():
  graph, _ = _mlp_graph()
  report = _analyze(graph, forwarding=False)
  # r +400 and h freed (800); loss 804; g0 1204; g1 +400 (1604, the peak) with r and g0 still read by it.
  assert (report.device().step_peak_bytes, report.device().peak_op) == (1604, "gradient_tape/g1")


def test_a_view_extends_its_buffer():
  g = tf.Graph()
  with g.as_default(), tf.device(CPU0):
    x = tf.compat.v1.placeholder(tf.float32, [10, 10], name="x")
    a = tf.raw_ops.Exp(x=x, name="a")                      # 400 (x, the input, is never written into)
    v = tf.reshape(a, [10, 10], name="v")                  # a view of a: a lives as long as v
    b = tf.raw_ops.Neg(x=x, name="b")                      # 400
    c = tf.raw_ops.Exp(x=b, name="c")                      # into b's buffer
    tf.raw_ops.AddV2(x=c, y=v, name="d")                   # into c's (b's) buffer
  # x 400, a 800, b 1200 (the peak; x freed after it), c and d in b's buffer: 800; a lives until d reads v.
  device = _memory.analyze(g.as_graph_def(), outputs=["d:0"]).device()
  assert (device.step_peak_bytes, device.peak_op) == (1200, "b")
  assert {t.tensor for t in device.live_at_peak} == {"x:0", "a:0", "b:0"}


def test_shape_readers_and_constants_are_not_saved():
  g = tf.Graph()
  with g.as_default(), tf.device(CPU0):
    x = tf.compat.v1.placeholder(tf.float32, [10, 10], name="x")
    y = tf.raw_ops.Neg(x=x, name="y")
    k = tf.constant(2.0, name="k")
    with tf.name_scope("gradients"):
      tf.raw_ops.Shape(input=y, name="s")
      tf.raw_ops.Mul(x=k, y=k, name="m")
  report = _memory.analyze(g.as_graph_def())
  assert report.saved == [] and report.device().saved_bytes == 0


@pytest.mark.parametrize("kind, expected", [("created", [0, 1, 2, 3, 4]), ("ready", [0, 1, 3, 2, 4]),
                                            ("dataflow", [0, 1, 2, 3, 4])])
def test_orders(kind, expected):
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [10, 10], name="x")   # 0
    a = tf.raw_ops.Neg(x=x, name="a")                              # 1
    b = tf.raw_ops.Neg(x=a, name="b")                              # 2
    c = tf.raw_ops.Neg(x=x, name="c")                              # 3
    tf.raw_ops.AddV2(x=b, y=c, name="d")                           # 4
  # ready: a and c are ready together after x, before b (ready after a); dataflow: b, ready last, before c.
  assert _memory.topological_order(g.as_graph_def(), kind) == expected


def test_an_unknown_order_is_refused():
  with pytest.raises(ValueError, match="order 'fastest'"):
    _memory.topological_order(tf.Graph().as_graph_def(), "fastest")


def test_per_device_and_unplaced_nodes():
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [10, 10], name="x")  # unplaced: with its first reader, on CPU:0
    with tf.device(CPU0):
      a = tf.raw_ops.Exp(x=x, name="a")
    with tf.device(CPU1):
      b = tf.raw_ops.Exp(x=a, name="b")                           # 400 on CPU:1 (not into a's buffer: CPU:0's)
      tf.raw_ops.Exp(x=b, name="c")                               # into b's buffer
  report = _memory.analyze(g.as_graph_def(), base_bytes={CPU0: 10, CPU1: 20}, outputs=["c:0"])
  # CPU:0 holds x and a (800) until b reads a; CPU:1 holds b, then c in its buffer (400).
  assert [d.device for d in report.devices] == [CPU0, CPU1]
  assert [(d.variable_bytes, d.step_peak_bytes) for d in report.devices] == [(10, 800), (20, 400)]
  assert report.peak_bytes == 810 and report.total_peak_bytes == 1230


def test_unknown_sizes_are_counted_and_reported():
  g = tf.Graph()
  with g.as_default(), tf.device(CPU0):
    x = tf.compat.v1.placeholder(tf.float32, [None, 10], name="x")
    tf.raw_ops.Exp(x=x, name="a")
  device = _memory.analyze(g.as_graph_def()).device()
  assert device.unknown == 2 and device.step_peak_bytes == 0


def test_is_backward():
  assert _memory.is_backward("gradient_tape/dense/MatMul")
  assert _memory.is_backward("replica_0/gradient_tape_1/Relu/ReluGrad")
  assert _memory.is_backward("expand/replica_1/gradients/AddN")
  assert not _memory.is_backward("gradient_tape")  # an op named so, not in the scope
  assert not _memory.is_backward("replica_0/adam/gradient_norm/Sqrt")


def test_printed_and_summary():
  graph, _ = _mlp_graph()
  report = _analyze(graph, base_bytes={CPU0: 1000}, view="local", notes=("a note",),
                    describe=lambda node: f"here.py:1 ({node})", layout_of=lambda t: "[batch, -]")
  text = str(report)
  assert text.startswith("Memory per device (local view): 1 device(s), peak 2,204 bytes")
  for part in ("Saved for backward on /device:CPU:0 (3 tensor(s), 800 bytes", "variable read", "[batch, -]",
               "Live at the peak on /device:CPU:0 (1,204 bytes", "here.py:1 (gradient_tape/g0)",
               "Order assumed: ops run one at a time as their inputs become ready", "Note: a note"):
    assert part in text, part
  summary = json.loads(json.dumps(report.summary()))
  assert summary["devices"][0]["step_peak_bytes"] == 1204 and len(summary["saved"]) == 3
  with pytest.raises(KeyError, match="no device 'GPU:0'"):
    report.device("GPU:0")
  assert report.device("CPU:0") is report.devices[0]
