"""Layout maps checked against the variables: a key that matches no variable is reported, never silent."""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator


def _model_and_step(repl, built_in_step=False, wrap=False):
  with repl.context():
    layers = [keras.layers.Dense(16, activation="relu", name="ff_in"), keras.layers.Dense(4, name="ff_out")]
    model = keras.Sequential(([] if built_in_step else [keras.Input((8,))]) + layers)
    opt = keras.optimizers.SGD(0.1)
    if wrap:
      opt = repl.wrap_optimizer(opt)  # the local view's step reduces its gradients

  def step(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(batch) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  return model, step


def _data():
  return tf.data.Dataset.from_tensors(tf.ones([4, 8])).repeat()


def _replicator(layouts, view="global", strict=False):
  return replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)), layouts=layouts,
                               view=view, strict=strict)


@pytest.mark.parametrize("view", ["global", "local"])
def test_a_key_that_matches_no_variable_warns_with_the_closest_paths(view):
  repl = _replicator(mesh.LayoutMap({r"ff_inn/kernel$": (None, "model"), r"ff_out/bias$": (None,)}), view)
  model, step = _model_and_step(repl, wrap=view == "local")
  data = _data() if view == "global" else (lambda ctx: _data())
  with pytest.warns(UserWarning) as record:
    repl.run(step, data)
  (message,) = [str(w.message) for w in record if "matches none" in str(w.message)]
  path = model.layers[0].kernel.path
  assert message.startswith(
      f"The layouts' key 'ff_inn/kernel$' matches none of the 6 variable path(s) made in this Replicator's context "
      f"so far, so it splits nothing: the variables it was meant for are replicated. The closest: {path!r}, ")
  assert "Fix: correct the key" in message
  # What the warning says is so: the kernel is whole on every device.
  per_device = replicator.bytes_per_device([model.layers[0].kernel])
  assert set(per_device.values()) == {8 * 16 * 4}
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # reported once: the next calls are quiet
    repl.run(step, data)


def test_strict_refuses_it_on_every_call_until_the_layouts_change():
  repl = _replicator(mesh.LayoutMap({r"ff_inn/kernel$": (None, "model")}), strict=True)
  _, step = _model_and_step(repl)
  for _ in range(2):
    with pytest.raises(mesh.LayoutError, match=re.escape("The layouts' key 'ff_inn/kernel$' matches none of")):
      repl.run(step, _data())


def test_keys_for_variables_built_in_the_step_and_keras_layout_maps_are_quiet():
  device_mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=cpus(4))
  keras_layouts = keras.distribution.LayoutMap(device_mesh)
  keras_layouts[".*ff_in/kernel"] = (None, "model")  # Keras matches the whole path (re.fullmatch)
  keras_layouts[".*ff_out/kernel"] = ("model", None)
  for layouts in (mesh.LayoutMap({r"ff_in/kernel$": (None, "model"), r"ff_out/kernel$": ("model", None)}),
                  keras_layouts):
    repl = _replicator(layouts)
    model, step = _model_and_step(repl, built_in_step=True)  # the layers are built by the step's first call
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      loss = repl.run(step, _data())
    assert np.isfinite(float(loss))
    assert set(replicator.bytes_per_device([model.layers[0].kernel]).values()) == {8 * 16 * 4 // 2}


def test_a_typo_in_a_keras_layout_map_warns_too():
  device_mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=cpus(4))
  keras_layouts = keras.distribution.LayoutMap(device_mesh)
  keras_layouts["ff_inn/kernel"] = (None, "model")
  repl = _replicator(keras_layouts)
  _, step = _model_and_step(repl)
  with pytest.warns(UserWarning, match=re.escape("The layouts' key 'ff_inn/kernel' matches none")):
    repl.run(step, _data())
