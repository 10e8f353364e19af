"""Gathered activations gathered again for the backward pass (rewrite/_regather.py): which ones, and their chains."""

import tensorflow as tf
from conftest import cpus

import mesh
from rewrite import _partition
from rewrite import _regather


def _graph():
  """Queries split by rows meeting keys (a bias added, then a transpose) that the product wants whole."""

  @tf.function
  def step(q, k, bias, w):
    with tf.GradientTape() as tape:
      tape.watch([w, q])
      keys = tf.transpose((k + bias) * w)  # cheap ops after the keys' gather: recomputed with it
      scores = tf.matmul(q, keys)
      loss = tf.reduce_sum(tf.nn.softmax(scores) * scores)
    return (loss,) + tuple(tape.gradient(loss, [w, q]))  # dq reads the whole keys

  spec = tf.TensorSpec([8, 4])
  return step.get_concrete_function(spec, spec, tf.TensorSpec([4]), tf.TensorSpec([])).graph


def test_the_chain_from_a_gather_to_what_the_backward_pass_reads_is_one_block():
  graph = _graph()
  m = mesh.Mesh({"seq": 2}, devices=cpus(2))
  q, k, bias, w = graph.inputs[:4]
  given = {q.name: (("seq",), ()), k.name: (("seq",), ()), bias.name: ((),), w.name: ()}
  partition = _partition.propagate(graph, m, given, data=frozenset({q.name, k.name}), batch_axes=())
  blocks = _regather.blocks(graph, partition)
  assert len(blocks) == 1, blocks
  (block,) = blocks
  types = sorted(graph.get_operation_by_name(name).type for name in block.recomputed)
  # The multiply reads the keys gathered (the add runs on their pieces: its output is read split by w's gradient,
  # so the gather is after it); the transpose follows; the matmul is not cheap.
  assert types == ["Mul", "Transpose"], types
  assert all(graph.get_tensor_by_name(t).op.name in block.recomputed for t in block.saved)
  assert block.first_backward.startswith("gradient_tape") or "grad" in block.first_backward.lower()


def test_nothing_is_gathered_again_where_nothing_is_gathered():
  graph = _graph()
  m = mesh.Mesh({"seq": 2}, devices=cpus(2))
  q, k, bias, w = graph.inputs[:4]
  given = {q.name: (("seq",), ()), k.name: ((), ()), bias.name: ((),), w.name: ()}
  partition = _partition.propagate(graph, m, given, data=frozenset({q.name, k.name}), batch_axes=())
  assert _regather.blocks(graph, partition) == []
