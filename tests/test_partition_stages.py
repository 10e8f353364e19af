"""rewrite._partition_stages: which stage of a pipeline runs each op of a traced one-device step."""

import tensorflow as tf
from conftest import cpus

import mesh
from rewrite import _partition
from rewrite import _partition_stages

MICRO = "micro"


def _step_graph():
  """A two-layer step (weights ``w0`` of stage 0 and ``w1`` of stage 1, a ``scale`` both layers read), its loss,
  gradients and an update with a momentum slot of ``w1`` and a step counter: the traced graph, its handles by
  variable, its mesh and partition."""
  w0 = tf.Variable(tf.ones([4, 3]), name="w0")
  w1 = tf.Variable(tf.ones([3, 1]), name="w1")
  momentum = tf.Variable(tf.zeros([3, 1]), name="momentum")
  count = tf.Variable(0, name="count")
  scale = tf.Variable(1.0, name="scale")

  @tf.function(autograph=False)
  def step(x):
    with tf.GradientTape() as tape:
      h = tf.tanh(tf.matmul(x, w0) * scale)
      loss = tf.reduce_mean((tf.matmul(h, w1) * scale) ** 2)
    g0, g1, gs = tape.gradient(loss, [w0, w1, scale])
    w0.assign_sub(0.1 * g0)
    scale.assign_sub(0.1 * gs)
    momentum.assign(0.9 * momentum + g1)
    w1.assign_sub(0.1 * momentum)
    count.assign_add(1)
    return loss

  graph = step.get_concrete_function(tf.TensorSpec([8, 4])).graph
  handles = {}
  for external, internal in graph.captures:
    for v in (w0, w1, momentum, count, scale):
      if external is v.handle:
        handles[v.name.split(":")[0]] = internal.name
  m = mesh.Mesh({"stage": 2}, devices=cpus(2)).with_repeats(MICRO, 2)
  given = {graph.inputs[0].name: ((MICRO,), ())}
  shapes = {}
  for v in (w0, w1, momentum, count, scale):
    given[handles[v.name.split(":")[0]]] = ((),) * v.shape.rank
    shapes[handles[v.name.split(":")[0]]] = v.shape.as_list()
  partition = _partition.propagate(graph, m, given, shapes, batch_axes=(MICRO,))
  return graph, handles, m, partition


def _stage(found, graph, name_part, op_type):
  """The owner of the op of ``op_type`` whose name contains ``name_part`` (one such op)."""
  (op,) = [op for op in graph.get_operations() if op.type == op_type and name_part in op.name]
  return found.ownership.ops.get(op.name)


def test_each_op_runs_on_its_variables_stage_and_updates_once_a_device():
  graph, handles, m, partition = _step_graph()
  found = _partition_stages.assign(graph, partition, "stage", {handles["w0"]: 0, handles["w1"]: 1}, MICRO, m)
  owner = _partition_stages._partition_owners.Owner
  # The forward pass: each layer's product on its weights' stage, every microbatch (rows split over MICRO).
  matmuls = [op for op in graph.get_operations() if op.type == "MatMul" and not op.name.startswith("gradient_tape")]
  assert [found.ownership.ops[op.name] for op in matmuls] == [owner(("stage",), 0), owner(("stage",), 1)]
  assert _stage(found, graph, "Tanh", "Tanh") == owner(("stage",), 0)
  # The loss on the last stage; the backward pass where its forward ops ran (w0's gradient on stage 0, though it
  # reads stage 1's gradient of h).
  assert _stage(found, graph, "Mean", "Mean") == owner(("stage",), 1)
  assert _stage(found, graph, "TanhGrad", "TanhGrad") == owner(("stage",), 0)
  backward = {op.name: found.ownership.ops[op.name] for op in graph.get_operations()
              if op.type == "MatMul" and op.name.startswith("gradient_tape")}
  assert sorted(o.position for o in backward.values()) == [0, 1, 1], backward  # (no gradient of x)
  # The updates: on their variables' stage, at its first microbatch's position alone (once a device); the slot
  # belongs to w1's stage; the step counter to none (its first position on every device).
  stage0_once, stage1_once = owner(("stage", MICRO), 0), owner(("stage", MICRO), 2)
  writes = {op.inputs[0].name: found.ownership.ops.get(op.name) for op in graph.get_operations()
            if op.type in ("AssignSubVariableOp", "AssignVariableOp", "AssignAddVariableOp")}
  assert {h: writes[h] for h in (handles["w0"], handles["w1"], handles["momentum"], handles["count"])} == {
      handles["w0"]: stage0_once, handles["w1"]: stage1_once, handles["momentum"]: stage1_once,
      handles["count"]: owner((MICRO,), 0)}
  # scale, which layers of both stages read (given no stage), is of none: every device reads its own copy (once a
  # device), and writes it (once a device), from the gradient's stage.
  assert found.variables == {handles["w0"]: 0, handles["w1"]: 1, handles["momentum"]: 1}
  assert found.shared == {handles["scale"]} and found.refused == []
  assert writes[handles["scale"]] == owner((MICRO,), 0)
  scale_reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"
                 and op.inputs[0].name == handles["scale"]]
  assert {found.ownership.ops.get(op.name) for op in scale_reads} == {owner((MICRO,), 0)}


def test_a_summed_variable_belongs_to_no_stage():
  graph, handles, m, partition = _step_graph()
  # (a metric's total: each device's component its part of the value) The counter, given as summed; w1, given no
  # stage (nothing marks stage 1), found with every op after w0's on stage 0.
  found = _partition_stages.assign(graph, partition, "stage", {handles["w0"]: 0}, MICRO, m,
                                   summed=frozenset({handles["count"]}))
  assert handles["count"] in found.shared and handles["count"] not in found.variables
  assert found.variables[handles["w1"]] == 0 and found.variables[handles["momentum"]] == 0
  assert {o.position for o in found.ownership.ops.values() if o.axes[0] == "stage"} == {0}
