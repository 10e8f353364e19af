"""The project's modules as layers: no import circles, packages that import only those below them, and no reading
another module's private names.

Read from the code with ``ast`` (nothing is imported): every import, at the top
of a module or inside a function, is an edge between the project's modules
(``replicator``, ``rewrite``, ``mesh``, ``examples``; tests excepted). A
private name (``_x``, not ``__x__``) belongs to the module that defines it: a
module-level definition, or an attribute a class of that module sets on its
instances (``self._x = ...``) or defines in its body. Reading it from another
module (``module._x``, ``from module import _x``, ``obj._x``) couples that
module to the other's insides.
"""

from __future__ import annotations

import ast
import collections
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("replicator", "rewrite", "mesh", "examples")

def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: str = ROOT) -> dict[str, ast.Module]:
  """Dotted module name -> its parsed source, for every module of :data:`PACKAGES` under ``root``."""
  found = {}
  for package in PACKAGES:
    for folder, _, files in os.walk(os.path.join(root, package)):
      for file in sorted(files):
        if file.endswith(".py"):
          path = os.path.join(folder, file)
          name = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
          with open(path, encoding="utf-8") as f:
            found[name] = ast.parse(f.read(), path)
  return found


def _is_package(name: str, modules) -> bool:
  return any(other.startswith(name + ".") for other in modules)


def _imported(name: str, node, modules) -> list[str]:
  """The project modules an ``import`` statement of module ``name`` loads."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name in modules]
  base = node.module or ""
  if node.level:
    package = name.split(".") if _is_package(name, modules) else name.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    base = ".".join(package + ([base] if base else []))
  found = []
  for alias in node.names:
    if f"{base}.{alias.name}" in modules:
      found.append(f"{base}.{alias.name}")
    elif base in modules:
      found.append(base)
  return found


def import_graph(modules) -> dict[str, set[str]]:
  """Module -> the project modules it imports (anywhere in it)."""
  edges: dict[str, set[str]] = {name: set() for name in modules}
  for name, tree in modules.items():
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        edges[name].update(d for d in _imported(name, node, modules) if d != name)
  return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []
  counter = 0
  for start in sorted(edges):
    if start in index:
      continue
    work = [(start, iter(sorted(edges[start])))]
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      v, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter
          counter += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(edges[child]))))
        elif child in on_stack:
          low[v] = min(low[v], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        component = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          component.append(w)
          if w == v:
            break
        if len(component) > 1:
          found.append(sorted(component))
  return found


def _owned(tree: ast.Module) -> set[str]:
  """The private attributes a module's classes own: set on ``self``/``cls``, or defined in a class body."""
  owned = set()
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        and _private(node.attr)):
      owned.add(node.attr)
    if isinstance(node, ast.ClassDef):
      for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
          owned.add(item.name)
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(
            item, ast.AnnAssign) else []
        owned.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
  return owned


def private_accesses(modules) -> dict[str, list[str]]:
  """Module -> its reads of other project modules' private names (as written in the source)."""
  owned = {name: _owned(tree) for name, tree in modules.items()}
  anyone_owns = set().union(*owned.values())
  found = collections.defaultdict(list)
  for name, tree in modules.items():
    aliases = {}  # local name -> project module
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        aliases.update({a.asname or a.name: a.name for a in node.names if a.name in modules})
      elif isinstance(node, ast.ImportFrom) and node.module:
        for alias in node.names:
          full = f"{node.module}.{alias.name}"
          if full in modules:
            aliases[alias.asname or alias.name] = full
          elif node.module in modules and _private(alias.name):
            found[name].append(f"from {node.module} import {alias.name}")
    for node in ast.walk(tree):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
          and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
          and _private(node.args[1].value) and node.args[1].value not in owned[name]
          and node.args[1].value in anyone_owns):  # getattr(obj, "_x"): the same read, spelled dynamically
        found[name].append(f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})")
      if not (isinstance(node, ast.Attribute) and _private(node.attr)):
        continue
      value = node.value
      if isinstance(value, ast.Name) and value.id in ("self", "cls"):
        continue
      if isinstance(value, ast.Name) and value.id in aliases:
        if f"{aliases[value.id]}.{node.attr}" not in modules:  # a private submodule is the package's to use
          found[name].append(f"{value.id}.{node.attr}")
      elif node.attr not in owned[name] and node.attr in anyone_owns:
        found[name].append(f"{ast.unparse(value)}.{node.attr}")
  return dict(found)


def test_no_module_imports_itself_through_others():
  found = circles(import_graph(_modules()))
  assert not found, (f"Import circles between the project's modules: {found}. Expected none: a module below may "
                     "not import one above it. Fix: move what both need into a module below both, or hand the "
                     "lower module what it needs (a callable, an object) instead of importing it.")


# The packages as layers, lowest first: a module imports modules of its own package and of those below it only.
# replicator's top-level modules are its API (the Replicator, MultiWorkerReplicator, the Keras hooks, calibrate).
# A sub-package not listed is of its package's layer: rewrite.rules (the global view's layout rules) is rewrite's,
# its rules using rewrite's modules (_op_kinds, _functions) and rewrite's propagation importing every rule.
LAYERS = ("mesh", "rewrite", "replicator.core", "replicator.input", "replicator.state", "replicator.guarantees",
          "replicator.views", "replicator.integrations", "replicator", "examples")


