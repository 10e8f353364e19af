"""The run-time guarantees: a call's run state (a step found or built, run, a divergence recorded), all or
nothing (kept values, ordered writes), failures named, and Ctrl-C between steps.

Nothing here is public: ``replicator/__init__.py`` re-exports what is.
"""
