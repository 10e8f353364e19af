"""The apply pass: replace every placeholder node of a GraphDef with its collective.

Works on the serialized graph only (a ``GraphDef``), so it is independent of
how the graph was traced. For each planned collective, the chosen lowering
builds its ops in a small template graph; the template is spliced into the
step's GraphDef with its inputs wired to the members' input tensors, and the
consumers of each placeholder are rewired to the member's result.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

import tensorflow as tf

from rewrite import _errors
from rewrite import _lowering
from rewrite._plan import Collective
from rewrite._plan import Plan

PREFIX = "replicator_rewrite"
_TEMPLATE_CACHE: "collections.OrderedDict[tuple, _Template]" = collections.OrderedDict()
_TEMPLATE_CACHE_SIZE = 512


@dataclasses.dataclass(frozen=True)
class Rewritten:
  """The result of :func:`apply`.

  Attributes:
    graph_def: the graph with every placeholder replaced.
    tensor_map: placeholder output tensor name -> name of the tensor replacing it.
    external_inputs: name of a new placeholder tensor in ``graph_def`` -> the
      eager tensor to feed it (for example per-device ordering tokens).
  """

  graph_def: tf.compat.v1.GraphDef
  tensor_map: dict[str, str]
  external_inputs: dict[str, tf.Tensor]

  def output_name(self, name: str) -> str:
    """Where tensor ``name`` of the traced graph lives after the rewrite."""
    return self.tensor_map.get(name, name)


@dataclasses.dataclass(frozen=True)
class _Template:
  nodes: tuple  # NodeDefs
  inputs: tuple[str, ...]  # template input node names, member order
  outputs: tuple[str, ...]  # template output tensor names, member order
  externals: dict[str, str]  # template placeholder node name -> external key


def _split(ref: str) -> tuple[bool, str, str]:
  """'^a' -> (True, 'a', ''), 'a:1' -> (False, 'a', '1'), 'a' -> (False, 'a', '0')."""
  if ref.startswith("^"):
    return True, ref[1:], ""
  name, _, port = ref.partition(":")
  return False, name, port or "0"


def _remap(ref: str, inputs: dict[str, str], renamed: dict[str, str], scope: str) -> str:
  """Where template input ``ref`` points after splicing under ``scope``."""
  control, name, port = _split(ref)
  if name in inputs:
    _, iname, iport = _split(inputs[name])
    return f"^{iname}" if control else f"{iname}:{iport}"
  target = renamed.get(name, f"{scope}/{name}")
  return f"^{target}" if control else f"{target}:{port}"


def _build_template(lowering: _lowering.Lowering, collective: Collective, group: tuple[int, ...]) -> _Template:
  graph = tf.Graph()
  ctx = _lowering.LoweringContext()
  with graph.as_default():
    inputs, devices = [], []
    for position, replica in enumerate(group):
      member = collective.members[replica]
      device = member.device if member is not None else collective.all_devices[replica]
      if member is None:  # another process builds this member (a multi-client job)
        inputs.append(None)
      else:
        with tf.device(device):
          inputs.append(tf.compat.v1.placeholder(
              collective.dtype, member.input_shape, name=f"input_{position}"))
      devices.append(device)
    results = lowering.lower_group(collective, inputs, devices, ctx)
    if len(results) != len(group):
      raise _errors.RewriteError(
          f"Lowering {lowering.name!r} returned {len(results)} results for a group of {len(group)}.")
    outputs = []
    for position, (y, device) in enumerate(zip(results, devices)):
      if inputs[position] is None:
        continue
      if y.device and tf.DeviceSpec.from_string(y.device) == tf.DeviceSpec.from_string(device):
        outputs.append(y.name)  # made on its member's device already (a copy there, a collective op)
        continue
      with tf.device(device):
        outputs.append(tf.identity(y, name=f"output_{position}").name)
  externals = {t.op.name: key for key, t in ctx.externals.items()}
  return _Template(nodes=tuple(graph.as_graph_def().node), inputs=tuple(i.op.name for i in inputs if i is not None),
                   outputs=tuple(outputs), externals=externals)


def _template(lowering, collective, group) -> _Template:
  key = lowering.cache_key(collective)
  if key is None:
    return _build_template(lowering, collective, group)
  key = (lowering.name, key, tuple(collective.members[r].device for r in group))  # (full groups only)
  template = _TEMPLATE_CACHE.get(key)
  if template is None:
    template = _build_template(lowering, collective, group)
    _TEMPLATE_CACHE[key] = template
    while len(_TEMPLATE_CACHE) > _TEMPLATE_CACHE_SIZE:
      _TEMPLATE_CACHE.popitem(last=False)
  return template


def apply(graph_def: tf.compat.v1.GraphDef, plan: Plan,
          lowerings: Mapping[str, _lowering.Lowering] | None = None) -> Rewritten:
  """Replaces every placeholder in ``graph_def`` with its planned collective.

  Args:
    graph_def: the traced step, holding the placeholder nodes named in ``plan``.
    plan: the plan from :func:`rewrite.plan`.
    lowerings: lowering instances to use by name instead of the registered
      ones (say, collective ops with a timeout for one multi-worker run).

  Returns:
    The rewritten graph and how its tensors map to the traced graph's.

  Raises:
    RewriteError: a placeholder named in the plan is missing, or one survives.
  """
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  existing = {n.name for n in graph_def.node}
  placeholders = {m.node: m for c in plan.collectives for m in c.present}
  missing = set(placeholders) - existing
  if missing:
    raise _errors.RewriteError(f"Placeholder nodes {sorted(missing)} are not in the graph.")
  prefix = PREFIX
  while any(n.startswith(prefix + "/") for n in existing):
    prefix += "_"

  # Each group's collective goes where its last member's placeholder was (externals first): the graph keeps
  # the order its ops were made in, which an importing function follows to order variable reads and writes.
  position = {n.name: i for i, n in enumerate(graph_def.node) if n.name in placeholders}
  placed: dict[str, list] = collections.defaultdict(list)  # last member's placeholder name -> the group's nodes
  new_nodes = []  # externals
  replacement: dict[str, str] = {}  # placeholder node name -> result tensor ref
  external_nodes: dict[str, str] = {}  # external key -> node name in out
  external_inputs: dict[str, tf.Tensor] = {}
  last_ordered: dict[str, str] = {}  # device -> last ordered op node name

  for collective in plan.collectives:
    lowering = _lowering.of(collective, lowerings)
    for g, group in enumerate(collective.groups):
      built = tuple(r for r in group if collective.members[r] is not None)
      if not built:
        continue  # the group of another process of a multi-client job
      if len(built) < len(group):
        if not lowering.partial_groups:
          raise _errors.RewriteError(
              f"{collective.describe()}: its group {list(group)} spans processes, and lowering {lowering.name!r} "
              f"builds whole groups only. Fix: use implementation='auto' or 'collective_ops'.")
        template = _build_template(lowering, collective, group)
      else:
        template = _template(lowering, collective, group)
      scope = f"{prefix}/{collective.index}_{collective.kind}" + (f"/group_{g}" if len(collective.groups) > 1 else "")
      inputs = {name: collective.members[r].input for name, r in zip(template.inputs, built)}
      renamed = {}
      for tnode, key in template.externals.items():
        if key not in external_nodes:
          node = tf.compat.v1.NodeDef()
          node.CopyFrom(next(n for n in template.nodes if n.name == tnode))
          node.name = f"{prefix}/external/{len(external_nodes)}"
          node.device = ""
          new_nodes.append(node)
          external_nodes[key] = node.name
          external_inputs[node.name + ":0"] = lowering.external_value(key)
        renamed[tnode] = external_nodes[key]

      here = placed[max((collective.members[r].node for r in built), key=position.__getitem__)]
      for tnode in template.nodes:
        if tnode.name in inputs or tnode.name in template.externals:
          continue
        node = tf.compat.v1.NodeDef()
        node.CopyFrom(tnode)
        node.name = f"{scope}/{tnode.name}"
        node.ClearField("input")
        node.input.extend(_remap(i, inputs, renamed, scope) for i in tnode.input)
        if tnode.op in lowering.ordered_op_types:
          previous = last_ordered.get(node.device)
          if previous is not None:
            node.input.append(f"^{previous}")
          last_ordered[node.device] = node.name
        here.append(node)
      for r, output in zip(built, template.outputs):
        replacement[collective.members[r].node] = _remap(output, inputs, renamed, scope)

  out.node.extend(new_nodes)
  for node in graph_def.node:
    if node.name in placeholders:
      out.node.extend(placed.get(node.name, ()))
      continue
    copy = out.node.add()
    copy.CopyFrom(node)
    if any(_split(i)[1] in replacement for i in node.input):
      refs = []
      for ref in node.input:
        control, name, port = _split(ref)
        if name in replacement:
          if port not in ("0", ""):
            raise _errors.RewriteError(f"Placeholder {name} has one output, but {node.name} reads {ref}.")
          _, rname, rport = _split(replacement[name])
          refs.append(f"^{rname}" if control else f"{rname}:{rport}")
        else:
          refs.append(ref)
      copy.ClearField("input")
      copy.input.extend(refs)

  survivors = [n.name for n in out.node if n.name in placeholders]
  if survivors:
    raise _errors.RewriteError(f"Placeholders survived the rewrite: {survivors}.")
  tensor_map = {f"{name}:0": ref for name, ref in replacement.items()}
  return Rewritten(graph_def=out, tensor_map=tensor_map, external_inputs=external_inputs)
