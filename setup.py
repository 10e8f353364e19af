"""Installs the replicator library: packages `replicator`, `rewrite` and `mesh`."""

from setuptools import setup

setup(
    name="replicator",
    version="0.1.0",
    description=("In-graph replication for TensorFlow 2 custom training loops, "
                 "by placeholder graph rewriting onto named device meshes."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=["replicator", "rewrite", "mesh"],
    package_data={"replicator": ["py.typed"], "rewrite": ["py.typed"], "mesh": ["py.typed"]},
    python_requires=">=3.10",
    license="Apache-2.0",
    # TensorFlow comes from an extra: `cpu` (tensorflow-cpu) or `gpu`
    # (tensorflow with CUDA), so an existing TensorFlow install is not replaced.
    install_requires=[
        "numpy",
        "absl-py",
        "dm-tree",
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.16"],
        "gpu": ["tensorflow[and-cuda]>=2.16"],
        "examples": ["scikit-learn", "tensorboard"],
        "test": ["pytest", "scikit-learn", "dm-sonnet", "ruff", "tensorboard"],
        "benchmarks": ["matplotlib"],
    },
)
