"""The lowering interface: how a matched collective becomes real TensorFlow ops.

A :class:`Lowering` builds, for one device group of one collective, the ops
that take each member's input on its device and produce each member's result
on its device. Lowerings are registered by name; the plan picks one per
collective. New implementations (mesh-axis, multi-worker, NCCL) plug in here
without touching the rewrite pass.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import itertools
import random
import threading
from collections.abc import Mapping
from collections.abc import Sequence

import tensorflow as tf

from rewrite import _errors
from rewrite._plan import Collective

_REGISTRY: dict[str, "Lowering"] = {}
# Keys start at a random offset: a new client process must not reuse the group
# keys an earlier client used on long-lived workers (their resolved groups
# remember the old devices). int32 attributes, so stay below 2**31.
_KEYS = itertools.count(random.SystemRandom().randrange(1, 2**30))
_KEYS_LOCK = threading.Lock()


def new_key() -> int:
  """A process-wide unique integer (for collective group and instance keys)."""
  with _KEYS_LOCK:
    return next(_KEYS)


class ProcessKeys:
  """Collective keys for one process that builds every member's op (one client): counted, never reused."""

  def __init__(self):
    self._groups: dict[tuple[str, ...], int] = {}
    self._lock = threading.Lock()

  def group_key(self, devices: Sequence[str]) -> int:
    """One key per device list."""
    with self._lock:
      key = tuple(devices)
      if key not in self._groups:
        self._groups[key] = new_key()
      return self._groups[key]

  def instance_key(self, group_key: int, collective: Collective, part: str = "") -> int:  # pylint: disable=unused-argument
    """A new key for every instance."""
    return new_key()


KEY_COLLISION = (
    "Two different collectives of this job drew the same collective key {key} ({what}): {a} and {b}. The keys are "
    "hashed so that every process of a multi-client job draws the same ones without talking; this is the rare "
    "collision of two hashes. Fix: change the step slightly (the order of two collectives) or report it."
)


class AgreedKeys:
  """Collective keys every process of a multi-client job computes alike, without talking to the others.

  Each process builds only its own devices' ops, so the members of one
  collective are made by different processes, which must choose the same
  group and instance keys. Counting keys in build order (as
  MultiWorkerMirroredStrategy does) breaks as soon as one process builds a
  step the others do not (``repl.explain`` on worker 0 only, a short last
  batch's step); here keys are hashes of what every process knows alike:

  * group key: the group's devices (job-wide names, so equal in every process);
  * instance key: the group key, the collective's position in its step, its
    kind, parameters, dtype and shape (two steps with the same collective at
    the same position share a key, which is safe: the instance is the same).

  Keys live in ``[2**30, 2**31)``, apart from single-client counters' usual
  range. A collision between two different collectives in this process is a
  named error (:data:`KEY_COLLISION`) instead of a wrong shape at run time.
  """

  _LOW = 2**30

  def __init__(self):
    self._seen: dict[tuple[str, int], str] = {}
    self._lock = threading.Lock()

  def _hash(self, what: str, text: str) -> int:
    key = self._LOW + int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % self._LOW
    with self._lock:
      earlier = self._seen.setdefault((what, key), text)
    if earlier != text:
      raise _errors.RewriteError(KEY_COLLISION.format(key=key, what=what, a=earlier, b=text))
    return key

  def group_key(self, devices: Sequence[str]) -> int:
    return self._hash("group", "|".join(devices))

  def instance_key(self, group_key: int, collective: Collective, part: str = "") -> int:
    shape = None if collective.shape.rank is None else collective.shape.as_list()
    return self.named_key(group_key, f"{collective.index}|{collective.describe()}|{collective.dtype.name}|{shape}|{part}")

  def named_key(self, group_key: int, name: str) -> int:
    """The instance key of group ``group_key`` for what every process calls ``name``."""
    return self._hash(f"instance of group {group_key}", f"{group_key}|{name}")


class LoweringContext:
  """What a lowering may ask of the rewrite pass while it builds ops.

  Lowerings build ops in a template graph that is spliced into the step's
  graph. Values that must come from outside the step graph (such as
  per-device ordering tokens) are requested with :meth:`external`: the
  lowering gets a placeholder now, and the rewrite pass feeds the value the
  lowering's :meth:`Lowering.external_value` returns for that key.
  """

  def __init__(self):
    self.externals: dict[str, tf.Tensor] = {}

  def external(self, key: str, dtype: tf.DType, shape=()) -> tf.Tensor:
    """A template placeholder that will be fed the lowering's value for ``key``."""
    if key not in self.externals:
      self.externals[key] = tf.compat.v1.placeholder(dtype, shape, name="external")
    return self.externals[key]


