"""Other libraries' entry points onto a Replicator: Keras (fit, its distribution API, batch norm),
tf.distribute's replica context, tf.summary, and the cluster of workers.

Nothing here is public: ``replicator/__init__.py`` re-exports what is.
"""
