"""What every other part of the package uses: the replica context of a trace, errors, per-replica
values, the collectives' placeholders, the configuration, and what TensorFlow's own APIs (tf.distribute's
replica context, tf.summary) see inside a step.

Nothing here is public: ``replicator/__init__.py`` re-exports what is.
"""
