"""Errors raised by the mesh package."""


class MeshError(ValueError):
  """A mesh, its axes or its devices are inconsistent."""


class DeviceError(MeshError):
  """A device string is unknown, duplicated, or devices cannot be configured."""
