"""Restarting the children of ``tidegate up``: backoff, crash loops, a state file.

:class:`Supervisor` is polled by the launcher's loop (:meth:`Supervisor.tick`).

Invariants: a child that exits while the stack runs is restarted (a tier after
a backoff that doubles up to ``backoff_max`` and resets after
``stable_after`` seconds; an embedded server at once, waited for until ready).
The stack stops only for a crash loop (``crash_limit`` exits within
``crash_window``) or an embedded server that does not come back; :meth:`tick`
then returns the message. The state file ``<data-dir>/processes.json`` is
replaced atomically. Docs: docs/deploy.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.run.servers import ManagedProcess
from tidegate.errors import TidegateError

log = logging.getLogger("tidegate.launcher")

STATE_FILE = "processes.json"


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When and how often a dead child is started again."""

    backoff_initial: float = 0.5
    backoff_max: float = 10.0
    stable_after: float = 30.0  # up this long: the next exit restarts without delay
    crash_limit: int = 5  # this many exits within crash_window: a crash loop, stop
    crash_window: float = 60.0

    def __post_init__(self) -> None:
        if self.crash_limit < 1:
            raise ValueError(f"crash_limit must be >= 1, got {self.crash_limit}")
        if self.backoff_initial < 0 or self.backoff_max < self.backoff_initial:
            raise ValueError("need 0 <= backoff_initial <= backoff_max")


@dataclass(slots=True)
class ChildState:
    """What the supervisor knows about one child."""

    child: ManagedProcess
    server: bool  # an embedded nats/redis: restarted at once and waited for
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    restarts: int = 0
    last_exit: int | None = None
    last_exit_wall: float | None = None
    exits: deque[float] = field(default_factory=deque)  # monotonic exit times
    quick_failures: int = 0  # consecutive exits before stable_after
    restart_at: float | None = None  # pending restart (monotonic)


class Supervisor:
    """Watches children and restarts the dead ones per :class:`RestartPolicy`."""

    def __init__(self, policy: RestartPolicy, state_path: Path,
                 wait_ready: Callable[[ManagedProcess], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.state_path = state_path
        self._wait_ready = wait_ready  # raises TidegateError when not ready in time
        self._clock = clock
        self.states: dict[str, ChildState] = {}

    def add(self, child: ManagedProcess, server: bool = False) -> None:
        """Watch ``child`` (already spawned)."""
        now = self._clock()
        self.states[child.name] = ChildState(child=child, server=server, started=now)
        self.write_state()

    def backoff(self, state: ChildState) -> float:
        """Delay before the next start of a child that just exited."""
        if state.quick_failures == 0:
            return 0.0
        delay = self.policy.backoff_initial * 2 ** (state.quick_failures - 1)
        return float(min(self.policy.backoff_max, delay))

    def tick(self) -> str | None:
        """Handle exits and due restarts; a message when the stack must stop."""
        now = self._clock()
        changed = False
        for state in self.states.values():
            child = state.child
            if state.restart_at is None:
                code = child.poll()
                if code is None:
                    continue
                changed = True
                failure = self._exited(state, code, now)
                if failure is not None:
                    self.write_state()
                    return failure
            if state.restart_at is not None and now >= state.restart_at:
                changed = True
                failure = self._restart(state)
                if failure is not None:
                    self.write_state()
                    return failure
        if changed:
            self.write_state()
        return None

    def _exited(self, state: ChildState, code: int, now: float) -> str | None:
        child, policy = state.child, self.policy
        state.last_exit, state.last_exit_wall = code, time.time()
        state.exits.append(now)
        while state.exits and state.exits[0] < now - policy.crash_window:
            state.exits.popleft()
        if len(state.exits) >= policy.crash_limit:
            return child.describe_failure(
                f"{child.name} exited {len(state.exits)} time{'s' * (len(state.exits) > 1)} within "
                f"{policy.crash_window:g}s (last code {code}): a crash loop, not restarting; "
                f"stopping everything")
        ran = now - state.started
        state.quick_failures = 0 if ran >= policy.stable_after else state.quick_failures + 1
        delay = 0.0 if state.server else self.backoff(state)
        state.restart_at = now + delay
        log.warning("%s (pid %s) exited with code %d after %.1fs; restart %d in %.1fs (log %s)",
                    child.name, child.pid, code, ran, state.restarts + 1, delay, child.log_path)
        return None

    def _restart(self, state: ChildState) -> str | None:
        child = state.child
        state.restart_at = None
        try:
            child.kill_group()  # whatever the dead child left in its group
            child.spawn()
            if state.server:
                self._wait_ready(child)
        except TidegateError as exc:
            return (f"{child.name} could not be restarted ({exc}); the tiers cannot work "
                    f"without it; stopping everything")
        state.restarts += 1
        state.started, state.started_wall = self._clock(), time.time()
        log.warning("restarted %s (pid %s), restart %d", child.name, child.pid, state.restarts)
        return None

    # -- state file ------------------------------------------------------------

    def document(self) -> dict[str, Any]:
        """What the state file holds: every child, its pid and restart count."""
        return {
            "launcher_pid": os.getpid(),
            "updated": round(time.time(), 3),
            "processes": [{
                "name": name,
                "pid": s.child.pid,
                "running": s.child.running,
                "restarts": s.restarts,
                "last_exit_code": s.last_exit,
                "last_exit": None if s.last_exit_wall is None else round(s.last_exit_wall, 3),
                "up_since": round(s.started_wall, 3) if s.child.running else None,
                "restart_pending": s.restart_at is not None,
            } for name, s in self.states.items()],
        }

    def write_state(self) -> None:
        """Replace the state file atomically; an I/O error is logged, not raised."""
        tmp = self.state_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.document(), indent=1) + "\n")
            os.replace(tmp, self.state_path)
        except OSError as exc:
            log.warning("could not write %s: %s", self.state_path, exc)

    def remove_state(self) -> None:
        """Delete the state file (the stack is gone)."""
        try:
            self.state_path.unlink()
        except OSError:
            pass


def read_state(data_dir: Path) -> dict[str, Any] | None:
    """The state file of a running ``tidegate up`` in ``data_dir``, or None.

    None also when the file is left from a launcher that no longer runs (it
    was SIGKILLed before removing it).
    """
    try:
        doc = json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not _alive(doc.get("launcher_pid")):
        return None
    return doc


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def names(prefix: str, count: int) -> Sequence[str]:
    """Child names of one tier: ``edge`` for one, ``edge-1`` ... ``edge-N`` for several.

    Workers are always numbered (``worker-1``), as they were before several
    edges and dispatchers existed.
    """
    if count == 1 and prefix != "worker":
        return [prefix]
    return [f"{prefix}-{i}" for i in range(1, count + 1)]
