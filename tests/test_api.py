"""The public API: names exported, private modules not re-exported."""

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
      "MultiWorkerReplicator", "ClusterConfigError", "WorkerUnavailableError", "testing"}
  for name in replicator.__all__:
    assert getattr(replicator, name).__doc__, f"replicator.{name} has no docstring"


def test_replicator_methods_documented():
  for name in ("context", "run", "explain", "reduce", "gather", "wrap_optimizer", "all_reduce",
               "all_sum", "broadcast", "all_gather", "replica_id", "num_replicas", "devices", "mesh",
               "batch_axes", "num_input_pipelines", "input_pipeline", "layout_spec"):
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
