"""The layout search (``rewrite._search``): candidates, the greedy search by groups, the memory budget."""

import itertools

import pytest
import tensorflow as tf
from conftest import cpus

import mesh
from rewrite import _cost
from rewrite import _partition
from rewrite import _search

MESH = {"batch": 2, "model": 2}
# A machine on which compute dominates: splitting work pays for its collectives.
MACHINE = _cost.Machine(flops_per_second=1e8, bytes_per_second=1e9, op_seconds=1e-6, parallel_devices=4,
                        collective_seconds=2e-5, collective_bytes_per_second=1e9)


def test_candidates_are_replicated_model_splits_and_the_largest_dimension_over_the_batch():
  found = _search.candidates((32, 64), MESH, batch_axes=("batch",))
  assert found == [((), ()), (("model",), ()), ((), ("model",)),
                   ((), ("batch",)), (("model",), ("batch",)), (("batch",), ("model",))]
  # a dimension the axis does not divide is not split over it
  assert _search.candidates((3, 64), MESH, ("batch",)) == [((), ()), ((), ("model",)), ((), ("batch",))]


def _mlp(blocks=1):
  """A step's graph: x [16, 32] over "batch", ``blocks`` of w1 [32, 64], w2 [64, 32]; the loss and its gradients."""
  specs = [tf.TensorSpec([16, 32])] + [tf.TensorSpec(s) for _ in range(blocks) for s in ([32, 64], [64, 32])]

  def fn(x, *ws):
    with tf.GradientTape() as tape:
      tape.watch(ws)
      h = x
      for w1, w2 in zip(ws[::2], ws[1::2]):
        h = tf.matmul(tf.nn.relu(tf.matmul(h, w1)), w2)
      loss = tf.reduce_sum(h * h)
    return [loss] + tape.gradient(loss, list(ws))

  graph = tf.function(fn, autograph=False).get_concrete_function(*specs).graph
  m = mesh.Mesh(MESH, devices=cpus(4))
  names = [f"w{i % 2 + 1}_{i // 2}" for i in range(2 * blocks)]

  def evaluate(layouts):
    given = {graph.inputs[0].name: (("batch",), ())}
    given.update({t.name: layouts[n] for n, t in zip(names, graph.inputs[1:])})
    part = _partition.propagate(graph, m, given)
    return _cost.work(graph, part, MESH, graph.outputs[:1]).estimate(MACHINE).seconds

  variables = {n: _search.Variable(tuple(s.shape.as_list()), s.shape.num_elements() * 4, n.split("_")[0], copies=3)
               for n, s in zip(names, specs[1:])}
  return variables, evaluate


def test_the_greedy_search_comes_within_a_few_percent_of_an_exhaustive_one():
  # Coordinate descent can stop at a local optimum: here it finds both kernels split by columns (0.902 ms),
  # where splitting both by rows is estimated at 0.880 ms (of 36 assignments; replicated: 1.75 ms).
  variables, evaluate = _mlp()
  result = _search.search(variables, MESH, evaluate, batch_axes=("batch",))
  every = [dict(zip(variables, combo)) for combo in itertools.product(
      *[_search.candidates(v.shape, MESH, ("batch",)) for v in variables.values()])]
  best = min(evaluate(layouts) for layouts in every)
  assert best <= result.seconds <= 1.05 * best
  assert result.seconds < evaluate({n: ((), ()) for n in variables})  # better than replicated
  assert len(result.tried) < len(every)  # fewer evaluations than trying every combination
  assert result.layouts["w1_0"] != ((), ())


def test_a_group_takes_one_choice_for_every_block():
  variables, evaluate = _mlp(blocks=3)
  result = _search.search(variables, MESH, evaluate, batch_axes=("batch",))
  assert len({result.layouts[f"w1_{b}"] for b in range(3)}) == 1
  assert len({result.layouts[f"w2_{b}"] for b in range(3)}) == 1
  # each row moves one group, or both by their dimension of one size (w1's columns and w2's rows: 64)
  joint = {"dimensions of size 64 over 'model' (2 groups)", "dimensions of size 32 over 'model' (2 groups)"}
  assert {t.group for t in result.tried} <= {"start", "w1", "w2"} | joint  # (no third group to make replicated)


def test_a_budget_below_replicated_variables_gets_a_layout_that_fits():
  variables, evaluate = _mlp()
  replicated = _search.bytes_per_device(variables, {}, MESH)
  assert replicated == 2 * 32 * 64 * 4 * 3  # both kernels and Adam's two moments, whole on every device
  result = _search.search(variables, MESH, evaluate, batch_axes=("batch",), memory_per_device=replicated // 3)
  assert result.bytes_per_device <= replicated // 3
  assert all(layout != ((), ()) for layout in result.layouts.values())


def test_a_budget_nothing_meets_says_the_smallest_footprint_and_what_takes_it():
  variables, evaluate = _mlp()
  with pytest.raises(_search.BudgetError) as raised:
    _search.search(variables, MESH, evaluate, batch_axes=("batch",), memory_per_device=1000)
  assert str(raised.value) == (
      "No layout found keeps a device within memory_per_device=1,000 bytes: the smallest footprint found is 12,288 "
      "bytes (12,288 of variables and their optimizer slots, 0 of the step's tensors at their peak), the largest "
      "variables w1 (1 variable(s), 6,144 bytes), w2 (1 variable(s), 6,144 bytes). Fix: raise memory_per_device, "
      "use a larger mesh or a smaller batch, or split the variables over more axes.")


def test_a_joint_move_another_split_blocks_is_tried_with_that_group_replicated():
  # Hand-made costs on {"model": 2}: splitting a's columns with b's rows (their dimension of size 16, a joint move)
  # pays only once q is split and p is not; p's and q's own splits each pay alone. From every group replicated the
  # descent splits p, then q; the joint move then costs more (p split blocks it) and no single move improves:
  # the move with p made replicated reaches the optimum, 6.
  variables = {"a": _search.Variable((4, 16), 256, "a"), "b": _search.Variable((16, 4), 256, "b"),
               "p": _search.Variable((6, 5), 120, "p"), "q": _search.Variable((2, 3), 24, "q")}
  split = lambda layout: any(layout)  # noqa: E731

  def evaluate(layouts):
    joint = layouts["a"] == ((), ("model",)) and layouts["b"] == (("model",), ())
    cost = 10 - split(layouts["p"]) - split(layouts["q"])
    if joint:
      cost += 2 if not split(layouts["q"]) else (1 if split(layouts["p"]) else -3)
    else:
      cost += 0.5 * (split(layouts["a"]) + split(layouts["b"]))
    return cost

  result = _search.search(variables, {"model": 2}, evaluate)
  assert result.seconds == 6 and not split(result.layouts["p"]) and split(result.layouts["q"])
  released = [t for t in result.tried if t.group == "dimensions of size 16 over 'model' (2 groups), p replicated"]
  assert released and released[0].seconds == 6


def test_what_evaluate_rematerialized_is_kept_with_the_assignment():
  variables, evaluate = _mlp()

  def with_remat(layouts):  # a fixed remat choice, reported back with each assignment
    seconds = evaluate(layouts)
    seconds = seconds[0] if isinstance(seconds, tuple) else seconds
    return seconds, 1000, ("block0",)

  result = _search.search(variables, MESH, with_remat, batch_axes=("batch",))
  assert result.remat == ("block0",) and all(t.remat == ("block0",) for t in result.tried)
  assert result.activation_bytes == 1000
