"""Input: per-replica datasets from ``input_fn`` and datasets of global batches split across replicas.

Nothing here is public: ``replicator/__init__.py`` re-exports what is.
"""
