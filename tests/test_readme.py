"""Every Python code block of README.md runs as shown (in order, in one fresh process)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_readme_python_blocks_run():
  blocks = _python_blocks()
  assert len(blocks) >= 2
  program = "\n\n".join(blocks)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  process = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
  assert process.returncode == 0, f"README blocks failed:\n{process.stderr[-4000:]}"
  assert "Rewrite plan:" in process.stdout  # print(repl.explain(...))


def test_readme_is_a_landing_page():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  assert len(lines) <= 300, f"README.md has {len(lines)} lines; the detail belongs in docs/"
  for link in re.findall(r"\]\(((?:docs/)[^)#]+)", "\n".join(lines)):
    assert os.path.exists(os.path.join(ROOT, link)), f"README links to {link}, which does not exist"
