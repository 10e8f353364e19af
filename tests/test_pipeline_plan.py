"""``replicator.plan_pipeline`` (``replicator/integrations/_pipeline_plan.py``): stages, microbatches and schedule
chosen by the cost model.

Checked on made-up layers whose prices make the arithmetic exact (each layer ``fixed + rows x per_row`` seconds,
a machine with no cost but the one under test): the bubble's ``(m + p - 1)`` stage times picking the most
microbatches when a pass has no fixed cost, and the fewest that pay for it when it has; logical devices sharing
one core making every microbatch's fixed cost count; the sends, the update and the all-reduce added as derived by
hand; a memory limit rejecting data parallelism and GPipe for 1F1B; the chosen the cheapest row of the table.
Then a Keras model: the candidates it lists, the plan's stages, and the errors.
"""

import dataclasses

import keras
import pytest

import replicator
from replicator.integrations import _pipeline_plan
from rewrite import _cost

FREE = _cost.Machine(flops_per_second=1.0, bytes_per_second=1e30, op_seconds=0.0, parallel_devices=64,
                     collective_seconds=0.0, collective_bytes_per_second=1e30)


TWO = ("gpipe", "1f1b")


def _layers(n=8, fixed=0.0, per_row=1.0, made=0.0, sent=0.0, weights=0.0, trained=0.0, update=0.0):
  """``n`` equal made-up layers, each ``fixed + rows * per_row`` seconds a microbatch of ``rows``."""
  return _pipeline_plan.Layers(seconds=lambda rows: [fixed + rows * per_row] * n, made=(made,) * n, sent=(sent,) * n,
                               weights=(weights,) * n, trained=(trained,) * n, slots=(0.0,) * n, update=(update,) * n,
                               variables=(0,) * n, names=tuple(f"layer_{k}" for k in range(n)))


def _row(plan, p, m, schedule):
  (found,) = [c for c in plan.candidates if (c.stages, c.microbatches, c.schedule) == (p, m, schedule)]
  return found


def test_without_a_fixed_cost_the_bubble_wants_the_most_microbatches():
  # 4 stages of 2 layers, 64 rows: a stage 2 r seconds a microbatch of r = 64 / m rows, the step (m + 3) 2 (64 / m).
  plan = _pipeline_plan.choose(_layers(), 64, 4, FREE, stages=(4,), schedules=("1f1b",))
  for c in plan.candidates:
    assert c.seconds == pytest.approx((c.microbatches + 3) * 2 * 64 / c.microbatches)
  assert (plan.microbatches, plan.schedule, plan.mesh_shape) == (64, "1f1b", {"stage": 4, "batch": 1})
  assert plan.seconds == pytest.approx(134.0)
  assert plan.split_points == ("layer_2", "layer_4", "layer_6")


def test_the_interleaved_schedule_s_bubble_is_v_times_smaller():
  # 2 devices, 16 rows in 2 microbatches of 8: 1F1B's 2 stages of 4 layers, 32 s a microbatch each, (m + p - 1) 32
  # = 96; interleaved, 4 stages of 16 s, 2 a device: (v m + p - 1) 16 = 80.
  plan = _pipeline_plan.choose(_layers(), 16, 2, FREE, stages=(2,), microbatches=(2,))
  assert {c.schedule: c.seconds for c in plan.candidates} == {"interleaved": 80.0, "1f1b": 96.0, "gpipe": 96.0}
  assert plan.schedule == "interleaved" and _row(plan, 2, 2, "interleaved").cuts == (0, 2, 4, 6)
  assert plan.split_points == ("layer_2", "layer_4", "layer_6")


def test_a_fixed_cost_a_pass_makes_too_many_microbatches_dear():
  # A stage 1 + r / 8 seconds (2 layers of 0.5 + r / 16), r = 64 / m: (m + 3)(1 + 8 / m) is 36, 25, 21, 22, 28.5
  # for m = 1, 2, 4, 8, 16: four microbatches.
  plan = _pipeline_plan.choose(_layers(fixed=0.5, per_row=1 / 16), 64, 4, FREE, stages=(4,), schedules=("1f1b",))
  assert [(c.microbatches, c.seconds) for c in plan.candidates][:3] == [(4, 21.0), (8, 22.0), (2, 25.0)]
  assert plan.microbatches == 4
  # Four logical devices on one core: every device's work in turn, 4 m (1 + 8 / m) = 4 m + 32, more than the path
  # from m = 2 (40 against 25): one microbatch.
  shared = dataclasses.replace(FREE, parallel_devices=1)
  plan = _pipeline_plan.choose(_layers(fixed=0.5, per_row=1 / 16), 64, 4, shared, stages=(4,), schedules=("1f1b",))
  assert plan.microbatches == 1 and plan.seconds == pytest.approx(36.0)
  assert _row(plan, 4, 2, "1f1b").seconds == pytest.approx(40.0) and _row(plan, 4, 2, "1f1b").path_seconds == 25.0


