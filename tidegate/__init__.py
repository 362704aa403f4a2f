"""tidegate: an LLM streaming gateway built as a message-broker decoupled pipeline.

This package is the core the three tiers (``edge``, ``dispatcher``,
``workers``) share: wire protocol, subjects, flow control, config, broker
setup, the CLI and the embedded launcher.
"""

__version__ = "0.1.0"
