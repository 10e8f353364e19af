"""The fusion pass: independent all-reduces of one group become one, as a bucket of gradients does.

Across processes each collective op pays a round trip, whatever its size: a
step whose partitioned backward pass reduces 32 gradients one by one waits
for 32 of them, where ``MultiWorkerMirroredStrategy`` packs them into one.
:func:`fuse` rewrites a step's ``GraphDef`` and its :class:`Plan` before
:func:`rewrite.apply`: all-reduces that one lowering runs over the same
groups with the same op and dtype, whose lowering says it gains from fusing
(``Lowering.fusible``: ops across processes), and that do not depend on each
other, are made one all-reduce of their inputs flattened and concatenated,
whose result is split and reshaped back.

Independence is read from the graph's order (topological, and the order in
which ops were made): a bucket closes before an all-reduce if a consumer of a
member's result comes before that all-reduce's placeholder or input (its
input may then depend on the member's result, and the fused op could not
come first). The fused ops take the last member's place in the graph, the
fused collective the last member's place in the plan; every process of a
multi-client job reads the same graph shape, so every process fuses alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import tensorflow as tf

from rewrite import _lowering
from rewrite import _placeholders
from rewrite._plan import Collective
from rewrite._plan import Plan

SCOPE = "replicator_fused"
DEFAULT_BUCKET_BYTES = 64 << 20  # as MultiWorkerMirroredStrategy packs (its default pack size)
OVERLAP_BYTES = 2 << 20
"""A bucket of at least twice this many bytes is reduced in two parts, the values that exist first (in the backward
pass: the last layers' gradients) first; their all-reduce then runs while the others are computed. One more
collective, whose round trip the overlap must pay for. The global view's wide MLP (8.4 MB of gradients) in a
multi-client job on loopback workers, two parts against one (2 alternated runs): 4 x 1 129.8 and 117.6 ms against
137.6 and 132.5 (MultiWorkerMirroredStrategy 124.2 and 120.9), 2 x 2 82.3 and 85.1 against 85.9 and 88.1; the
local view's, and a deep MLP's 1 MB (which two parts slow), in replicator/state/_optimizer.py.
"""

_NUMBERS = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)


def _name(ref: str) -> str:
  return ref[1:] if ref.startswith("^") else ref.partition(":")[0]


def overlap_split(sizes) -> int:
  """How many of a bucket's values (``sizes`` in bytes, in the order they exist) to reduce first.

  All of them (one all-reduce) below ``2 * OVERLAP_BYTES``; else the fewest
  whose bytes are half the bucket's or more, leaving at least one.

  Examples:
    >>> overlap_split([1024, 4 << 20, 16384, 4 << 20])  # a wide MLP's gradients, last layer first
    3
    >>> overlap_split([65536] * 16)
    16
  """
  if len(sizes) < 2:
    return len(sizes)
  total = sum(sizes)
  if total < 2 * OVERLAP_BYTES:
    return len(sizes)
  done = 0
  for k, size in enumerate(sizes):
    done += size
    if done * 2 >= total:
      return min(k + 1, len(sizes) - 1)
  return len(sizes)  # (not reached: the sizes add up to the total)


def _fusible(collective: Collective, lowering) -> bool:
  if collective.kind != "all_reduce" or not getattr(lowering, "fusible", False):
    return False
  if collective.dtype not in _NUMBERS or not collective.shape.is_fully_defined():
    return False
  if len({_lowering.task_of(d) for d in collective.all_devices}) < 2:
    return False  # within one process: in-graph, or one op without a network round trip
  return all(m.input_shape.is_fully_defined() and m.input_shape == collective.shape for m in collective.present)


def fuse(graph_def: tf.compat.v1.GraphDef, plan: Plan, lowerings: Mapping | None = None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[tf.compat.v1.GraphDef, Plan]:
  """``graph_def`` and ``plan`` with independent all-reduces of one group fused (see the module docstring).

  Args:
    graph_def: the step, holding the placeholder nodes of ``plan``.
    plan: from :func:`rewrite.plan`.
    lowerings: lowering instances by name (as :func:`rewrite.apply` takes them).
    bucket_bytes: the most bytes of one replica's input a fused all-reduce takes.

  Returns:
    The step and plan to apply: unchanged if nothing fuses; else fused
    collectives named ``fused_all_reduce`` and the plan renumbered in call
    order. The members' placeholder nodes become ``Identity`` nodes of their
    pieces of the fused result, so that their consumers read them unchanged.
  """
  position = {node.name: i for i, node in enumerate(graph_def.node)}
  first_use: dict[str, int] = {}  # placeholder node -> the position of its first consumer
  members = {m.node for c in plan.collectives for m in c.present}
  for i, node in enumerate(graph_def.node):
    for ref in node.input:
      name = _name(ref)
      if name in members and name not in first_use:
        first_use[name] = i

  def at(collective: Collective) -> list[int]:
    """Per present member: the position by which its input and placeholder exist."""
    return [max(position[m.node], position.get(_name(m.input), -1)) for m in collective.present]

  buckets: list[list[Collective]] = []
  open_bucket: dict[tuple, tuple[list[Collective], list[int], int]] = {}  # key -> (bucket, first uses, bytes)
  for collective in plan.collectives:
    if not _fusible(collective, _lowering.of(collective, lowerings)):
      buckets.append([collective])
      continue
    key = (collective.implementation, collective.groups, collective.params, collective.dtype, collective.axes)
    uses = [first_use.get(m.node, len(graph_def.node)) for m in collective.present]
    found = open_bucket.get(key)
    if found is not None:
      bucket, bucket_uses, size = found
      if size + collective.nbytes <= bucket_bytes and all(u > p for u, p in zip(bucket_uses, at(collective))):
        bucket.append(collective)
        open_bucket[key] = (bucket, [min(a, b) for a, b in zip(bucket_uses, uses)], size + collective.nbytes)
        continue
    bucket = [collective]
    buckets.append(bucket)
    open_bucket[key] = (bucket, uses, collective.nbytes)
  # A large bucket in two parts: the first members (their inputs exist first) reduced while the others are made.
  buckets = [part for b in buckets for part in _parts(b)]
  if all(len(b) == 1 for b in buckets):
    return graph_def, plan

  # The buckets in the plan's order: each where its last member was.
  ordered = sorted(buckets, key=lambda b: b[-1].index)
  made: dict[str, list] = {}  # last member's placeholder node -> the nodes that replace the bucket's, there
  dropped: set[str] = set()
  collectives = []
  for index, bucket in enumerate(ordered):
    if len(bucket) == 1:
      collectives.append(dataclasses.replace(bucket[0], index=index))
      continue
    collectives.append(_fused(bucket, index, made, dropped))
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  for node in graph_def.node:
    if node.name in made:
      out.node.extend(made[node.name])
    elif node.name not in dropped:
      out.node.add().CopyFrom(node)
  return out, Plan(collectives=tuple(collectives), devices=plan.devices)


def _parts(bucket: list[Collective]) -> list[list[Collective]]:
  if len(bucket) < 2:  # (fused buckets hold collectives of static shapes; others are alone)
    return [bucket]
  k = overlap_split([c.nbytes for c in bucket])
  return [bucket[:k], bucket[k:]] if k < len(bucket) else [bucket]


def _fused(bucket: list[Collective], index: int, made: dict, dropped: set) -> Collective:
  """The fused collective of ``bucket`` (number ``index``); its nodes, per replica, into ``made``."""
  first = bucket[0]
  sizes = [c.shape.num_elements() for c in bucket]
  total = sum(sizes)
  members = []
  for replica, member in enumerate(first.members):
    if member is None:
      members.append(None)
      continue
    scope = f"{SCOPE}/{index}/replica_{replica}"
    device = member.device
    dtype = first.dtype.as_datatype_enum
    nodes = []

    def node(name, op, inputs, nodes=nodes, scope=scope, device=device, **attrs):
      made_node = tf.compat.v1.NodeDef(name=f"{scope}/{name}", op=op, input=list(inputs), device=device)
      for key, value in attrs.items():
        made_node.attr[key].CopyFrom(value)
      nodes.append(made_node)
      return made_node.name

    def const(name, values, node=node):
      return node(name, "Const", [], dtype=tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum),
                  value=tf.compat.v1.AttrValue(tensor=tf.make_tensor_proto(values, tf.int32)))

    type_attr = tf.compat.v1.AttrValue(type=dtype)
    flat_shape = const("flat_shape", [-1])
    flats = [node(f"flat_{k}", "Reshape", [c.members[replica].input, flat_shape], T=type_attr,
                  Tshape=tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum)) for k, c in enumerate(bucket)]
    axis = const("axis", 0)
    concat = node("concat", "ConcatV2", flats + [axis], T=type_attr, N=tf.compat.v1.AttrValue(i=len(flats)),
                  Tidx=tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum))
    stand_in = tf.TensorSpec([total], first.dtype, name=f"{concat}:0")
    placeholder, record = _placeholders.emit_node(
        stand_in, f"{scope}/{_placeholders.PLACEHOLDER_SCOPE}/fused_all_reduce", replica=replica, index=index,
        kind="all_reduce", params=first.param_dict, axes=first.axes, result_shape=tf.TensorShape([total]),
        device=device, location=first.location, call=f"{len(bucket)} all-reduces fused ({first.members[replica].call})")
    nodes.append(placeholder)
    split = node("split", "SplitV", [placeholder.name, const("sizes", sizes), const("split_axis", 0)], T=type_attr,
                 Tlen=tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum), num_split=tf.compat.v1.AttrValue(
                     i=len(bucket)))
    for k, c in enumerate(bucket):
      original = c.members[replica]
      piece = node(f"piece_{k}", "Reshape", [f"{split}:{k}", const(f"shape_{k}", c.shape.as_list())], T=type_attr,
                   Tshape=tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum))
      # The member's placeholder becomes its piece: its consumers read it by the same name.
      nodes.append(tf.compat.v1.NodeDef(name=original.node, op="Identity", input=[piece], device=device,
                                        attr={"T": type_attr}))
      dropped.add(original.node)
    made[bucket[-1].members[replica].node] = nodes
    members.append(record)
  return dataclasses.replace(first, index=index, shape=tf.TensorShape([total]), members=tuple(members))
