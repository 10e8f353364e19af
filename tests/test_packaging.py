"""The packages people install: ``python -m build`` makes a wheel and an sdist, each installs into a fresh
virtualenv and imports there, with the version and the supported ranges of the distribution's metadata."""

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import replicator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  out = tmp_path_factory.mktemp("dist")
  process = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), ROOT], capture_output=True,
                           text=True, timeout=900)
  assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
  (wheel,) = out.glob("*.whl")
  (sdist,) = out.glob("*.tar.gz")
  return {"wheel": wheel, "sdist": sdist}


def test_wheel_holds_the_three_packages_only(built):
  names = zipfile.ZipFile(built["wheel"]).namelist()
  assert {n.split("/")[0] for n in names} == {"replicator", "mesh", "rewrite",
                                             f"replicator-{replicator.__version__}.dist-info"}
  for package in ("replicator", "mesh", "rewrite"):
    assert f"{package}/py.typed" in names
    assert f"{package}/__init__.py" in names
  sources = {os.path.relpath(os.path.join(folder, f), ROOT).replace(os.sep, "/")
             for package in ("replicator", "mesh", "rewrite") for folder, _, files in os.walk(os.path.join(ROOT, package))
             for f in files if f.endswith(".py")}
  assert sources <= set(names), f"modules missing from the wheel (setup.py's packages): {sorted(sources - set(names))}"


@pytest.mark.parametrize("kind", ["wheel", pytest.param("sdist", marks=pytest.mark.full_grid)])  # CI time
def test_installs_into_a_fresh_virtualenv_and_imports(built, kind, tmp_path):
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  python = str(venv / "bin" / "python")
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        capture_output=True, text=True, check=True).stdout.strip()
  # TensorFlow and the other dependencies come from this environment (downloading 600 MB again would test pip,
  # not us): its site-packages is appended to the new one's path. Its own .pth files (this checkout's editable
  # install) are not processed from there, and the new virtualenv's packages come first.
  with open(os.path.join(site, "dependencies.pth"), "w", encoding="utf-8") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  process = subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", str(built[kind])], capture_output=True,
                           text=True, timeout=900)
  assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
  probe = ("import mesh, replicator, rewrite; from mesh import _requirements;"
           "print(replicator.__version__); print(replicator.__file__); print(mesh.__file__);"
           "print(sorted(f'{k} {v}' for k, v in _requirements.supported().items()))")
  process = subprocess.run([python, "-c", probe], cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=""))
  assert process.returncode == 0, process.stderr[-3000:]
  version, replicator_file, mesh_file, ranges = process.stdout.strip().splitlines()[-4:]
  assert version == replicator.__version__
  assert replicator_file.startswith(site) and mesh_file.startswith(site), (replicator_file, mesh_file)
  assert ranges == "['Keras <4,>=3.15', 'Python >=3.11', 'TensorFlow <3,>=2.21']"
