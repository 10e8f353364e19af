"""The eager values a step's graph reads, fed as few inputs as possible.

Every variable a replicated step touches (each replica's component, each
optimizer slot, each collective's ordering token) is a resource handle the
step's function captures, and a function call pays for every input it is
passed: 3.3-3.9 us per handle on TF 2.21 CPU (``python -m benchmarks.breakdown
call``). A 4-replica step of a 16-layer MLP with Adam captures 200 handles;
passed one by one they cost 0.86-0.99 ms per call against 0.20 ms for a call
with none.

So the handles that live on one device are stacked, once, into one rank-1
resource tensor on that device (``tf.stack``), and the graph takes them apart
again on the same device (``tf.unstack``): a call passes one tensor per device
(0.26-0.28 ms for the same 200 handles on 4 devices). Ops that use an unstacked
handle are placed with it, on the handle's own device, as they would be with
the handle passed directly. Only public ops are involved.
"""

from __future__ import annotations

import tensorflow as tf

import rewrite
from replicator.state import _variables


def capture(t: tf.Tensor) -> tf.Tensor:
  """The current function graph's placeholder for eager tensor ``t`` (captures it)."""
  return tf.identity(t).op.inputs[0]


class Captures:
  """Maps the step graph's captured tensors to eager values, stacking handles per device.

  Args:
    captures: ``(name of the tensor in the step's graph, eager value)`` pairs.
  """

  def __init__(self, captures: list[tuple[str, tf.Tensor]]):
    self.direct: list[tuple[str, tf.Tensor]] = []
    by_device: dict[str, list[tuple[str, tf.Tensor]]] = {}
    for name, value in captures:
      if _stackable(value):
        by_device.setdefault(value.device, []).append((name, value))
      else:
        self.direct.append((name, value))
    self.stacks: list[tuple[str, list[str], tf.Tensor]] = []  # (device, names, stacked handles)
    self._values: dict[str, tf.Tensor] = dict(captures)
    with tf.init_scope():
      for device, members in by_device.items():
        if len(members) == 1:
          self.direct.extend(members)
          continue
        with tf.device(device):
          stacked = tf.stack([value for _, value in members])
        self.stacks.append((device, [name for name, _ in members], stacked))

  def with_read_shapes(self, graph_def):
    """``graph_def`` with each read of a stacked handle followed by ``EnsureShape`` of its variable's shape.

    The handles of the variables the Replicator made (every variable a step
    writes) are checked; a variable made elsewhere keeps reads of unknown shape.

    A variable's handle carries its shape, from which TensorFlow infers the
    shape of a read, and Grappler, which rewrites only what it can shape,
    reads it from the function's arguments. A handle taken out of a stack has
    none there, so its reads and every op after them would be of unknown
    shape: on a KerasHub Qwen step (2x2) 3,018 of 7,095 ops were, the layer
    norms' gradients kept ``Pow(x, 1)`` (an identity where shapes are known)
    and the step took 1.60 of one device's time against 1.38 with the
    handles passed one by one. ``EnsureShape`` states the shape again
    (``tf.ensure_shape``; a check at run time, one cheap op per read).

    Each check comes right after its read, under the read's name (its uses
    read the check): the nodes keep their order, which is the order in which
    the function importing them makes its ops, and so the order in which it
    sequences the uses of each variable (a check appended at the end moved
    the ops using the reads after it, and a Keras step lost its updates;
    ``rewrite.shape_reads``).
    """
    shapes = {}
    for _, names, _ in self.stacks:
      for name in names:
        component = _variables.component_of(self._values[name])  # the Replicator's variables: their shapes
        if _shape_checked(component):
          shapes[_node_of(name)] = component.shape.as_proto()
    return rewrite.shape_reads(graph_def, shapes)

  def items(self) -> list[tuple[str, tf.Tensor]]:
    """Every ``(step graph tensor name, eager value)`` pair, as given."""
    return list(self._values.items())

  @property
  def num_inputs(self) -> int:
    """How many tensors a call passes for these captures."""
    return len(self.direct) + len(self.stacks)

  def input_map(self, gate=None) -> dict[str, tf.Tensor]:
    """Step graph tensor name -> its value in the function graph being built.

    Captures the eager values into that graph; handles are unstacked on their
    own device.

    Args:
      gate: optional ``gate(handles) -> ops``: given ``{name: handle}`` of the
        captures on one device, the ops the step's uses of them must wait for
        (none by default). The handles given to ``gate`` are not gated.
    """
    gate = gate or (lambda handles: [])
    mapping = {}
    direct: dict[str, dict[str, tf.Tensor]] = {}  # device -> {name: captured value}
    for name, value in self.direct:
      direct.setdefault(value.device, {})[name] = capture(value)
    stacks = {device: (names, stacked) for device, names, stacked in self.stacks}
    for device in list(direct) + [d for d in stacks if d not in direct]:
      with tf.device(device):
        handles = dict(direct.get(device, {}))
        whole = None
        if device in stacks:
          names, stacked = stacks[device]
          whole = capture(stacked)
          handles.update(zip(names, tf.unstack(whole, num=len(names))))
        waits = gate(handles)
        if not waits:
          mapping.update(handles)
          continue
        with tf.control_dependencies(waits):  # one wait for the device's stacked handles: unstacked again after it
          mapping.update((name, tf.identity(h)) for name, h in direct.get(device, {}).items())
          if whole is not None:
            mapping.update(zip(names, tf.unstack(tf.identity(whole), num=len(names))))
    return mapping


def into_current_graph(mapping: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  """``mapping`` with each tensor of an enclosing graph captured into the current one (a loop's body, a branch)."""
  graph = tf.compat.v1.get_default_graph()
  return {name: t if t.graph is graph else tf.identity(t) for name, t in mapping.items()}


def _shape_checked(component) -> bool:
  """Whether reads of ``component`` (a variable's piece, or None) get :meth:`Captures.with_read_shapes`'s check.

  Trainable variables only: the model's forward and backward pass read them,
  where Grappler needs shapes. Slots and counters feed elementwise updates,
  which it rewrites alike with shapes or without. Measured on 2 cores: a 2x4
  transformer's global-view build (Adam: two slots a weight) took 4.4-4.6 s
  checking every read, 3.8-4.3 s checking the trainable ones, 3.8-4.1 s with
  no checks (fresh processes, alternating, four each); KerasHub Qwen's 2x2
  step was 1.00 [0.99, 1.02] of the every-read version's (1.12 unchecked).
  """
  return component is not None and component.trainable and component.shape.rank is not None


def _node_of(tensor_name: str) -> str:
  return tensor_name.split(":")[0]


def _stackable(value) -> bool:
  """An eager scalar resource handle on a CPU device.

  CPUs only: ``Pack``/``Unpack`` of resource handles have CPU kernels, and on
  an accelerator soft placement would move the unstacking (and with it every
  op using the handles) off the variable's device. Accelerator handles are
  passed as they are.
  """
  return (value.dtype == tf.resource and not tf.is_symbolic_tensor(value)
          and value.shape.rank == 0 and bool(value.device)
          and tf.DeviceSpec.from_string(value.device).device_type == "CPU")
