"""What ``tidegate up`` prints once every child is ready: the URL, the dev key,
where logs and metrics are, and how to stream a first completion."""

from __future__ import annotations

import json
import re
import shlex

from fleet.run.planning import Plan
from fleet.run.ports import connect_host


def banner(plan: Plan) -> str:
    """What ``tidegate up`` prints once everything is ready."""
    cfg = plan.config
    url, key = plan.base_url, cfg.auth.dev_key
    model = cfg.models[0].name
    body = json.dumps({"model": model, "stream": True,
                       "messages": [{"role": "user", "content": "Say hello"}]})
    curl = (f"curl -N {url}/chat/completions \\\n"
            f"    -H {shlex.quote('Authorization: Bearer ' + key)} \\\n"
            f"    -H 'Content-Type: application/json' \\\n"
            f"    -d {shlex.quote(body)}")
    python = "\n".join([
        "from openai import OpenAI",
        "",
        f"client = OpenAI(base_url={url!r}, api_key={key!r})",
        "stream = client.chat.completions.create(",
        f"    model={model!r},",
        '    messages=[{"role": "user", "content": "Say hello"}],',
        "    stream=True,",
        ")",
        "for chunk in stream:",
        "    if chunk.choices:",
        '        print(chunk.choices[0].delta.content or "", end="", flush=True)',
        "print()",
    ])
    return "\n".join([
        "",
        "tidegate is up.",
        "",
        f"  URL:      {url}",
        f"  API key:  {key}",
        *([f"  gRPC:     {connect_host(cfg.edge.host)}:{cfg.edge.grpc_port}"
           f"{' (TLS)' if cfg.edge.tls_cert else ''}  (tidegate.v1.Gateway, docs/grpc.md)"]
          if cfg.edge.grpc_port else []),
        f"  Models:   {', '.join(m.name for m in cfg.models)}",
        f"  Workers:  {plan.options.workers}",
        *([f"  Edges:    {plan.options.edges} on one port (SO_REUSEPORT)"]
          if plan.options.edges > 1 else []),
        *([f"  Dispatchers: {plan.options.dispatchers}"] if plan.options.dispatchers > 1 else []),
        f"  NATS:     {cfg.nats.url}{'' if plan.nats_port is None else ' (embedded)'}",
        f"  Redis:    {_hide_password(cfg.redis.url)}"
        f"{'' if plan.redis_port is None else ' (embedded, with a password)'}",
        f"  Logs:     tail -f {shlex.quote(str(plan.log_dir))}/*.log",
        *_metrics_lines(plan),
        f"  Status:   tidegate status --config {shlex.quote(str(plan.config_file))}",
        *_console_lines(plan),
        "",
        "Stream a chat completion:",
        "",
        _indent(curl),
        "",
        "Or with the openai SDK (pip install openai):",
        "",
        _indent(python),
        "",
        "Press Ctrl-C to stop.",
    ])


def _console_lines(plan: Plan) -> list[str]:
    if plan.console_url is None:
        return []
    config = shlex.quote(str(plan.config_file))
    return [f"  Console:  {plan.console_url}",
            f"            (sign in with an admin key: tidegate keys create --admin "
            f"--tenant ops --config {config})"]


def _metrics_lines(plan: Plan) -> list[str]:
    return [f"  {'Metrics:' if i == 0 else '':<10}{url}  ({name})"
            for i, (name, url) in enumerate(plan.metrics_urls().items())]


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" if line else "" for line in text.splitlines())


def _hide_password(url: str) -> str:
    """A URL's password is never printed (the embedded Redis has one)."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1<redacted>@", url)