def test_the_sends_the_update_and_the_all_reduce_add_up_as_derived():
  # {"stage": 2, "batch": 2}, 32 rows, 1 microbatch: r = 16 rows, a layer 1 s, a stage 4 s, and its send (16 bytes
  # at 16 bytes a second) 1 s: the path 5 + 5, the update 4 x 0.5 s; the loss's all-reduce 1 s, the gradients'
  # 1 + 2 (1 / 2) 400 / 100 = 5 s; the devices' work 2 (7 + 7) / 4 = 7 is less than the path: 10 + 2 + 6 = 18.
  machine = dataclasses.replace(FREE, bytes_per_second=16.0, parallel_devices=4, collective_seconds=1.0,
                                collective_bytes_per_second=100.0)
  layers = _layers(per_row=1 / 16, sent=1.0, trained=100.0, update=0.5)
  row = _row(_pipeline_plan.choose(layers, 32, 4, machine, stages=(2,), microbatches=(1,)), 2, 1, "gpipe")
  assert (row.replicas, row.cuts) == (2, (0, 4))
  assert row.path_seconds == pytest.approx(18.0) and row.work_seconds == pytest.approx(13.0)
  assert row.seconds == pytest.approx(18.0)
  # Data parallelism on the 4 devices: 8 rows, 8 layers of 0.5 s, the update 4 s, the all-reduce of 800 bytes
  # 1 + 2 (3 / 4) 800 / 100 = 13 s: 4 + 4 + 13 = 21; no loss's all-reduce over stages.
  row = _row(_pipeline_plan.choose(layers, 32, 4, machine, stages=(1,)), 1, 1, None)
  assert row.seconds == pytest.approx(21.0)


def test_a_memory_limit_rejects_data_parallelism_then_gpipe():
  # 4 devices, 64 rows, 8 layers of 100 bytes of weights, each making a byte a row a microbatch. Data parallelism
  # (16 rows a device, 8 x 16 = 128 s, no bubble) is the fastest: 800 + 8 x 16 = 928 bytes a device. Then 2
  # stages of 32 rows, m = 32: 128 x 33 / 32 = 132 s, holding 400 bytes of weights and GPipe's 32 microbatches
  # of 4 bytes (528) or 1F1B's 2 (408) on the first stage. (The interleaved schedule's 130 s left out.)
  layers = _layers(made=1.0, weights=100.0)
  assert _pipeline_plan.choose(layers, 64, 4, FREE, schedules=TWO).mesh_shape == {"stage": 1, "batch": 4}
  assert _pipeline_plan.choose(layers, 64, 4, FREE, schedules=TWO).seconds == pytest.approx(128.0)
  plan = _pipeline_plan.choose(layers, 64, 4, FREE, memory_bytes=600, schedules=TWO)
  assert (plan.mesh_shape, plan.microbatches, plan.memory_bytes) == ({"stage": 2, "batch": 2}, 32, 408.0)
  assert plan.seconds == pytest.approx(132.0)
  assert _row(plan, 1, 1, None).rejected == "928 bytes a device, over memory_bytes=600"
  plan = _pipeline_plan.choose(layers, 64, 4, FREE, memory_bytes=450, schedules=TWO)
  assert (plan.mesh_shape["stage"], plan.microbatches, plan.schedule) == (2, 32, "1f1b")
  assert _row(plan, 2, 32, "gpipe").rejected == "528 bytes a device, over memory_bytes=450"
  assert _row(plan, 2, 32, "gpipe").seconds == plan.seconds  # (as fast: rejected for its memory alone)
  with pytest.raises(replicator.ArgumentError, match=r"^replicator.plan_pipeline\(memory_bytes=100\): no candidate "
                     r"fits; the least needs 20\d bytes a device \(4 stages, .*\. Fix: more devices, fewer rows, or "
                     r"a larger memory_bytes\.$"):
    _pipeline_plan.choose(layers, 64, 4, FREE, memory_bytes=100, schedules=TWO)


def _model():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, name="wide"), keras.layers.Dense(8, name="a"),
                           keras.layers.Dense(8, name="b"), keras.layers.Dense(1, name="head")])


def test_a_keras_model_s_plan_is_the_cheapest_of_its_candidates():
  model = _model()
  plan = replicator.plan_pipeline(model, 4, input_shape=(16, 8))
  listed = {(c.stages, c.replicas, c.microbatches, c.schedule) for c in plan.candidates}
  expected = {(1, 4, 1, None)}
  expected |= {(2, 2, m, s) for m in (1, 2, 4, 8) for s in ("gpipe", "1f1b")} | {(2, 2, m, "interleaved")
                                                                                for m in (2, 4, 8)}
  expected |= {(4, 1, m, s) for m in (1, 2, 4, 8, 16) for s in ("gpipe", "1f1b")}  # (4 layers: no 2 a device)
  assert listed == expected
  assert plan.chosen is plan.candidates[0]
  assert plan.seconds == min(c.seconds for c in plan.candidates) == plan.chosen.seconds
  assert plan.mesh_shape == {"stage": plan.chosen.stages, "batch": plan.chosen.replicas}
  stages = plan.split(model)
  assert len(stages) == plan.chosen.stages * plan.chosen.chunks
  assert [s.layers[0].name for s in stages[1:]] == list(plan.split_points)
  for c in plan.candidates:  # split_stages' own cuts at the candidate's microbatch rows
    if c.stages > 1:
      rows = 16 // c.replicas // c.microbatches
      cut = replicator.split_stages(model, c.stages * c.chunks, input_shape=(rows, 8))
      assert [s.layers[0].name for s in cut] == [model.layers[k].name for k in c.cuts]
  # A device's weights and Adam's two slots shrink with the stages (data parallelism: every one of them).
  first = min((c for c in plan.candidates if c.stages == 1), key=lambda c: c.memory_bytes)
  weights = sum(v.numpy().nbytes for v in model.weights)
  assert first.memory_bytes > 4 * weights  # (weights, gradients, two slots, and the activations)
  assert min(c.memory_bytes for c in plan.candidates if c.stages == 4) < first.memory_bytes / 2


