"""Rules for resource variables: reads give, and writes take, the variable's layout.

The layout of a variable's handle is given to the partitioner (``handle_layouts``).
"""

from __future__ import annotations

from rewrite import _rules


@_rules.register("ReadVariableOp")
def read(view, layouts):
  return _rules.Decision(inputs=[None], outputs=[layouts[0]])


@_rules.register("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
def write(view, layouts):
  return _rules.Decision(inputs=[None, layouts[0]], outputs=[])


@_rules.register("NoOp")
def no_op(view, layouts):
  return _rules.Decision(inputs=[], outputs=[])
