"""rewrite._deferred: collectives for the backward pass alone, and the forward pass's random draws, made late.

References: TensorFlow's executor order as the memory report assumes it
(ops run as their inputs become ready), the gathered kernels counted by hand,
and one device's training for the values.
"""

import keras
import numpy as np
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus

import mesh
import replicator
import rewrite
from rewrite import _deferred

B, H, LAYERS = 256, 256, 6


def _mlp(context):
  with context:
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((H,))] + [keras.layers.Dense(H, activation="relu")
                                                    for _ in range(LAYERS - 1)] + [keras.layers.Dense(H)])
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)  # (Adam turns float noise in near-zero gradients into lr)

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return model, optimizer, step


def _data():
  rng = np.random.default_rng(0)
  return tf.data.Dataset.from_tensors((rng.normal(size=(B, H)).astype("float32"),
                                       rng.normal(size=(B, H)).astype("float32"))).repeat()


def test_fsdp_gathers_each_kernel_again_for_the_backward_pass_as_it_nears_it():
  layouts = mesh.LayoutMap({"kernel": ("batch", None), "bias": ("batch",)})
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 4}, devices=cpus(4)), layouts=layouts, view="global")
  model, optimizer, step = _mlp(repl.context())
  plan = repl.explain(step, _data())
  kernel = H * H * 4
  # The backward pass's gradients of the activations read every kernel but the first whole: gathered for them
  # (the forward products run on the row-split kernels and gather none); and each ReLU's gradient reads its
  # saved output split by rows, not features (an all-to-all). Each reads its input through a waiting Identity.
  deferred = [c for c in plan.plan.collectives if c.members[0].input.startswith(f"{_deferred.DEFERRED}/")]
  kinds = [(c.kind, c.members[0].call.split(" ")[0]) for c in deferred]
  assert kinds == [("all_gather", "MatMul"), ("all_to_all", "ReluGrad")] * (LAYERS - 2) + [("all_gather", "MatMul")] \
      or sorted(kinds) == sorted([("all_gather", "MatMul")] * (LAYERS - 1) + [("all_to_all", "ReluGrad")] * (LAYERS - 1))
  assert all(c.shape.num_elements() * 4 * 4 == kernel for c in deferred if c.kind == "all_gather")  # (a piece in)
  for device in plan.memory.devices:  # was: all five gathered kernels live at the forward pass's peak
    live = [t for t in device.live_at_peak if t.bytes == kernel and "all_gather" in t.tensor]
    assert len(live) <= 2, (device.device, device.peak_op, live)
  one_model, one_optimizer, one_step = _mlp(tf.device(cpus(4)[0]))
  one_step = tf.function(one_step)
  batch = next(iter(_data()))
  for _ in range(3):
    repl.run(step, _data())
    one_step(batch)
  assert_every_copy(model.variables + optimizer.variables, one_model.variables + one_optimizer.variables, atol=1e-6)


def _draws():
  """A forward pass of four blocks: a product, and a mask drawn by a stateless op selecting from it."""

  @tf.function
  def forward(x, w):
    h = x
    for i in range(4):
      with tf.name_scope(f"block{i}"):
        h = tf.matmul(h, w)
        keep = tf.random.stateless_uniform(tf.shape(h), seed=[3, i]) > 0.5
        h = tf.where(keep, h, 0.)
    return tf.reduce_sum(h)

  return forward.get_concrete_function(tf.zeros([B, H]), tf.zeros([H, H])).graph


def test_a_draw_waits_for_the_activation_it_masks():
  graph = _draws()
  graph_def = graph.as_graph_def()
  deferred, count = _deferred.defer_draws(graph_def)
  assert count == 4
  draws = {n.name: n for n in deferred.node if n.op in _deferred.RANDOM}
  for i in range(4):
    (name,) = [n for n in draws if n.startswith(f"block{i}/")]
    assert f"^block{i}/MatMul" in draws[name].input
  outputs = [t.name for t in graph.outputs]
  before = rewrite.analyze_memory(graph_def, outputs=outputs).device()
  after = rewrite.analyze_memory(deferred, outputs=outputs).device()
  # Before: the four draws (float32 [B, H]) made at the start, live with w and the first product (x dies at
  # it); after: one draw at a time (x, w, the product, one draw; then its mask, a bool [B, H]; seeds' bytes).
  piece = B * H * 4
  assert before.step_peak_bytes >= 6 * piece
  assert after.step_peak_bytes <= 4 * piece + B * H + 1024
  rng = np.random.default_rng(1)
  values = {graph.inputs[0].name: rng.normal(size=(B, H)).astype("float32"),
            graph.inputs[1].name: rng.normal(size=(H, H)).astype("float32") * 0.1}

  def run(graph_def):
    imported = tf.Graph()
    with imported.as_default():
      tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=imported) as session:
      return session.run(outputs, values)

  np.testing.assert_array_equal(run(graph_def), run(deferred))
