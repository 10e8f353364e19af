"""The public API: names exported, private modules not re-exported."""

import ast
import importlib
import os
import subprocess
import sys

import pytest

import mesh
import replicator
import rewrite


def test_replicator_public_names():
  assert set(replicator.__all__) == {
      "CollectiveInControlFlowError", "CollectiveMismatchError", "CrossReplicaBatchNorm", "DeviceError", "EndOfInput", "InputContext",
      "InputMismatchError", "OutputMismatchError", "PerReplica", "ReplicaContextError", "ReplicaInvarianceError", "ReplicasDivergedError", "StepFailedError",
      "ReplicatedOptimizer", "ReplicatedVariable", "Replicator", "ReplicatorError",
      "VariableCreationError", "UnreplicatedStateError", "bytes_per_device", "calibrate", "ArgumentError",
      "ArgumentTypeError", "UnsupportedError", "current", "virtual_cpus", "enable_keras_distribution", "distribution_replicator",
      "MultiWorkerReplicator", "ClusterConfigError", "WorkerUnavailableError", "CheckpointDamagedError", "testing",
      "remat", "pad_sequence", "sequence_positions", "shard_sequence", "unshard_sequence", "pipeline_variables", "split_stages",
      "stacked_pipeline", "StackedBlocks", "plan_pipeline", "PipelinePlan", "PipelineCandidate", "PipelineModel"}
  for name in replicator.__all__:
    assert getattr(replicator, name).__doc__, f"replicator.{name} has no docstring"


def test_replicator_methods_documented():
  for name in ("context", "run", "explain", "reduce", "gather", "wrap_optimizer", "all_reduce",
               "all_sum", "broadcast", "all_gather", "replica_id", "num_replicas", "devices", "mesh",
               "batch_axes", "num_input_pipelines", "input_pipeline", "layout_spec", "ring_attention",
               "ulysses_attention", "halo_exchange", "pipeline", "pipeline_forward", "view"):
    assert getattr(replicator.Replicator, name).__doc__, name


def test_mesh_and_rewrite_public_names():
  assert set(mesh.__all__) == {
      "DeviceError", "Layout", "LayoutError", "LayoutMap", "LayoutRules", "Mesh", "MeshError", "ShardedTensor",
      "assemble", "canonical_name", "global_shape", "local_devices", "pack", "relayout", "shard", "split",
      "unpack", "virtual_cpus"}
  assert {"plan", "apply", "Plan", "Collective", "Placeholder", "Lowering", "register_lowering",
          "CollectiveMismatchError", "auto_lowering"} <= set(rewrite.__all__)
  for module in (mesh, rewrite):
    for name in module.__all__:
      assert getattr(module, name) is not None


def test_errors_subclass_builtins():
  assert issubclass(replicator.CollectiveMismatchError, ValueError)
  assert issubclass(replicator.ReplicaContextError, RuntimeError)
  assert issubclass(replicator.ReplicaContextError, replicator.ReplicatorError)
  assert issubclass(replicator.DeviceError, ValueError)


def test_the_names_static_tools_read_are_the_names_run_time_finds():
  # replicator/__init__.py imports its names on first use (__getattr__); type checkers, IDEs and the API docs read
  # its `if typing.TYPE_CHECKING:` imports instead. Both must give the same objects, for every name of __all__.
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "replicator", "__init__.py")
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  (block,) = [node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
  static = {alias.name: node.module for node in block.body for alias in node.names}
  assert set(static) == set(replicator.__all__)
  for name, module in static.items():
    assert getattr(replicator, name) is getattr(importlib.import_module(module), name), name
    assert name in dir(replicator)
  assert sys.modules["replicator.testing"] is replicator.testing
  with pytest.raises(AttributeError, match="module 'replicator' has no attribute 'Replicater'"):
    _ = replicator.Replicater


LAZY_IMPORT = """
import sys
import replicator
assert "tensorflow" not in sys.modules and "keras" not in sys.modules, "import replicator imported TensorFlow"
assert sorted(m for m in sys.modules if m.split(".")[0] in ("replicator", "mesh", "rewrite")) == [
    "replicator", "replicator._version"], sorted(sys.modules)
from replicator import current  # noqa: F401  (the first name used does what importing the package used to do:)
import keras
assert keras.saving.get_registered_object("replicator>CrossReplicaBatchNorm") is not None  # keras.saving.load_model
assert str(replicator.ArgumentError("x").__class__) == "<class 'replicator.ArgumentError'>"
print("ok")
"""


def test_import_replicator_imports_no_tensorflow_and_the_first_name_used_registers_with_keras():
  process = subprocess.run([sys.executable, "-c", LAZY_IMPORT], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert process.returncode == 0 and process.stdout == "ok\n", process.stderr[-3000:]
