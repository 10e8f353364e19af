"""The two views and how they build a step: the local view's per-replica trace and rewrite, the global
view's trace at global shapes and partition, calls from inside a tf.function, and automatic layouts.

Nothing here is public: ``replicator/__init__.py`` re-exports what is.
"""
