"""A griffe extension for the API pages: the Sphinx roles of the docstrings, rendered.

The docstrings are Google style with Sphinx roles (``:class:`mesh.Mesh```,
``:meth:`run```), which read well in ``help()``. mkdocstrings does not know
roles: this turns a role naming a public object by its full path into a link
to its entry in the API reference, and any other into code.
"""

import re

import griffe

_ROLE = re.compile(r":(?:class|meth|func|data|attr|mod|exc|obj):`~?\.?([^`]+)`")
_PUBLIC_PATH = re.compile(r"^(replicator|mesh|rewrite)(\.[A-Za-z][A-Za-z0-9_]*)+$")


def _rendered(match: re.Match) -> str:
  target = match.group(1)
  if _PUBLIC_PATH.match(target):
    return f"[`{target}`][{target}]"
  return f"`{target}`"


class SphinxRoles(griffe.Extension):
  """Rewrites Sphinx roles in every docstring griffe loads."""

  def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
    if obj.docstring is not None:
      obj.docstring.value = _ROLE.sub(_rendered, obj.docstring.value)
