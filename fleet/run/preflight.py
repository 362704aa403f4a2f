"""What a tier checks before its event loop starts: what its config names
outside the config itself (files, environment variables).

:func:`tidegate.config.load` checks every key's type and range; this checks
what only the tier's own host can tell: that the files it will open exist and
parse and that the variables it reads are set and in range. A failure is a
:class:`~tidegate.errors.ConfigError` naming the key, printed by the CLI as
one line (exit 2) before any connection is tried, never a traceback and never
a failure per request (docs/configuration.md, "Refused at start").
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tidegate.broker.auth import connect_options
from tidegate.config import Config
from tidegate.errors import ConfigError
from tidegate.telemetry.observability import metrics_address


def preflight(config: Config, tier: str, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigError` for the first thing ``tier`` could not start with."""
    env = os.environ if env is None else env
    metrics_address(env)
    # The tier's NATS login and TLS files, read as its connection will (an
    # edge's own login by its id, when it has one).
    edge_id = config.edge.edge_id if tier == "edge" else ""
    connect_options(config.nats, f"tidegate-{tier}-{edge_id}" if edge_id else f"tidegate-{tier}")
    if tier == "edge":
        from edge.tls import server_tls_context

        server_tls_context(config.edge)
    if tier == "worker":
        _backend_keys(config, env)


def _backend_keys(config: Config, env: Mapping[str, str]) -> None:
    """Every model this worker serves finds its backend key (``api_key_env``)."""
    index = config.model_index()
    served = {index[name].name for name in config.worker.models}
    for i, model in enumerate(config.models):
        if model.api_key_env and (not served or model.name in served) and not env.get(
                model.api_key_env):
            raise ConfigError(f"models[{i}].api_key_env: names {model.api_key_env!r}, which "
                              f"is not set (or empty) in this worker's environment")
