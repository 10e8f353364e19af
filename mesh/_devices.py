"""Finding, naming and configuring the devices a mesh is laid over."""

from __future__ import annotations

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


def virtual_cpus(n: int) -> list[str]:
  """Splits the host CPU into ``n`` logical CPU devices.

  Lets a machine without accelerators run several replicas (each logical CPU is
  a separate TensorFlow device sharing the same cores). Must be called before
  TensorFlow initialises its devices; calling it again with the same ``n`` is a
  no-op.

  Args:
    n: number of logical CPUs, at least 1.

  Returns:
    The logical CPU device names.

  Raises:
    DeviceError: ``n`` is not a positive integer, or the devices were already
      initialised with a different count.
  """
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise _errors.DeviceError(f"virtual_cpus(n) needs a positive integer n, but found {n!r}.")
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
  except RuntimeError as e:
    found = len(tf.config.list_logical_devices("CPU"))
    if found != n:
      raise _errors.DeviceError(VIRTUAL_CPUS_TOO_LATE.format(n=n, found=found)) from e
  return local_devices("CPU")
