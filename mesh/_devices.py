"""Finding, naming and configuring the devices a mesh is laid over."""

from __future__ import annotations

import os
from collections.abc import Sequence

import tensorflow as tf

from mesh import _errors

_PREFERRED_TYPES = ("TPU", "GPU", "CPU")

UNKNOWN_DEVICE = (
    "Unknown device {device!r}{position}. Expected one of the logical devices "
    "TensorFlow knows about: {available}. Fix: pass device strings from that list "
    "(or leave `devices=None` to use all local devices); to get several CPU devices "
    "on one machine, call `replicator.virtual_cpus(n)` at program start."
)
DUPLICATE_DEVICE = (
    "Device {device!r} is listed twice (positions {first} and {second}). Every "
    "replica needs its own device: list each device once."
)
DEVICES_NOT_A_LIST = (
    "`devices` must be a list of device strings, but found {found!r} ({type}). Fix: list the devices, "
    "e.g. devices=mesh.local_devices()[:4] for the first four; to split the CPU into n logical devices, "
    "call replicator.virtual_cpus(n) at program start."
)
VIRTUAL_CPUS_TOO_LATE = (
    "replicator.virtual_cpus({n}) must run before TensorFlow initialises its "
    "devices, but they are already initialised with {found} logical CPU(s). "
    "Fix: call replicator.virtual_cpus({n}) at the very start of the program, "
    "before any tensor, variable, dataset or model is created."
)
THREADS_TOO_LATE = (
    "replicator.virtual_cpus({n}, intra_op_threads={threads}) must run before TensorFlow initialises its "
    "devices, but they are already initialised with {now} intra-op thread(s) (0: TensorFlow's default). "
    "Fix: call it at the very start of the program, before any tensor, variable, dataset or model is created."
)


def local_devices(device_type: str | None = None) -> list[str]:
  """Returns the names of the local logical devices of the preferred type.

  Args:
    device_type: "CPU", "GPU" or "TPU". By default the first type that has any
      devices, in the order TPU, GPU, CPU.

  Returns:
    Canonical device names such as ``"/device:CPU:0"``.

  Examples:
    >>> local_devices("CPU")[0]
    '/device:CPU:0'
  """
  types = (device_type.upper(),) if device_type else _PREFERRED_TYPES
  for kind in types:
    devices = tf.config.list_logical_devices(kind)
    if devices:
      return [canonical_name(d.name) for d in devices]
  return []


def canonical_name(device: str) -> str:
  """Returns the canonical spelling of a device string (``cpu:0`` -> ``/device:CPU:0``)."""
  spec = tf.DeviceSpec.from_string(device)
  if spec.job in (None, "localhost"):
    # Local devices are reported with or without the localhost prefix; drop it
    # so that both spellings name the same device.
    spec = tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index)
  else:
    spec = spec.replace(replica=spec.replica or 0, task=spec.task or 0)
  return spec.to_string()


def resolve(devices: Sequence[str] | None) -> tuple[str, ...]:
  """Validates device strings against TensorFlow's logical devices.

  Args:
    devices: device strings in any spelling TensorFlow accepts, or None for all
      local devices of the preferred type.

  Returns:
    The canonical device names, in the given order.

  Raises:
    DeviceError: a device is unknown, listed twice, or no device is available.
  """
  if devices is None:
    found = local_devices()
    if not found:
      raise _errors.DeviceError("TensorFlow reports no logical devices.")
    return tuple(found)
  if not isinstance(devices, str) and not isinstance(devices, Sequence):
    raise _errors.ArgumentTypeError(DEVICES_NOT_A_LIST.format(found=devices, type=type(devices).__name__))
  if isinstance(devices, str):
    raise _errors.DeviceError(
        f"`devices` must be a list of device strings, but found the single string "
        f"{devices!r}. Fix: wrap it in a list: devices=[{devices!r}].")
  known = {canonical_name(d.name) for d in tf.config.list_logical_devices()}
  resolved = []
  for position, device in enumerate(devices):
    try:
      name = canonical_name(device)
    except (ValueError, TypeError):
      name = None
    if name is None or name not in known:
      raise _errors.DeviceError(UNKNOWN_DEVICE.format(
          device=device, position=f" at position {position}",
          available=", ".join(sorted(known))))
    if name in resolved:
      raise _errors.DeviceError(DUPLICATE_DEVICE.format(
          device=device, first=resolved.index(name), second=position))
    resolved.append(name)
  if not resolved:
    raise _errors.DeviceError("`devices` is empty: give at least one device.")
  return tuple(resolved)


