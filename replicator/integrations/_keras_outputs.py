"""Layout-map keys for Keras layers' outputs (``"<layer path>/output"``), applied in global-view steps.

After each layer's ``call``, Keras 3 asks the distribution that is set for
the layout of ``"<layer path>/output"`` and, if it has one, calls
``distribute_tensor(outputs, layout)``: on JAX a sharding constraint. Here
that is ``Replicator.with_layout`` while a global-view step is traced, and
the value itself elsewhere (eagerly, in the local view, while a functional
model is built). Either way in:

* a Keras distribution (after ``replicator.enable_keras_distribution()``, a
  ``ModelParallel`` whose ``LayoutMap`` has output keys): Keras looks the
  key up in its map, and its TensorFlow backend's ``distribute_tensor``
  (:func:`distribute_tensor`, which that backend lacks) states the layout;
* a Replicator given a layout map with output keys (``Replicator(layouts=)``,
  ``repl.context(layouts=)``) and no Keras distribution: while its step is
  traced, Keras's distribution is an :class:`_OutputLayouts`, which answers
  ``get_tensor_layout`` from those keys (a layer's call asks nothing else of
  it), unset after the trace. A key that matched no layer's output in the
  step is reported (a warning; ``mesh.LayoutError`` with ``strict=True``).

Private Keras API, in this module only (Keras 3.15.1; tests/test_keras_outputs.py
fails if it changes): the distribution lives in Keras's global state
(``keras.src.backend.common.global_state``, attribute ``"distribution"``,
which ``keras.distribution.distribution()`` reads; ``set_distribution`` is not
used, as it would also make a strategy current), and ``distribute_tensor`` is
added to the TensorFlow backend's ``distribution_lib`` module.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

from replicator.core import _context
from replicator.core import _layout_constraint
from replicator.core import _primitives
from replicator.state import _layout_check

_ATTRIBUTE = "distribution"  # Keras's global state attribute holding the distribution set
_reported: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # replicator -> output keys reported


def distribute_tensor(tensor, layout):
  """``keras.distribution.distribute_tensor`` on TensorFlow: ``with_layout`` in a global-view trace, else ``tensor``."""
  if _context.current_global_trace() is None or layout is None:
    return tensor
  return _layout_constraint.with_layout(None, tensor, getattr(layout, "axes", layout),
                                        location=_primitives.user_location())


class _OutputLayouts:
  """What Keras's layers ask of a distribution in their call: the layout of a layer's output, from a layout map."""

  def __init__(self, layouts):
    self.layouts = layouts
    self.paths: list = []  # the layers whose outputs were asked for

  def get_tensor_layout(self, path: str):
    layer = path[:-len("/output")] if path.endswith("/output") else path
    self.paths.append(layer)
    found = self.layouts.output_match(layer)
    return None if found is None else found[1]


def _install_backend() -> None:
  backend = sys.modules.get("keras.src.backend.tensorflow.distribution_lib")
  if backend is not None and not hasattr(backend, "distribute_tensor"):
    backend.distribute_tensor = distribute_tensor


@contextlib.contextmanager
def output_layouts(replicator):
  """While ``replicator``'s step is traced, Keras's layers lay out their outputs by its map's output keys."""
  layouts = replicator.layouts
  state = sys.modules.get("keras.src.backend.common.global_state")
  if layouts is None or not layouts.output_keys() or state is None or state.get_global_attribute(_ATTRIBUTE):
    yield  # (no output keys; or Keras not in use; or a Keras distribution set, which Keras asks itself)
    return
  _install_backend()
  answering = _OutputLayouts(layouts)
  state.set_global_attribute(_ATTRIBUTE, answering)
  try:
    yield
  finally:
    state.set_global_attribute(_ATTRIBUTE, None)
  if answering.paths:
    _layout_check.check_outputs(layouts, sorted(set(answering.paths)), _reported.setdefault(replicator, set()),
                                replicator.strict)


_context.add_trace_hook(output_layouts)
