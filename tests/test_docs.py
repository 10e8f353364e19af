"""The documentation runs as written.

* Every ``python`` block of a page runs, in order, in one fresh process per page,
  saved as a script (as a reader pasting the page into a file would), from the
  repository. A block of another library's code that cannot run here
  starts with ``# Not run here:`` and the reason; it may not use this project.
* Every ``sh`` line is checked: ``pip install`` names only extras the package
  defines, ``python -m module`` names a module whose ``--help`` lists every
  ``--flag`` the line passes, anything else is in ``OTHER_COMMANDS``.
* ``text`` blocks are output or foreign configuration, shown as is.
* The API reference documents exactly the public names (``__all__``) of
  ``replicator``, ``mesh`` and ``rewrite``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

import mesh
import replicator
import rewrite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
LANGUAGES = ("python", "sh", "text")
NOT_RUN = "# Not run here:"
OTHER_COMMANDS = {
    "mkdocs": "CI builds the docs with it (.ci/run)",
    "ruff": "CI lints with it (.ci/run)",
    "tensorboard": "TensorBoard's own viewer of event files a tested page writes",
    "bash": "only `bash .ci/run` (CI itself)",
}


def pages() -> list[str]:
  """Every Markdown page under docs/, relative to it."""
  found = []
  for folder, _, files in os.walk(DOCS):
    found += [os.path.relpath(os.path.join(folder, f), DOCS) for f in files if f.endswith(".md")]
  return sorted(found)


def blocks(page: str) -> list[tuple[str, str]]:
  """``(language, code)`` of every fenced block of ``page``, in order."""
  with open(os.path.join(DOCS, page), encoding="utf-8") as f:
    return FENCE.findall(f.read())


def _pages_with(language: str) -> list[str]:
  return [page for page in pages() if any(lang == language for lang, _ in blocks(page))]


def test_docs_exist_and_fences_are_known():
  assert len(pages()) >= 20, pages()
  for page in pages():
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
      text = f.read()
    # Fences start at the line's start, so FENCE sees them all (an indented one would not be run).
    assert text.count("```") == 2 * len(blocks(page)), f"docs/{page}: a fence is indented or unclosed"
    for language, _ in blocks(page):
      assert language in LANGUAGES, f"docs/{page}: a ```{language} block; use one of {LANGUAGES}"


@pytest.mark.parametrize("page", _pages_with("python"))
def test_python_blocks_run(page, tmp_path):
  code = [c for lang, c in blocks(page) if lang == "python"]
  run = [c for c in code if not c.startswith(NOT_RUN)]
  for c in code:
    if c.startswith(NOT_RUN):
      assert not re.search(r"^\s*(import|from)\s+(replicator|mesh|rewrite)\b", c, re.M), (
          f"docs/{page}: a block marked {NOT_RUN!r} uses this project; it must run")
  assert run, f"docs/{page}: every Python block is marked {NOT_RUN!r}"
  # Saved as a script, as a reader would (AutoGraph reads a step's source from its file), run from the
  # repository (examples/ and benchmarks/ importable).
  script = tmp_path / (os.path.splitext(os.path.basename(page))[0].replace("-", "_") + ".py")
  script.write_text("\n\n".join(run), encoding="utf-8")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT, REPLICATOR_CACHE=str(tmp_path))  # calibrate()
  process = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
  assert process.returncode == 0, f"docs/{page} failed:\n{process.stdout[-2000:]}\n{process.stderr[-6000:]}"


# Every module's `--help` in one process (one TensorFlow import instead of one per module: CI time); a module
# whose help fails there (one that configures devices when imported, say) is asked again in its own process.
_HELPS = """
import contextlib, io, json, runpy, sys
out = {}
for module in sys.argv[2:]:
  buf, code = io.StringIO(), 0
  sys.argv = [module, "--help"]
  try:
    with contextlib.redirect_stdout(buf):
      runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    code = e.code or 0
  except BaseException as e:  # noqa: BLE001  (asked again in its own process)
    code = repr(e)
  out[module] = [code, buf.getvalue()]
with open(OUT_PATH, "w") as f:
  json.dump(out, f)