class Lowering(abc.ABC):
  """One way of implementing collectives.

  Attributes:
    name: registry name, shown by ``repl.explain``.
    ordered_op_types: op types that block until every group member runs them.
      The rewrite pass chains such ops on each device in plan order, so that all
      devices launch them in the same order (otherwise they could deadlock).
  """

  name: str = ""
  ordered_op_types: frozenset[str] = frozenset()
  # Whether lower_group takes groups some of whose members another process builds (their inputs None).
  partial_groups: bool = False
  # Whether its all-reduces across tasks gain from being fused into one (rewrite.fuse): each op pays a round trip.
  fusible: bool = False

  def supports(self, collective: Collective) -> bool:  # pylint: disable=unused-argument
    """Whether this lowering can implement ``collective``."""
    return True

  def cache_key(self, collective: Collective) -> tuple | None:
    """Key under which a built template may be reused; None disables reuse."""
    return (collective.kind, collective.params, collective.dtype, tuple(collective.shape.as_list())
            if collective.shape.rank is not None else None, collective.group_size)

  @abc.abstractmethod
  def lower_group(self, collective: Collective, inputs: Sequence[tf.Tensor],
                  devices: Sequence[str], ctx: LoweringContext) -> list[tf.Tensor]:
    """Builds the collective for one device group in the current graph.

    Args:
      collective: the matched collective (kind, params, dtype, shape).
      inputs: each group member's input, placed on its device, in group order;
        None for a member another process builds (only lowerings with
        ``partial_groups`` get such groups).
      devices: each member's device, in group order (every member's).
      ctx: the lowering context.

    Returns:
      Each member's result, in group order (None where the input was None).
    """

  def external_value(self, key: str) -> tf.Tensor:
    """The eager value fed for a key requested with :meth:`LoweringContext.external`."""
    raise KeyError(f"Lowering {self.name!r} requested external {key!r} but cannot provide it.")


def register(lowering: Lowering) -> Lowering:
  """Registers ``lowering`` under its name (replacing any previous one)."""
  if not lowering.name:
    raise _errors.ArgumentError("A lowering needs a non-empty `name`.")
  _REGISTRY[lowering.name] = lowering
  return lowering


def get(name: str) -> Lowering:
  """The registered lowering called ``name``."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise _errors.ArgumentError(
        f"Unknown collective implementation {name!r}. Registered implementations: "
        f"{sorted(_REGISTRY)}. Fix: use one of those names, or 'auto'.") from None


def of(collective: Collective, lowerings: Mapping[str, Lowering] | None = None) -> Lowering:
  """The lowering that implements ``collective``: ``lowerings``' instance of its name, else the registered one."""
  return (lowerings or {}).get(collective.implementation) or get(collective.implementation)


def names() -> list[str]:
  """Names of the registered lowerings."""
  return sorted(_REGISTRY)


def auto(collective: Collective) -> str:
  """The default choice, per collective.

  * Within one process: "one_device". Measured with ``benchmarks/collectives.py``
    on a 2-core CPU machine (TF 2.21): for all-reduce of 4 KB to 64 MB per
    replica on 4 and 8 logical CPUs, it took 1/3 to 1/11 of collective_ops'
    step time at every size.
  * Groups spanning several tasks (worker processes): "hierarchical" for
    all-reduce and broadcast (one network transfer per worker), else
    "collective_ops".
  """
  devices = collective.all_devices
  spans_tasks = any(len({task_of(devices[r]) for r in group}) > 1 for group in collective.groups)
  if not spans_tasks:
    return "one_device"
  return "hierarchical" if get("hierarchical").supports(collective) else "collective_ops"


@functools.lru_cache(maxsize=1 << 16)  # asked of every device of a job's groups, per collective
def task_of(device: str) -> str:
  """``/job:worker/replica:0/task:1`` for a device string of that task."""
  return tf.DeviceSpec.from_string(device).replace(device_type=None, device_index=None).to_string()


def check_group_inputs(collective: Collective, inputs: Sequence[tf.Tensor], devices: Sequence[str]) -> None:
  if len(inputs) != len(devices):
    raise _errors.ArgumentError(f"{collective.describe()}: {len(inputs)} inputs for {len(devices)} devices.")