def test_measured_costs_are_cut_and_priced_at_each_microbatch_s_rows(monkeypatch):
  # A stand-in for the timing: the head 3 seconds a row, the rest 1 a row; measured once a microbatch size.
  from replicator.integrations import _keras_stages  # pylint: disable=import-outside-toplevel
  asked = []

  def measured(layers, shape, dtype):
    asked.append(shape)
    return [shape[0] * (3.0 if layer.name == "head" else 1.0) for layer in layers]

  monkeypatch.setattr(_keras_stages, "measured_layer_costs", measured)
  plan = replicator.plan_pipeline(_model(), 4, input_shape=(16, 8), stages=(2,), microbatches=(1, 2),
                                  schedules=("gpipe",), costs="measured", machine=FREE)
  assert sorted(asked) == [(4, 8), (8, 8)]  # (2 replicas of 8 rows: microbatches of 8 and 4)
  for c in plan.candidates:  # 1 + 1 + 1 | 3 (the head), not 2 | 2 as by the estimates' near-equal layers
    assert c.cuts == (0, 3)
    rows = 16 // c.replicas // c.microbatches
    assert c.path_seconds == pytest.approx((c.microbatches + 1) * 3 * rows)  # (FREE: the stages alone)


def test_the_optimizer_s_slots_count_in_a_device_s_memory():
  # Adam keeps two slots a weight, SGD none: data parallelism's device holds twice the weights' bytes more with Adam.
  model = _model()
  weights = sum(v.numpy().nbytes for v in model.trainable_variables)
  adam, sgd = (replicator.plan_pipeline(model, 4, input_shape=(16, 8), stages=(1,), optimizer=optimizer)
               for optimizer in (keras.optimizers.Adam(), keras.optimizers.SGD()))
  assert adam.memory_bytes - sgd.memory_bytes == 2 * weights
  assert adam.seconds > sgd.seconds  # (Adam's update: more ops)


def test_mistakes_are_named():
  model = _model()
  cases = [
      (dict(devices=0), r"plan_pipeline\(devices=0\): expected a positive int, how many devices\. Fix: "
                        r"devices=len\(devices\) for a list of them\."),
      (dict(input_shape=(16,)), r"plan_pipeline\(input_shape=\(16,\)\): expected a global batch's shape, its rows "
                                r"first \(an int\) and a row's shape after\. Fix: input_shape=\(rows, features\)"),
      (dict(schedules=("zero",)), r"plan_pipeline\(schedules=\('zero',\)\): expected some of \('gpipe', '1f1b', "
                                  r"'interleaved'\); found \['zero'\]\. Fix: schedules=\('gpipe', '1f1b'\)"),
      (dict(memory_bytes=0), r"plan_pipeline\(memory_bytes=0\): expected a positive number of bytes a device, or "
                             r"None \(no limit\)\. Fix: memory_bytes=16e9"),
      (dict(costs="timed"), r"plan_pipeline\(costs='timed'\): expected 'estimated' \(the cost model\) or "
                            r"'measured' \(each layer's pass timed here, at each candidate's microbatch rows\)\. "
                            r"Fix: costs='measured'"),
      (dict(microbatches=(0, 2)), r"plan_pipeline\(microbatches=\(0, 2\)\): expected positive ints, microbatch "
                                  r"counts dividing a replica's rows\. Fix: microbatches=None \(every one\)"),
      (dict(input_shape=(6, 8), stages=(1,)), r"plan_pipeline: no candidate for 6 rows on 4 devices \(4 layers; "
                                              r"stages=\(1,\), microbatches=None\): expected a stage count dividing "
                                              r"the devices, at most the layers, whose batch axis divides the rows\."),
  ]
  for given, message in cases:
    kwargs = {"devices": 4, "input_shape": (16, 8), **given}
    with pytest.raises(replicator.ArgumentError, match=message):
      replicator.plan_pipeline(model, kwargs.pop("devices"), **kwargs)
  inputs = keras.Input((8,))
  h = keras.layers.Dense(8)(inputs)
  residual = keras.Model(inputs, keras.layers.Add(name="add")([h, keras.layers.Dense(8)(h)]))
  with pytest.raises(replicator.ArgumentError, match=r"is not a chain of layers \(layer 'add' takes"):
    replicator.plan_pipeline(residual, 2, input_shape=(8, 8))
