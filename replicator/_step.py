"""Building one replicated step: trace -> plan -> lower -> one cached graph call.

1. trace: ``step_fn`` is traced once per replica, under that replica's device
   and replica context, into one scratch graph. Primitives leave placeholders.
2. plan: :func:`rewrite.plan` matches the placeholders across replicas.
3. lower: :func:`rewrite.apply` replaces them with real collectives in the
   scratch graph's ``GraphDef``.
4. execute: the rewritten ``GraphDef`` is imported into a ``tf.function``
   (mapping the scratch graph's inputs and captured resources to the real
   ones); its concrete function is what every later call runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

import tensorflow as tf
import tree

import rewrite
from replicator import _context
from replicator import _errors
from replicator import _gradient_registry
from replicator import _inputs
from replicator import _values
from replicator import _variables

OUTPUT_MISMATCH = (
    "step_fn returned different {what} on replicas 0 and {r}:\n"
    "  replica 0: {a}\n  replica {r}: {b}\n"
    "repl.run returns one value per replica with a single structure, so every "
    "replica must return the same nest of tensors with the same dtypes. Fix: "
    "return the same structure on every replica (use zeros where a replica has "
    "nothing to report)."
)


def _capture(t: tf.Tensor) -> tf.Tensor:
  """The current function graph's placeholder for eager tensor ``t`` (captures it)."""
  return tf.identity(t).op.inputs[0]


def _spec_str(structure) -> str:
  return str(tree.map_structure(
      lambda v: None if v is None else f"{v.dtype.name}{v.shape}", structure))


@dataclasses.dataclass
class CompiledStep:
  """A traced, rewritten and imported step, ready to call."""

  plan: rewrite.Plan
  function: Any  # ConcreteFunction
  structure: Any  # output nest of replica 0 (leaves: tensors or None)
  leaves_per_replica: int
  tensor_leaves: list[bool]  # which leaves of one replica's output are tensors

  def __call__(self, args: list[tf.Tensor]) -> list[Any]:
    flat = self.function(*args)
    flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
    results = []
    it = iter(flat)
    n = len(self.plan.devices)
    for _ in range(n):
      leaves = [next(it) if is_tensor else None for is_tensor in self.tensor_leaves]
      results.append(tree.unflatten_as(self.structure, leaves))
    return results


def build(replicator, step_fn: Callable, source: _inputs.Source, choose: Callable) -> CompiledStep:
  """Traces ``step_fn`` on every replica and returns the compiled step."""
  devices = replicator.devices
  creator = _variables.make_creator(replicator)
  placeholders = [[] for _ in devices]
  gradient_names = []
  outputs = [None] * len(devices)
  fn = replicator._convert(step_fn)  # pylint: disable=protected-access

  def trace(*flat_args):
    # TF may trace more than once; only the records of the last trace count.
    for records in placeholders:
      del records[:]
    _gradient_registry.release(gradient_names)
    del gradient_names[:]
    graph = tf.compat.v1.get_default_graph()
    flat_outputs = []
    with tf.variable_creator_scope(creator):
      for replica, device in enumerate(devices):
        ctx = _context.ReplicaContext(replicator=replicator, replica_id=replica, device=device,
                                      graph=graph, placeholders=placeholders[replica],
                                      gradient_names=gradient_names)
        with tf.name_scope(f"replica_{replica}"), tf.device(device), _context.replica_scope(ctx):
          args = source.replica_args(replica, flat_args)
          result = fn(*args)
          result = tree.map_structure(
              lambda v: v if v is None else tf.convert_to_tensor(v), result)
        outputs[replica] = result
    for result in outputs:
      flat_outputs.extend(t for t in tree.flatten(result) if t is not None)
    return flat_outputs

  try:
    with tf.variable_creator_scope(creator):
      scratch = tf.function(trace, autograph=False).get_concrete_function(*source.arg_specs)
  finally:
    _gradient_registry.release(gradient_names)  # the backward functions ran during the trace
  plan = rewrite.plan(placeholders, replicator.mesh, choose)  # collective mismatches first:
  _check_outputs(outputs)  # they are the usual cause of output mismatches
  rewritten = rewrite.apply(scratch.graph.as_graph_def(), plan)

  graph = scratch.graph
  arg_names = [t.name for t in graph.inputs[:len(source.arg_specs)]]
  captures = [(internal.name, external) for external, internal in graph.captures]
  output_names = [rewritten.output_name(t.name) for t in scratch.outputs]
  graph_def = rewritten.graph_def
  externals = list(rewritten.external_inputs.items())

  def execute(*flat_args):
    input_map = dict(zip(arg_names, flat_args))
    for name, external in captures + externals:
      input_map[name] = _capture(external)
    if not output_names:
      tf.graph_util.import_graph_def(graph_def, input_map=input_map, name="step")
      return []
    return tf.graph_util.import_graph_def(
        graph_def, input_map=input_map, return_elements=output_names, name="step")

  function = tf.function(execute, autograph=False).get_concrete_function(*source.arg_specs)
  flat0 = tree.flatten(outputs[0])
  return CompiledStep(plan=plan, function=function, structure=outputs[0],
                      leaves_per_replica=len(flat0), tensor_leaves=[t is not None for t in flat0])


def _check_outputs(outputs: list) -> None:
  mismatch = _values.first_mismatch(outputs)
  if mismatch is not None:
    r, difference = mismatch
    raise _errors.OutputMismatchError(OUTPUT_MISMATCH.format(
        what=difference.split()[0] + "s", r=r, a=_spec_str(outputs[0]), b=_spec_str(outputs[r])))
