"""Graph rewriting: from per-replica placeholders to cross-device collectives.

The pass has two separately testable halves:

* :func:`plan` matches the :class:`Placeholder` records of all replicas, checks
  that replicas agree, and picks a :class:`Lowering` for each collective.
* :func:`apply` rewrites a ``GraphDef``, splicing in each lowering's ops and
  rewiring the placeholders' consumers.

Between them, :func:`fuse` may make independent all-reduces across processes
one (each collective op across processes pays a round trip).

:class:`PartitionReport` says what a partition of a global graph does (the
global view's ``repl.explain``): layouts, collectives by op, relayouts, fallbacks.
:func:`analyze_memory` says what a step's graph holds per device (``repl.memory``):
a :class:`MemoryReport` of saved-for-backward tensors and the peak of live bytes.
:func:`merge_reads` merges a rewritten step's reads that no execution could
tell apart, so that Grappler can fold what follows them.

This package knows nothing about Keras or about how a step was traced.
"""

from rewrite import _collective_ops  # registers "collective_ops"
from rewrite import _hierarchical  # registers "hierarchical"
from rewrite import _one_device  # registers "one_device"
from rewrite._apply import Rewritten
from rewrite._apply import apply
from rewrite._collective_ops import ordering_token
from rewrite._errors import CollectiveMismatchError
from rewrite._errors import RewriteError
from rewrite._fusion import OVERLAP_BYTES
from rewrite._fusion import fuse
from rewrite._fusion import overlap_split
from rewrite._idle_calls import without_idle
from rewrite._lowering import AgreedKeys
from rewrite._lowering import Lowering
from rewrite._lowering import LoweringContext
from rewrite._lowering import auto as auto_lowering
from rewrite._lowering import get as get_lowering
from rewrite._lowering import names as lowering_names
from rewrite._lowering import register as register_lowering
from rewrite._lowering import task_of
from rewrite._memory import DeviceMemory
from rewrite._memory import LiveTensor
from rewrite._memory import MemoryReport
from rewrite._memory import SavedTensor
from rewrite._memory import analyze as analyze_memory
from rewrite._partition_report import PartitionReport
from rewrite._placeholders import KINDS
from rewrite._placeholders import Placeholder
from rewrite._placeholders import emit
from rewrite._plan import Collective
from rewrite._plan import Plan
from rewrite._plan import plan
from rewrite._reads import merge_reads
from rewrite._reads import renamed_tensor
from rewrite._reads import small_reads
from rewrite._shaped_reads import shape_reads

for _error in (CollectiveMismatchError, RewriteError):  # printed as rewrite.RewriteError, not rewrite._errors...
  _error.__module__ = __name__
del _error

CollectiveOps = _collective_ops.CollectiveOps
Hierarchical = _hierarchical.Hierarchical
OneDevice = _one_device.OneDevice
del _collective_ops, _hierarchical, _one_device

__all__ = (
    "KINDS",
    "OVERLAP_BYTES",
    "AgreedKeys",
    "Collective",
    "CollectiveMismatchError",
    "CollectiveOps",
    "DeviceMemory",
    "Hierarchical",
    "LiveTensor",
    "Lowering",
    "LoweringContext",
    "MemoryReport",
    "OneDevice",
    "PartitionReport",
    "Placeholder",
    "Plan",
    "RewriteError",
    "Rewritten",
    "SavedTensor",
    "analyze_memory",
    "apply",
    "auto_lowering",
    "without_idle",
    "emit",
    "fuse",
    "get_lowering",
    "lowering_names",
    "merge_reads",
    "ordering_token",
    "overlap_split",
    "plan",
    "register_lowering",
    "renamed_tensor",
    "shape_reads",
    "small_reads",
    "task_of",
)
