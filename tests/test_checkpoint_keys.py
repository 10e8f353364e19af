"""The keys a checkpoint holds each object's value under, read from the object graph it wrote."""

import keras
import tensorflow as tf

from replicator import _checkpoint_keys


def test_every_variable_of_a_model_and_its_optimizer_has_the_key_the_checkpoint_holds_it_under(tmp_path):
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
  optimizer = keras.optimizers.Adam()
  optimizer.build(model.trainable_variables)
  root = tf.train.Checkpoint(model=model, optimizer=optimizer)
  path = root.write(str(tmp_path / "ckpt"))
  found = _checkpoint_keys.keys(root, path)
  reader = tf.train.load_checkpoint(path)
  held = {k for k, _ in tf.train.list_variables(path) if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}
  assert {key for _, key in found} == held
  for obj, key in found:  # each key holds that object's value
    assert (reader.get_tensor(key) == obj.numpy()).all(), key
  by_object = {id(obj): key for obj, key in found}  # (TensorFlow's first path: the optimizer's list, here)
  assert by_object[id(model.layers[0].kernel)] == "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
  assert len(by_object) == len(found) == len(model.variables + optimizer.variables)
