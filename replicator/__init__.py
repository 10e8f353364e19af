"""replicator: run a single-device TensorFlow 2 training step on many devices.

Examples:
  >>> import replicator
  >>> repl = replicator.Replicator(devices=["cpu:0", "cpu:1"])
  >>> repl.num_replicas
  2
"""

import importlib as _importlib
import typing as _typing

from replicator._version import __version__ as __version__  # re-exported

if _typing.TYPE_CHECKING:  # what type checkers, IDEs and the API docs (griffe) read; at run time, __getattr__ below
  from mesh import virtual_cpus
  from replicator import testing
  from replicator._keras_hooks import distribution_replicator
  from replicator._keras_hooks import enable_keras_distribution
  from replicator._machine import calibrate
  from replicator._multiworker import MultiWorkerReplicator
  from replicator._replicator import Replicator
  from replicator.core._context import current
  from replicator.core._errors import ArgumentError
  from replicator.core._errors import ArgumentTypeError
  from replicator.core._errors import CheckpointDamagedError
  from replicator.core._errors import ClusterConfigError
  from replicator.core._errors import CollectiveInControlFlowError
  from replicator.core._errors import CollectiveMismatchError
  from replicator.core._errors import DeviceError
  from replicator.core._errors import EndOfInput
  from replicator.core._errors import InputMismatchError
  from replicator.core._errors import OutputMismatchError
  from replicator.core._errors import ReplicaContextError
  from replicator.core._errors import ReplicaInvarianceError
  from replicator.core._errors import ReplicasDivergedError
  from replicator.core._errors import ReplicatorError
  from replicator.core._errors import StepFailedError
  from replicator.core._errors import UnreplicatedStateError
  from replicator.core._errors import UnsupportedError
  from replicator.core._errors import VariableCreationError
  from replicator.core._errors import WorkerUnavailableError
  from replicator.core._pipeline import pipeline_variables
  from replicator.core._sequence import pad_sequence
  from replicator.core._sequence import sequence_positions
  from replicator.core._sequence import shard_sequence
  from replicator.core._sequence import unshard_sequence
  from replicator.core._stacked_pipeline import stacked_pipeline
  from replicator.core._values import PerReplica
  from replicator.input._inputs import InputContext
  from replicator.integrations._batch_norm import CrossReplicaBatchNorm
  from replicator.integrations._keras_pipeline import PipelineModel
  from replicator.integrations._keras_stacked import StackedBlocks
  from replicator.integrations._keras_stages import split_stages
  from replicator.integrations._pipeline_plan import PipelineCandidate
  from replicator.integrations._pipeline_plan import PipelinePlan
  from replicator.integrations._pipeline_plan import plan_pipeline
  from replicator.integrations._remat import remat
  from replicator.state._optimizer import ReplicatedOptimizer
  from replicator.state._variables import ReplicatedVariable
  from replicator.state._variables import bytes_per_device

__all__ = (
    "ArgumentError",
    "ArgumentTypeError",
    "CheckpointDamagedError",
    "ClusterConfigError",
    "CollectiveInControlFlowError",
    "CollectiveMismatchError",
    "CrossReplicaBatchNorm",
    "DeviceError",
    "EndOfInput",
    "InputContext",
    "InputMismatchError",
    "MultiWorkerReplicator",
    "OutputMismatchError",
    "PerReplica",
    "PipelineCandidate",
    "PipelinePlan",
    "PipelineModel",
    "ReplicaContextError",
    "ReplicasDivergedError",
    "ReplicaInvarianceError",
    "ReplicatedOptimizer",
    "ReplicatedVariable",
    "Replicator",
    "ReplicatorError",
    "StackedBlocks",
    "StepFailedError",
    "UnreplicatedStateError",
    "UnsupportedError",
    "VariableCreationError",
    "WorkerUnavailableError",
    "bytes_per_device",
    "calibrate",
    "current",
    "distribution_replicator",
    "enable_keras_distribution",
    "pad_sequence",
    "pipeline_variables",
    "plan_pipeline",
    "remat",
    "sequence_positions",
    "shard_sequence",
    "split_stages",
    "stacked_pipeline",
    "testing",
    "unshard_sequence",
    "virtual_cpus",
)

# The public names are imported on first use (PEP 562), each from its module (as above): `import replicator`
# imports no TensorFlow, so `python -m replicator.launch`, which runs this file first, starts in a fraction of a
# second. The errors print as replicator.VariableCreationError where they are defined (core/_errors.py,
# mesh/_errors.py).
_MODULES = {
    "mesh": ("virtual_cpus",),
    "replicator._keras_hooks": ("distribution_replicator", "enable_keras_distribution"),
    "replicator._machine": ("calibrate",),
    "replicator._multiworker": ("MultiWorkerReplicator",),
    "replicator._replicator": ("Replicator",),
    "replicator.core._context": ("current",),
    "replicator.core._errors": (
        "ArgumentError", "ArgumentTypeError", "CheckpointDamagedError", "ClusterConfigError",
        "CollectiveInControlFlowError", "CollectiveMismatchError", "DeviceError", "EndOfInput", "InputMismatchError",
        "OutputMismatchError", "ReplicaContextError", "ReplicaInvarianceError", "ReplicasDivergedError",
        "ReplicatorError", "StepFailedError", "UnreplicatedStateError", "UnsupportedError", "VariableCreationError",
        "WorkerUnavailableError"),
    "replicator.core._pipeline": ("pipeline_variables",),
    "replicator.core._sequence": ("pad_sequence", "sequence_positions", "shard_sequence", "unshard_sequence"),
    "replicator.core._stacked_pipeline": ("stacked_pipeline",),
    "replicator.core._values": ("PerReplica",),
    "replicator.input._inputs": ("InputContext",),
    "replicator.integrations._batch_norm": ("CrossReplicaBatchNorm",),
    "replicator.integrations._keras_pipeline": ("PipelineModel",),
    "replicator.integrations._keras_stacked": ("StackedBlocks",),
    "replicator.integrations._keras_stages": ("split_stages",),
    "replicator.integrations._pipeline_plan": ("PipelineCandidate", "PipelinePlan", "plan_pipeline"),
    "replicator.integrations._remat": ("remat",),
    "replicator.state._optimizer": ("ReplicatedOptimizer",),
    "replicator.state._variables": ("ReplicatedVariable", "bytes_per_device"),
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}
# What importing the package did for the program before any name was used, done at the first use of any: the
# Keras registrations of CrossReplicaBatchNorm, StackedBlocks and of replicator.remat's layer
# ("replicator>CrossReplicaBatchNorm", "replicator>StackedBlocks", "replicator>Remat", which keras.saving.load_model
# looks up).
_AT_FIRST_USE = ("replicator.integrations._batch_norm", "replicator.integrations._keras_stacked",
                 "replicator.integrations._remat")


def __getattr__(name: str):
  if name == "testing":
    value = _importlib.import_module("replicator.testing")
  elif name in _MODULE_OF:
    value = getattr(_importlib.import_module(_MODULE_OF[name]), name)
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  for module in _AT_FIRST_USE:
    _importlib.import_module(module)
  globals()[name] = value  # found without __getattr__ from now on
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
