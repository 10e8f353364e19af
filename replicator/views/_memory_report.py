"""The memory report of a built step (``repl.memory``, and the memory section of ``repl.explain``).

The views build a step's ``GraphDef`` (the local view's per-replica graph,
the global view's partition); :func:`rewrite.analyze_memory` reads it. What this
module adds is what only the Replicator knows: the bytes of the variables and
optimizer slots each device holds (the components of the variables the step
captures), each op's user source line, and in the global view each tensor's
layout.
"""

from __future__ import annotations

import mesh as mesh_lib
import rewrite
from replicator.state import _variables
from rewrite import _expansion
from rewrite import _partition_report

VARIABLES_NOTE = ("variables+slots: the components of the Replicator's variables the step reads or writes, on their "
                  "devices (a variable made outside the Replicator is not counted)")


class Once:
  """A report made on first use (``repl.explain`` returns at once; printing it or ``.memory`` makes it)."""

  def __init__(self, make):
    self._make, self._value = make, None

  def __call__(self):
    if self._value is None:
      self._value, self._make = self._make(), None
    return self._value


def variable_bytes(captures) -> dict[str, int]:
  """Device -> bytes of the Replicator's variable components among a step's captured values."""
  totals: dict[str, int] = {}
  seen = set()
  for _, value in captures.items():
    component = _variables.component_of(value)
    if component is None or id(component) in seen:
      continue
    seen.add(id(component))
    device = mesh_lib.canonical_name(component.device)
    totals[device] = totals.get(device, 0) + component.shape.num_elements() * component.dtype.size
  return totals


def variable_shapes(captures) -> dict:
  """Each captured handle's tensor name -> its variable component's shape (its reads' shape)."""
  shapes = {}
  for name, value in captures.items():
    component = _variables.component_of(value)
    if component is not None:
      shapes[name] = component.shape
  return shapes


def _located(locate):
  def describe(node: str) -> str:
    found = locate(node) if locate is not None else None
    return found[1] if found else ""
  return describe


def _devices(replicator, config) -> list[str]:
  return [mesh_lib.canonical_name(replicator.devices[r]) for r in config.local_replicas]


def later(step, replicator, config, view: str) -> Once:
  """The memory report of a built step (a ``CompiledStep``, a ``GlobalStep``), made on first use.

  It keeps what it reads of the step (its graph, captures, locator and, in the global view, its layouts), not
  the step: the step keeps the report, and the report outlives it when the step is rebuilt or released.
  """
  graph_def, captures, locate, outputs = step.graph_def, step.captures, step.locate, step.output_names
  devices = _devices(replicator, config)
  layouts = step.partition.layouts if view == "global" else {}

  def layout_of(tensor: str) -> str:
    original = _expansion.global_name(tensor)
    layout = layouts.get(original) if original is not None else None
    return _partition_report.format_layout(layout) if layout is not None else ""

  return Once(lambda: rewrite.analyze_memory(
      graph_def, base_bytes=variable_bytes(captures), variable_shapes=variable_shapes(captures),
      device_of=mesh_lib.canonical_name, describe=_located(locate), layout_of=layout_of, outputs=outputs,
      devices=devices, view=view, notes=(VARIABLES_NOTE,)))