def layer_of(module: str) -> str:
  """The package of :data:`LAYERS` a module belongs to (a sub-package of ``replicator``, or its top level)."""
  return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
  """Every import of a module of a higher layer than the importing module's."""
  rank = {p: i for i, p in enumerate(LAYERS)}
  found = []
  for module, imported in sorted(edges.items()):
    for other in sorted(imported):
      if rank[layer_of(other)] > rank[layer_of(module)]:
        found.append(f"{module} ({layer_of(module)}) imports {other} ({layer_of(other)})")
  return found


def test_the_packages_are_layers():
  found = upward_imports(import_graph(_modules()))
  assert not found, (f"Imports from a higher layer: {found}. Expected each package to import only its own modules "
                     f"and those of the packages below it, in the order {LAYERS}. Fix: move the module to the layer "
                     "of what it is about, or hand it what it needs (an object, a callable) from above.")


def test_the_layout_rules_are_a_sub_package_of_the_rewrite_layer():
  modules = _modules()
  rules = sorted(m for m in modules if m.startswith("rewrite.rules."))
  assert "rewrite.rules._base" in rules and len(rules) > 1, rules
  assert {layer_of(m) for m in rules} == {"rewrite"}
  flat = sorted(m for m in modules if m.startswith("rewrite._rules"))
  assert not flat, f"Layout rules outside rewrite/rules/: {flat}. Expected every rule module in the sub-package."


def test_no_module_reads_another_modules_private_names():
  found = private_accesses(_modules())
  assert not found, (
      "Modules reading other project modules' private names: "
      + "; ".join(f"{name}: {accesses}" for name, accesses in sorted(found.items()))
      + ". Expected none: a module's private names are its own. Fix: give the state an owner with a public method "
      "or attribute (or a module function of the owner's module), and pass that owner where it is needed.")


# The checks themselves, on small made-up trees: each finds what it is for.


def _tree(tmp_path, files: dict[str, str]) -> dict[str, ast.Module]:
  for path, source in files.items():
    full = tmp_path / path
    full.parent.mkdir(parents=True, exist_ok=True)
    full.write_text(source)
  return _modules(str(tmp_path))


@pytest.mark.parametrize("inside_a_function", [False, True])
def test_a_circle_is_found_also_through_an_import_inside_a_function(tmp_path, inside_a_function):
  late = "def f():\n  from replicator import _a\n" if inside_a_function else "from replicator import _a\n"
  modules = _tree(tmp_path, {"replicator/__init__.py": "", "replicator/_a.py": "from replicator import _b\n",
                             "replicator/_b.py": "from rewrite import _c\n", "rewrite/__init__.py": "",
                             "rewrite/_c.py": late, "rewrite/_d.py": "from rewrite import _c\n"})
  assert circles(import_graph(modules)) == [["replicator._a", "replicator._b", "rewrite._c"]]


def test_an_import_from_a_higher_layer_is_found(tmp_path):
  modules = _tree(tmp_path, {"replicator/__init__.py": "from replicator.views import _v\n",
                             "replicator/core/__init__.py": "", "replicator/core/_c.py": "from replicator.state import _s\n",
                             "replicator/state/__init__.py": "", "replicator/state/_s.py": "import mesh\n",
                             "replicator/views/__init__.py": "", "replicator/views/_v.py": "from replicator.core import _c\n",
                             "mesh/__init__.py": ""})
  assert upward_imports(import_graph(modules)) == [
      "replicator.core._c (replicator.core) imports replicator.state._s (replicator.state)"]


def test_a_sub_package_is_of_its_packages_layer(tmp_path):
  modules = _tree(tmp_path, {"rewrite/__init__.py": "", "rewrite/_kinds.py": "import mesh\n",
                             "rewrite/_propagation.py": "from rewrite.rules import _base\n",
                             "rewrite/rules/__init__.py": "",
                             "rewrite/rules/_base.py": "from rewrite import _kinds\nfrom replicator import _a\n",
                             "replicator/__init__.py": "", "replicator/_a.py": "", "mesh/__init__.py": ""})
  assert layer_of("rewrite.rules._base") == "rewrite"
  assert upward_imports(import_graph(modules)) == ["rewrite.rules._base (rewrite) imports replicator._a (replicator)"]


def test_private_accesses_found_and_a_modules_own_kept(tmp_path):
  modules = _tree(tmp_path, {
      "replicator/__init__.py": "",
      "replicator/_a.py": ("class A:\n  def __init__(self):\n    self._state = 1\n  def _helper(self):\n"
                           "    return self._state\n  def same(self, other):\n    return other._state\n"
                           "def _free():\n  return 0\n"),
      "replicator/_b.py": ("from replicator import _a\nfrom replicator._a import _free\n"
                           "def f(a):\n  return a._state + _a._free() + a.__class__.__name__.__len__()\n"
                           "def g(t):\n  return t._keras_private, getattr(t, '_state', None)\n"),
  })
  assert private_accesses(modules) == {
      "replicator._b": ["from replicator._a import _free", "getattr(t, '_state')", "a._state", "_a._free"]}
