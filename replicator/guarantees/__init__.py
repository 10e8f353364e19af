"""The run-time guarantees: all or nothing (kept values, ordered writes), failures named, Ctrl-C between
steps, and a failed checkpoint restore undone.

Nothing here is public: ``replicator/__init__.py`` re-exports what is.
"""
