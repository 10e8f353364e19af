"""Errors raised by the mesh package."""


class MeshError(ValueError):
  """A mesh, its axes or its devices are inconsistent."""


class DeviceError(MeshError):
  """A device string is unknown, duplicated, or devices cannot be configured."""


class LayoutError(MeshError):
  """A layout cannot be used: unknown or reused mesh axes, or dimensions that do not divide."""
