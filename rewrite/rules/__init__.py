"""The global view's layout rules: what an op of a traced global graph needs of its inputs' layouts and gives
its outputs.

``_base`` is what every rule shares: the op as a rule sees it (``OpView``), what a rule decides (``Decision``),
the registry by op type (``register``, ``get``, ``covered``), and the decision for an op without a rule
(``fallback``). Each other module is one family of rules (``_elementwise``, ``_contraction``, ``_shape``, ...),
registered when it is imported; ``rewrite._propagation`` imports them all. The rules do not import the
partitioner: what the rule for an op calling functions needs of it comes with the op (``OpView.bodies``).

Nothing here is public: ``rewrite/__init__.py`` re-exports what is.
"""
