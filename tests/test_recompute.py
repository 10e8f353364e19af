"""rewrite._recompute: blocks of a traced step, and their rematerialization as a graph rewrite.

The reference: the same graph without the rewrite, run in a session (the
recomputed ops are the same ops on the same inputs: equal to the bit), and
the saved-for-backward bytes derived by hand from the shapes.
"""

import numpy as np
import tensorflow as tf

import rewrite
from rewrite import _recompute

B, H, N = 64, 32, 3


def _identity(name, names):
  return ("", name) if name in names else None


def _step(stateful=False):
  """A step of N residual blocks (matmul, relu, a stateless mask, matmul, tanh), and its gradient."""

  @tf.function
  def step(x, ws):
    with tf.GradientTape() as tape:
      tape.watch(ws)
      h = x
      for i in range(N):
        with tf.name_scope(f"block{i}"):
          u = tf.nn.relu(tf.matmul(h, ws[i][0]))
          if stateful:
            keep = tf.random.uniform(tf.shape(u)) > 0.3  # stateful, unseeded: kept, not drawn again
          else:
            keep = tf.random.stateless_uniform(tf.shape(u), seed=[1, i]) > 0.3
          u = tf.where(keep, u, 0.)
          h = h + tf.tanh(tf.matmul(u, ws[i][1]))
      loss = tf.reduce_sum(h * h)
    return loss, tape.gradient(loss, ws)

  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, H)).astype("float32")
  ws = [[(rng.normal(size=(H, 4 * H)) * 0.1).astype("float32"), (rng.normal(size=(4 * H, H)) * 0.1).astype("float32")]
        for _ in range(N)]
  graph = step.get_concrete_function(tf.constant(x), [[tf.constant(w) for w in pair] for pair in ws]).graph
  return graph, [x] + [w for pair in ws for w in pair]


def _run(graph_def, graph, values):
  imported = tf.Graph()
  with imported.as_default():
    tf.graph_util.import_graph_def(graph_def, name="")
  with tf.compat.v1.Session(graph=imported) as session:
    return session.run([t.name for t in graph.outputs], {t.name: v for t, v in zip(graph.inputs, values)})


def test_blocks_are_the_scopes_below_the_one_holding_the_saved_bytes():
  graph, _ = _step()
  blocks = _recompute.blocks(graph)
  assert [b.scope for b in blocks] == ["block0", "block1", "block2"]
  first = blocks[0]
  # Internal: the relu, the mask, the masked relu and the tanh; the block's output (the residual sum) is the next
  # block's input, kept.
  assert first.saved == ("block0/Greater:0", "block0/Relu:0", "block0/SelectV2:0", "block0/Tanh:0")
  assert "x:0" in first.kept and "block0/add:0" not in first.saved
  assert blocks[1].kept[0] == "block0/add:0"
  assert first.first_backward.startswith("gradient_tape/block0/")


def test_rematerialized_blocks_give_the_same_values_and_save_less():
  graph, values = _step()
  graph_def = graph.as_graph_def()
  blocks = _recompute.blocks(graph)
  done = _recompute.rematerialize(graph_def, blocks[:2], made_for=_identity)
  assert done.recomputed == (("", "block0"), ("", "block1")) and not done.skipped
  for a, b in zip(_run(graph_def, graph, values), _run(done.graph_def, graph, values)):
    np.testing.assert_array_equal(a, b)
  copies = [n for n in done.graph_def.node if n.name.startswith(_recompute.RECOMPUTE_SCOPE + "/")]
  assert {n.name.split("/")[2] for n in copies} == {"block0", "block1"}
  roots = [n for n in copies if not any(ref.split(":")[0].lstrip("^").startswith(_recompute.RECOMPUTE_SCOPE)
                                        for ref in n.input)]
  assert roots and all(any(ref.startswith("^gradient_tape/") for ref in n.input) for n in roots)
  before = rewrite.analyze_memory(graph_def, outputs=[t.name for t in graph.outputs]).device()
  after = rewrite.analyze_memory(done.graph_def, outputs=[t.name for t in graph.outputs]).device()
  # Each rematerialized block keeps none of relu [B, 4H], mask [B, 4H] bool, masked [B, 4H], tanh [B, H]; the
  # recomputation reads block0's first kernel, which the backward pass did not (no gradient of x): a fed input
  # here, counted (a variable's read in a real step, no bytes).
  internal = B * 4 * H * 4 * 2 + B * 4 * H + B * H * 4
  assert before.saved_bytes - after.saved_bytes == 2 * internal - H * 4 * H * 4
  assert after.step_peak_bytes < before.step_peak_bytes


def test_a_stateful_draw_is_kept_not_drawn_again():
  tf.random.set_seed(None)  # unseeded: each copy of the op its own stream (a global seed would seed both alike)
  graph, values = _step(stateful=True)
  graph_def = graph.as_graph_def()
  blocks = _recompute.blocks(graph)
  assert all(not any("RandomUniform" in name for name in b.recomputed) for b in blocks)
  assert any("random_uniform/RandomUniform:0" in t for t in blocks[0].kept)
  done = _recompute.rematerialize(graph_def, blocks, made_for=_identity)
  # In one run, the recomputed mask is the forward pass's (an unseeded op drawn again, a copy of it with its own
  # stream, would give another: checked by recomputing the draw too, below).
  def masks(graph_def):
    imported = tf.Graph()
    with imported.as_default():
      tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=imported) as session:
      return session.run(["block1/Greater:0", f"{_recompute.RECOMPUTE_SCOPE}/block1/Greater:0"],
                         {t.name: v for t, v in zip(graph.inputs, values)})

  forward, recomputed = masks(done.graph_def)
  np.testing.assert_array_equal(forward, recomputed)
  cloned = _recompute.Block(blocks[1].scope, blocks[1].recomputed + ("block1/random_uniform/RandomUniform",),
                            blocks[1].saved, blocks[1].kept, blocks[1].first_backward)
  forward, redrawn = masks(_recompute.rematerialize(graph_def, [cloned], made_for=_identity).graph_def)
  assert np.mean(forward != redrawn) > 0.2


def test_a_step_without_a_backward_pass_has_no_blocks():
  @tf.function
  def forward(x):
    with tf.name_scope("block0"):
      return tf.nn.relu(x)

  assert _recompute.blocks(forward.get_concrete_function(tf.zeros([2, 2])).graph) == []
