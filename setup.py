"""Installs the replicator library: packages `replicator`, `rewrite` and `mesh`.

The supported Python, TensorFlow and Keras ranges are stated here once, as the
distribution's metadata; `mesh/_requirements.py` reads them back from the
installed metadata and checks them at import. The lower bounds are the oldest
versions tested; the newest are found by `bash .ci/run --latest`.
"""

import re

from setuptools import setup

PYTHON = ">=3.11"  # Keras 3.15 needs 3.11
TENSORFLOW = ">=2.21,<3"
KERAS = ">=3.15,<4"


def _version():
  with open("replicator/_version.py", encoding="utf-8") as f:
    return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def _readme():
  with open("README.md", encoding="utf-8") as f:
    return f.read()


setup(
    name="replicator",
    version=_version(),
    description=("In-graph replication for TensorFlow 2 custom training loops, "
                 "by placeholder graph rewriting onto named device meshes."),
    long_description=_readme(),
    long_description_content_type="text/markdown",
    packages=["replicator", "replicator.core", "replicator.guarantees", "replicator.input", "replicator.integrations",
              "replicator.state", "replicator.views", "rewrite", "rewrite.rules", "mesh"],
    package_data={"replicator": ["py.typed"], "rewrite": ["py.typed"], "mesh": ["py.typed"]},
    python_requires=PYTHON,
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # TensorFlow comes from an extra: `cpu` (tensorflow-cpu) or `gpu` (tensorflow with CUDA), so an existing
    # TensorFlow install is not replaced. Keras 3 is TensorFlow's own dependency; its range is ours too.
    install_requires=[
        "numpy",
        "absl-py",
        "dm-tree",
        "packaging",
        f"keras{KERAS}",
    ],
    extras_require={
        "cpu": [f"tensorflow-cpu{TENSORFLOW}"],
        "gpu": [f"tensorflow[and-cuda]{TENSORFLOW}"],
        "examples": ["scikit-learn", "tensorboard"],
        # KerasHub itself is installed with --no-deps (README): its tensorflow-text requirement pulls the full
        # TensorFlow wheel over tensorflow-cpu. These are what it imports.
        "test": ["pytest", "pytest-xdist", "scikit-learn", "dm-sonnet", "ruff", "tensorboard", "build",
                 "regex", "rich", "packaging", "kagglehub", "tokenizers", "sentencepiece"],
        "docs": ["mkdocs", "mkdocs-material", "mkdocstrings[python]"],
        "benchmarks": ["matplotlib"],
    },
)