def cores() -> int:
  """The CPU cores this process may run on (its affinity where the system says)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # no sched_getaffinity (macOS, Windows)
    return os.cpu_count() or 1


def intra_op_threads_for(n: int) -> int:
  """Threads a kernel may use when ``n`` logical CPUs share this host's cores (0: TensorFlow's own setting).

  Every logical CPU runs its own ops at the same time, and TensorFlow gives all
  of them one pool of intra-op threads (as many as there are cores) to split a
  kernel over. With several logical CPUs busy at once, each kernel's threads
  compete with the other devices' kernels for the same cores; a pool of
  ``cores // n`` threads (at least one) keeps the threads about the cores
  (measured in :func:`virtual_cpus`'s docstring). 0 where the user chose with
  ``TF_NUM_INTRAOP_THREADS``.
  """
  if n <= 1 or os.environ.get("TF_NUM_INTRAOP_THREADS"):
    return 0
  return max(1, cores() // n)


def virtual_cpus(n: int, *, intra_op_threads: int | None = None) -> list[str]:
  """Splits the host CPU into ``n`` logical CPU devices.

  Lets a machine without accelerators run several replicas (each logical CPU is
  a separate TensorFlow device sharing the same cores). Must be called before
  TensorFlow initialises its devices; calling it again with the same ``n`` is a
  no-op.

  The logical CPUs run their ops at the same time, so one kernel need not
  spread over every core: unless told otherwise (or TensorFlow's intra-op
  threads were already set, by ``tf.config.threading`` or
  ``TF_NUM_INTRAOP_THREADS``), a kernel gets ``cores // n`` threads, at least
  one (TensorFlow's default, one per core, for ``n == 1``). On 2 cores and 4
  logical CPUs this took a KerasHub Qwen step split 2x2 from 55 to 39 ms, and
  its one-device step from 40.9 to 38.2 ms; a one-device step of four times
  the width was 2-9% slower, a wide MLP's 47% (``benchmarks/README.md``). The
  setting is the process's: pass ``intra_op_threads=0`` for TensorFlow's
  default.

  Args:
    n: number of logical CPUs, at least 1.
    intra_op_threads: threads a kernel may use
      (``tf.config.threading.set_intra_op_parallelism_threads``); None: as
      above; 0: TensorFlow's default.

  Returns:
    The logical CPU device names.

  Raises:
    DeviceError: ``n`` is not a positive integer, or the devices were already
      initialised with a different count.
  """
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise _errors.DeviceError(f"virtual_cpus(n) needs a positive integer n, but found {n!r}.")
  if intra_op_threads is not None and (not isinstance(intra_op_threads, int) or isinstance(intra_op_threads, bool)
                                       or intra_op_threads < 0):
    raise _errors.DeviceError(
        f"virtual_cpus(intra_op_threads=...) needs a non-negative integer or None, but found {intra_op_threads!r}. "
        "Fix: pass a number of threads, 0 for TensorFlow's default, or leave it out for cores // n.")
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
  except RuntimeError as e:
    found = len(tf.config.list_logical_devices("CPU"))
    if found != n:
      raise _errors.DeviceError(VIRTUAL_CPUS_TOO_LATE.format(n=n, found=found)) from e
  threads = intra_op_threads
  if threads is None:
    threads = 0 if tf.config.threading.get_intra_op_parallelism_threads() else intra_op_threads_for(n)
  if threads:
    try:
      tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError as e:  # TensorFlow already runs, with another count: an error only if one was asked for
      if intra_op_threads is not None:
        now = tf.config.threading.get_intra_op_parallelism_threads()
        raise _errors.DeviceError(THREADS_TOO_LATE.format(n=n, threads=threads, now=now)) from e
  return local_devices("CPU")
