"""Other libraries' entry points onto a Replicator: Keras's trainer (fit, evaluate, predict), its
distribution API's meshes and layout maps, cross-replica batch normalization, and the cluster of workers.

Nothing here is public: ``replicator/__init__.py`` re-exports what is.
"""
