"""tidegate: an LLM streaming gateway built as a message-broker decoupled pipeline.

This package is the core the three tiers (``edge``, ``dispatcher``,
``workers``) share: wire protocol, subjects, flow control, config, broker
setup, telemetry and the control plane's stores. The ``tidegate`` command and
the launcher stand above the tiers, in ``fleet``.
"""

__version__ = "0.1.0"