"""


def _sh_commands():
  """``(page, command)`` of every command in the docs' sh blocks."""
  for page in _pages_with("sh"):
    for language, code in blocks(page):
      if language != "sh":
        continue
      for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
          continue
        for command in re.split(r"\s*(?:&&|\|\||;)\s*", line):
          if not command.startswith("cd "):
            yield page, re.sub(r"^(\w+=\S+\s+)+", "", command)  # VAR=value python -m ...


@functools.lru_cache(maxsize=None)
def _helps() -> dict:
  modules = sorted({shlex.split(c)[2] for _, c in _sh_commands() if shlex.split(c)[:2] == ["python", "-m"]})
  with tempfile.TemporaryDirectory() as scratch:
    out = os.path.join(scratch, "helps.json")
    subprocess.run([sys.executable, "-c", _HELPS.replace("OUT_PATH", repr(out)), "-"]
                   + modules, cwd=ROOT, capture_output=True, text=True, timeout=600,
                   env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT))
    if not os.path.exists(out):
      return {}
    with open(out, encoding="utf-8") as f:
      return {m: text for m, (code, text) in json.load(f).items() if code == 0 and text}


@functools.lru_cache(maxsize=None)
def _help(module: str) -> str:
  if module in _helps():
    return _helps()[module]
  process = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert process.returncode == 0, f"python -m {module} --help failed:\n{process.stderr[-3000:]}"
  return process.stdout


def _extras() -> set[str]:
  return set(importlib.metadata.metadata("replicator").get_all("Provides-Extra"))


def _check_command(page: str, command: str) -> None:
  words = shlex.split(command)
  if words[:2] == ["pip", "install"]:
    for extras in re.findall(r"\[([\w,-]+)\]", command):
      unknown = set(extras.split(",")) - _extras()
      assert not unknown, f"docs/{page}: `{command}` names extras {sorted(unknown)} that setup.py does not define"
  elif words[:2] == ["python", "-m"]:
    module, flags = words[2], words[3:]
    text = _help(module)
    if module == "replicator.launch" and "-m" in flags:  # what follows `-m module` is that program's
      program = flags.index("-m") + 1
      _check_command(page, shlex.join(["python", "-m", flags[program]] + flags[program + 1:]))
      flags = flags[:program]
    for flag in (w.split("=")[0] for w in flags if w.startswith("--")):
      assert flag in text, f"docs/{page}: `{command}` passes {flag}, which `python -m {module} --help` lacks"
  else:
    assert words[0] in OTHER_COMMANDS, f"docs/{page}: `{command}`: a command this test cannot check"


@pytest.mark.parametrize("page", _pages_with("sh"))
def test_shell_commands_exist(page):
  for where, command in _sh_commands():
    if where == page:
      _check_command(page, command)


def test_the_docs_give_the_readmes_test_command():
  # Was: the home page and Getting started gave the tests' command without the README's KerasHub step, so the
  # KerasHub tests were skipped for a reader following the docs.
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = [line for line in f.read().splitlines() if line.startswith("pip install") and "python -m pytest" in line]
  assert len(readme) == 1
  found = [(page, line.strip()) for page in _pages_with("sh") for language, code in blocks(page)
           if language == "sh" for line in code.splitlines() if "python -m pytest" in line]
  assert {"index.md", "getting-started.md"} <= {page for page, _ in found}
  assert all(command == readme[0].strip() for _, command in found), found


def _documented(page: str) -> list[str]:
  with open(os.path.join(DOCS, page), encoding="utf-8") as f:
    return re.findall(r"^::: ([\w.]+)", f.read(), re.M)


@pytest.mark.parametrize("module", [replicator, mesh, rewrite], ids=lambda m: m.__name__)
def test_api_reference_covers_every_public_name(module):
  documented = _documented(os.path.join("api", f"{module.__name__}.md"))
  expected = {f"{module.__name__}.{name}" for name in module.__all__}
  assert len(documented) == len(set(documented)), "a name is documented twice"
  assert set(documented) == expected, (
      f"missing from docs/api/{module.__name__}.md: {sorted(expected - set(documented))}; "
      f"documented but not public: {sorted(set(documented) - expected)}")
