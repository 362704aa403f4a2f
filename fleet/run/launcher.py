"""``tidegate up``: the whole gateway on one machine, as supervised child processes.

:func:`~fleet.run.planning.prepare` turns the options into a
:class:`~fleet.run.planning.Plan` (the effective config, ports, dev key);
:class:`Launcher` runs it: embedded nats-server and redis-server unless URLs
were given, then dispatchers, workers and edges, each ``python -m fleet
<tier> --config <data-dir>/tidegate.toml`` with every ``TIDEGATE_*`` variable
stripped, so each child sees exactly the config the launcher validated.

Invariants: every child is a :class:`~fleet.run.servers.ManagedProcess`; an
exited child is restarted (:mod:`fleet.run.supervisor`), and only a crash
loop stops the whole (exit 1, with the child's log tail); a signal stops the
children in dependency order (edges first, so streams drain); one launcher per
data dir (a lock file). Each tier gets its own metrics port. Docs: docs/deploy.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import IO, Any

from fleet.run.banner import banner
from fleet.run.planning import Plan, UpOptions, prepare
from fleet.run.servers import (
    SIGKILL,
    ManagedProcess,
    NatsServer,
    RedisServer,
    http_ok,
    private_dir,
    stop_all,
    tcp_sockets,
)
from fleet.run.supervisor import STATE_FILE, Supervisor, names
from tidegate import config as tgconfig
from tidegate.errors import TidegateError

log = logging.getLogger("tidegate.launcher")

# SIGHUP (terminal closed) stops cleanly too; it does not exist on Windows.
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                      if hasattr(signal, name))
_SERVER_STOP_TIMEOUT = 10.0
_GRACE = 5.0  # beyond a tier's own shutdown deadline before SIGKILL


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


class _EdgeProcess(ManagedProcess):
    """An edge child: ready once it listens itself and the port answers /readyz.

    With several edges on one port (``SO_REUSEPORT``) a probe of the port
    reaches any of them, so each edge's own listening socket (it binds only
    after connecting to NATS) is what tells this one apart.
    """

    def __init__(self, *args: Any, port: int, readyz: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.port, self.readyz = port, readyz

    def is_ready(self) -> bool:
        listening = tcp_sockets(self.pid or 0, self.port)
        return listening != 0 and http_ok(self.readyz)  # None: no /proc, the probe alone


class _Stopped(Exception):
    """A stop signal arrived during start-up."""


class Launcher:
    """Starts, watches and stops the children of one ``tidegate up``.

    Must run in the main thread: it installs signal handlers, and children
    forked from it carry ``PR_SET_PDEATHSIG`` bound to this thread.
    """

    def __init__(self, plan: Plan, out: IO[str] | None = None, err: IO[str] | None = None):
        self.plan = plan
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.stop_requested = threading.Event()
        self.nats: NatsServer | None = None
        self.redis: RedisServer | None = None
        self.dispatchers: list[ManagedProcess] = []
        self.workers: list[ManagedProcess] = []
        self.edges: list[ManagedProcess] = []
        self.console: ManagedProcess | None = None
        self.supervisor = Supervisor(plan.options.restart, plan.data_dir / STATE_FILE,
                                     self._restart_ready)

    def children(self) -> Iterator[ManagedProcess]:
        """Every child started so far, in start order."""
        for child in (self.nats, self.redis, *self.dispatchers, *self.workers, *self.edges,
                      self.console):
            if child is not None:
                yield child

    def run(self) -> int:
        """Start everything, print how to use it, supervise; the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}
        try:
            with _lock(self.plan.data_dir):
                try:
                    return self._run_locked()
                finally:
                    self.shutdown()  # still holding the lock: no overlap with a successor
        except TidegateError as exc:
            self._error(str(exc))
            return 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run_locked(self) -> int:
        try:
            self._start()
        except _Stopped:
            return 0
        except TidegateError as exc:
            self._error(f"start failed: {exc}")
            return 1
        self._print_banner()
        return self._supervise()

    # -- start -----------------------------------------------------------------

    def _start(self) -> None:
        plan, cfg = self.plan, self.plan.config
        for private in (plan.data_dir, plan.log_dir):
            private_dir(private)
        if plan.nats_port is not None:
            auth = ["-c", str(plan.nats_auth)] if plan.nats_auth else []
            monitor = plan.options.nats_monitor_port
            self.nats = NatsServer(plan.data_dir / "nats", port=plan.nats_port,
                                   monitor=monitor is not None, monitor_port=monitor,
                                   log_path=plan.log_dir / "nats.log", extra_args=auth)
            self.nats.name = "nats"
            log.info("starting nats-server on port %d", plan.nats_port)
            self._start_server(self.nats)
        if plan.redis_port is not None:
            self.redis = RedisServer(plan.data_dir / "redis", port=plan.redis_port,
                                     password=plan.redis_password,
                                     log_path=plan.log_dir / "redis.log")
            self.redis.name = "redis"
            log.info("starting redis-server on port %d", plan.redis_port)
            self._start_server(self.redis)
        self._setup()

        fd = os.open(plan.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:  # holds the dev key: owner only
            f.write(tgconfig.dump_toml(cfg))

        # Appended one by one: a failed spawn must not hide earlier children
        # from shutdown().
        for name in names("dispatcher", plan.options.dispatchers):
            self.dispatchers.append(self._tier(name, "dispatcher"))
        for name in names("worker", plan.options.workers):
            self.workers.append(self._tier(name, "worker"))
        edge_url = f"{plan.base_url.removesuffix('/v1')}/readyz"
        for name in names("edge", plan.options.edges):
            self.edges.append(self._tier(name, "edge", edge_url=edge_url))
        log.info("started %d dispatcher(s), %d worker(s) and %d edge(s); waiting for %s",
                 len(self.dispatchers), len(self.workers), len(self.edges), edge_url)
        self._wait_ready([*self.dispatchers, *self.workers, *self.edges])
        if plan.console_url is not None:
            self.console = self._console(plan.console_url)
            self._wait_ready([self.console])
        for child in self.children():
            self.supervisor.add(child, server=child in (self.nats, self.redis))

    def _setup(self) -> None:
        """``tidegate setup`` as admin: with per-tier credentials no tier may
        create a stream, consumer or bucket (docs/security.md), so they must
        exist before the tiers start, and again after an embedded NATS
        restart (memory-stored buckets are gone)."""
        from tidegate.control import provision

        log.info("setup: creating or updating streams, consumers and buckets")
        provision.setup(self.plan.config)
        log.info("setup: done")

    def _start_server(self, server: ManagedProcess) -> None:
        server.spawn()
        self._wait_ready([server])

    def _tier(self, name: str, tier: str, edge_url: str = "") -> ManagedProcess:
        argv = [sys.executable, "-m", "fleet", tier, "--config", str(self.plan.config_file)]
        log_path, env = self.plan.log_dir / f"{name}.log", self.plan.env_for(name)
        child = (_EdgeProcess(name, argv, log_path, env=env, port=self.plan.config.edge.port,
                              readyz=edge_url)
                 if edge_url else ManagedProcess(name, argv, log_path, env=env))
        child.spawn()
        return child

    def _console(self, url: str) -> ManagedProcess:
        """``tidegate console`` (the operator page) on 127.0.0.1, with the
        admin credentials ``tidegate setup`` used (fleet.run.console)."""
        argv = [sys.executable, "-m", "fleet", "console", "--config",
                str(self.plan.config_file), "--port", str(self.plan.console_port),
                "--data-dir", str(self.plan.data_dir)]
        child = ManagedProcess("console", argv, self.plan.log_dir / "console.log",
                               env=self.plan.child_env, ready=lambda: http_ok(url))
        child.spawn()
        return child

    def _wait_ready(self, children: list[ManagedProcess]) -> None:
        """Until every child's probe passes; any exit or the timeout is an error."""
        timeout = self.plan.options.ready_timeout
        pending = list(children)
        deadline = time.monotonic() + timeout
        while pending:
            if self.stop_requested.is_set():
                raise _Stopped
            for child in self.children():
                code = child.poll()
                if code is not None:
                    raise TidegateError(child.describe_failure(
                        f"{child.name} exited with code {code} while starting"))
            pending = [c for c in pending if not c.is_ready()]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise TidegateError(pending[0].describe_failure(
                    f"{pending[0].name} was not ready within {timeout:g}s"))
            self.stop_requested.wait(0.1)

    # -- supervise ---------------------------------------------------------------

    def _supervise(self) -> int:
        while not self.stop_requested.wait(0.2):
            failure = self.supervisor.tick()
            if failure is not None:
                self._error(failure)
                return 1
        return 0

    def _restart_ready(self, server: ManagedProcess) -> None:
        """Wait for a restarted embedded server (the supervisor's callback).

        Only the server is watched: tiers keep retrying NATS/Redis meanwhile,
        and one that exits is the supervisor's next tick's business.
        """
        deadline = time.monotonic() + self.plan.options.ready_timeout
        while not server.is_ready():
            code = server.poll()
            if code is not None:
                raise TidegateError(server.describe_failure(
                    f"{server.name} exited with code {code} while restarting"))
            if self.stop_requested.is_set():
                return
            if time.monotonic() >= deadline:
                raise TidegateError(server.describe_failure(
                    f"{server.name} was not ready within {self.plan.options.ready_timeout:g}s"))
            self.stop_requested.wait(0.1)
        if server is self.nats:
            self._setup()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_requested.is_set():
            # Second signal: the operator will not wait. Signals only, no
            # waiting: the main thread may be inside a wait of its own.
            for child in self.children():
                child.send_signal(SIGKILL)
            return
        self.stop_requested.set()

    def shutdown(self) -> None:
        """Stop every child, dependents first. Idempotent; never raises."""
        cfg = self.plan.config
        waves: list[tuple[list[ManagedProcess], float]] = [
            ([self.console] if self.console else [], _SERVER_STOP_TIMEOUT),
            (self.edges, cfg.edge.shutdown_timeout + _GRACE),
            (self.workers, cfg.worker.shutdown_timeout + _GRACE),
            (self.dispatchers, _SERVER_STOP_TIMEOUT + _GRACE),
            ([self.redis] if self.redis else [], _SERVER_STOP_TIMEOUT),
            ([self.nats] if self.nats else [], _SERVER_STOP_TIMEOUT),
        ]
        for procs, timeout in waves:
            live = [p for p in procs if p.running]
            if live:
                log.info("stopping %s", ", ".join(p.name for p in live))
            for p in stop_all(procs, timeout):
                log.warning("%s did not stop within %gs of SIGTERM: killed (see %s)",
                            p.name, timeout, p.log_path)
        self.supervisor.remove_state()

    # -- output ------------------------------------------------------------------

    def _error(self, message: str) -> None:
        print(f"tidegate up: {message}", file=self.err, flush=True)

    def _print_banner(self) -> None:
        print(banner(self.plan), file=self.out, flush=True)


@contextlib.contextmanager
def _lock(data_dir: Path) -> Iterator[None]:
    """Exclusive lock on ``<data_dir>/up.lock`` for the launcher's lifetime."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, nothing else changes
        yield
        return
    with open(data_dir / "up.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise TidegateError(f"another tidegate up is running with data dir {data_dir}; "
                                f"stop it or pass another --data-dir") from None
        yield


def up(options: UpOptions) -> int:
    """``tidegate up`` without the CLI's logging setup (used by tests and embedders)."""
    return Launcher(prepare(options)).run()
