"""The tools above the tiers: the ``tidegate`` command (``fleet.cli``) and what
starts, supervises and watches a fleet of tiers (``fleet.run``: ``tidegate up``,
the launcher, ``tidegate status`` and the console).

Invariant: the roof of the import graph. It imports the tiers (``edge``,
``dispatcher``, ``workers``) and the core package ``tidegate``; none of them
imports it (tests/test_layers.py). MAP.md ("Layers").
"""
