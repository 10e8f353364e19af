"""Layout-map keys for Keras layers' outputs (``replicator/integrations/_keras_outputs.py``), in global-view steps.

A key ``"<layer path>/output"`` lays out that layer's output where the step
computes it (``Replicator.with_layout``), given to the Replicator (a dict, a
``mesh.LayoutMap`` or a ``keras.distribution.LayoutMap``) or through Keras's
distribution API. Checked against one device (every weight and Adam slot) and
in ``explain``. Tolerance: the sequence split from the embedding's output on is
the very program ``input_layouts=("batch", "seq")`` gives (the weights equal to
the bit after 3 steps, measured); that differs from one device by 3.7e-6 after 3
Adam steps at 1e-2 (Adam's m / sqrt(v) magnifies a split sum's reordering where
a gradient is near zero; a batch split alone: 1.1e-6), so 5e-6; a wrong step
is off by 1e-3 or more.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import keras_step

import mesh
import replicator

B, S, D, V = 4, 16, 16, 32
ATOL = 5e-6
STATED = "the layout the step states for it"


def _tokens():
  rng = np.random.default_rng(0)
  return rng.integers(0, V, (B, S)).astype(np.int32), rng.integers(0, V, (B, S)).astype(np.int32)


def _decoder():
  keras.utils.set_random_seed(1)
  ids = keras.Input((S,), dtype="int32")
  h = keras.layers.Embedding(V, D, name="emb")(ids)
  h = keras.layers.LayerNormalization(name="ln")(h + keras.layers.MultiHeadAttention(2, 8, name="mha")(
      h, h, use_causal_mask=True))
  return keras.Model(ids, keras.layers.Dense(V, name="head")(keras.layers.Dense(32, activation="gelu", name="ff")(h)))



def _data():
  return tf.data.Dataset.from_tensors(_tokens()).repeat()


def _one_device(steps=3):
  one, opt = _decoder(), keras.optimizers.Adam(1e-2)
  step, batches = tf.function(keras_step(one, opt)), iter(_data())
  return one, opt, [float(step(next(batches))) for _ in range(steps)]


@pytest.mark.parametrize("layouts", [
    {"emb/output": ("batch", "seq", None)},  # a dict: re.search, as mesh.LayoutMap
    "keras",  # a keras.distribution.LayoutMap: re.fullmatch, the whole path
])
def test_an_output_key_splits_the_sequence_from_that_layer_on_and_equals_one_device(layouts):
  one, one_opt, expected = _one_device()
  m = mesh.Mesh({"batch": 2, "seq": 2}, devices=cpus(4))
  if layouts == "keras":
    layouts = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2, 2), ["batch", "seq"], cpus(4)))
    layouts["emb/output"] = keras.distribution.TensorLayout(["batch", "seq", None])
  repl = replicator.Replicator(mesh=m, view="global", layouts=layouts, strict=True)
  with repl.context():
    model, opt = _decoder(), keras.optimizers.Adam(1e-2)
  step = keras_step(model, opt)
  np.testing.assert_allclose([float(repl.run(step, _data())) for _ in range(3)], expected, atol=ATOL)
  assert_every_copy(model.weights, one.weights, atol=ATOL)
  assert_every_copy(opt.variables, one_opt.variables, atol=ATOL)

  report = repl.explain(step, _data())
  # The layout stated for the embedding's output is asked of the ops before it: the lookup runs on each device's
  # tokens, the token ids sliced for free; nothing is gathered for it.
  ids = [row for row in report.relayouts if "emb" in row.op_name and row.target == (("batch",), ("seq",))]
  assert ids and not any(row.gathered for row in ids)
  assert not any(STATED in c.why for c in report.collective_rows)
  # From there on the tokens stay split: attention gathers its keys and values over "seq".
  gathered = {row.tensor.split("/")[-2].split("_")[0] for row in report.relayouts
              if row.gathered and ("seq",) in [axes for _, axes in row.gathered] and "mha" in row.tensor}
  assert {"key", "value"} <= gathered


def test_an_output_key_through_keras_distribution_api_states_the_layout():
  replicator.enable_keras_distribution()
  _, _, expected = _one_device(steps=2)
  try:
    device_mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], cpus(4))
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map["ff/kernel"] = keras.distribution.TensorLayout([None, "model"])
    layout_map["ff/output"] = keras.distribution.TensorLayout(["batch", None, None])  # gathered after ff
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    model, opt = _decoder(), keras.optimizers.Adam(1e-2)
    repl = replicator.distribution_replicator()
    step = keras_step(model, opt)
    report = repl.explain(step, _data())
    stated = [c for c in report.collective_rows if STATED in c.why]
    # ff's output [batch, seq, 32] split by the kernel's columns over "model": gathered where stated.
    assert [(c.kind, c.axes) for c in stated if not c.op_name.endswith("grad")] == [("all_gather", ("model",))]
    np.testing.assert_allclose([float(repl.run(step, _data())) for _ in range(2)], expected, atol=ATOL)
  finally:
    keras.distribution.set_distribution(None)


def test_an_output_key_that_matches_no_layer_is_reported_with_the_closest():
  m = mesh.Mesh({"batch": 2, "seq": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, view="global", layouts={"embb/output": ("batch", "seq", None)})
  with repl.context():
    model, opt = _decoder(), keras.optimizers.Adam(1e-2)
  with pytest.warns(UserWarning, match=r"key 'embb/output' \(a layer's output\) matches the output of none of the "
                                       r"\d+ Keras layer\(s\).*The closest: '[^']*emb/output'.*Fix: correct the key"):
    repl.run(keras_step(model, opt), _data())
  strict = replicator.Replicator(mesh=m, view="global", layouts={"embb/output": ("batch", "seq", None)}, strict=True)
  with strict.context():
    model, opt = _decoder(), keras.optimizers.Adam(1e-2)
  with pytest.raises(mesh.LayoutError, match=r"key 'embb/output' \(a layer's output\) matches the output of none"):
    strict.run(keras_step(model, opt), _data())


def test_output_keys_are_not_variables_keys():
  layouts = mesh.LayoutMap({"ff/kernel": (None, "model"), "ff/output": ("batch", None, None)})
  assert layouts.lookup("ff/kernel") == (None, "model") and layouts.lookup("x/ff/output") is None
  assert layouts.output_match("functional/ff") == ("ff/output", ("batch", None, None))
  assert layouts.unmatched(["ff/kernel"]) == [] and layouts.unmatched(["functional/ff"], outputs=True) == []
