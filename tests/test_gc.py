"""Tests for replicator.core._gc: the garbage collector paused while a step is built."""

import gc

import tensorflow as tf
from conftest import cpus

import replicator
from replicator.core import _gc


def test_paused_restores_the_collector_as_it_was():
  assert gc.isenabled()
  with _gc.paused():
    assert not gc.isenabled()
    with _gc.paused():  # nested: the inner block leaves it off
      assert not gc.isenabled()
    assert not gc.isenabled()
  assert gc.isenabled()
  gc.disable()
  try:
    with _gc.paused():
      pass
    assert not gc.isenabled()  # off before: stays off
  finally:
    gc.enable()


def test_run_builds_with_the_collector_paused_and_turns_it_back_on_after_an_error():
  repl = replicator.Replicator(cpus(2))
  seen = []

  def step():
    seen.append(gc.isenabled())
    return tf.constant(1.0)

  repl.run(step)
  assert seen == [False, False] and gc.isenabled()  # traced once per replica

  def failing():
    raise ValueError("in the step")

  try:
    repl.run(failing)
  except ValueError:
    pass
  assert gc.isenabled()
