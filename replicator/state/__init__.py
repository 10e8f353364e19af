"""A Replicator's variables and what guards them: replicated and sharded variables (their initial values
lifted out of a step, their global-view stand-ins), the optimizer wrapper, how a step reads and writes them
(access, invariance, consistency checks), export, a restore undone, and the layouts in use.

Nothing here is public: ``replicator/__init__.py`` re-exports what is.
"""
