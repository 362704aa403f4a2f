"""``tidegate up`` supervises: dead children come back, crash loops stop the stack.

The unit tests drive :class:`~fleet.run.supervisor.Supervisor` with real
short-lived processes and a fake clock (backoff and crash windows without
waiting); the pipeline tests run ``tidegate up`` as a subprocess, SIGKILL its
children and watch them come back, and check that several edges share one
port with every one of them holding client connections.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from fleet.run.servers import ManagedProcess, port_is_free, tcp_sockets
from fleet.run.supervisor import RestartPolicy, Supervisor, names, read_state
from tests.servers import is_alive, kill_all, proc_identity, wait_until
from tests.test_launcher import DEV_KEY, Up

pytestmark = pytest.mark.usefixtures("clean_env")


# --------------------------------------------------------------------------
# Supervisor: real processes, fake clock
# --------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _exiting(tmp_path: Path, name: str, code: int = 3) -> ManagedProcess:
    child = ManagedProcess(name, [sys.executable, "-c", f"import sys; sys.exit({code})"],
                           tmp_path / f"{name}.log")
    child.spawn()
    return child


def _wait_exit(child: ManagedProcess) -> None:
    assert wait_until(lambda: child.poll() is not None, 15), f"{child} did not exit"


def test_dead_child_restarts_with_doubling_backoff_then_crash_loop_stops(
        tmp_path: Path) -> None:
    clock = Clock()
    policy = RestartPolicy(backoff_initial=0.5, backoff_max=2.0, stable_after=30.0,
                           crash_limit=4, crash_window=60.0)
    sup = Supervisor(policy, tmp_path / "processes.json", lambda _c: None, clock=clock)
    child = _exiting(tmp_path, "worker-1")
    sup.add(child)
    delays = []
    for _ in range(3):
        _wait_exit(child)
        assert sup.tick() is None  # exit seen: a restart is scheduled, not done yet
        state = sup.states["worker-1"]
        assert state.restart_at is not None
        delays.append(state.restart_at - clock.now)
        clock.now = state.restart_at - 0.01
        assert sup.tick() is None
        assert sup.states["worker-1"].restart_at is not None
        clock.now = state.restart_at
        assert sup.tick() is None
        assert state.restart_at is None
        assert state.child.pid is not None
        clock.now += 1.0  # dies again well before stable_after
    assert delays == [0.5, 1.0, 2.0]  # doubling, capped at backoff_max
    assert sup.states["worker-1"].restarts == 3
    doc = json.loads((tmp_path / "processes.json").read_text())
    assert doc["processes"][0]["restarts"] == 3
    assert doc["processes"][0]["last_exit_code"] == 3
    _wait_exit(child)
    failure = sup.tick()  # the 4th exit within 60 s
    assert failure is not None
    assert "worker-1 exited 4 times within 60s" in failure
    assert "crash loop" in failure
    assert "worker-1.log" in failure  # the log tail is named


def test_a_stable_child_restarts_at_once_and_old_exits_leave_the_window(
        tmp_path: Path) -> None:
    clock = Clock()
    policy = RestartPolicy(stable_after=10.0, crash_limit=2, crash_window=60.0)
    sup = Supervisor(policy, tmp_path / "processes.json", lambda _c: None, clock=clock)
    child = _exiting(tmp_path, "edge", code=0)
    sup.add(child)
    for _ in range(3):
        clock.now += 61.0  # ran long (stable) and the previous exit left the window
        _wait_exit(child)
        assert sup.tick() is None  # no backoff: restarted in the same tick
        assert sup.states["edge"].restart_at is None
    assert sup.states["edge"].restarts == 3


def test_a_server_that_does_not_come_back_stops_the_stack(tmp_path: Path) -> None:
    def never_ready(child: ManagedProcess) -> None:
        from tidegate.errors import TidegateError

        raise TidegateError(f"{child.name} was not ready within 1s")

    sup = Supervisor(RestartPolicy(), tmp_path / "processes.json", never_ready, clock=Clock())
    child = _exiting(tmp_path, "nats")
    sup.add(child, server=True)
    _wait_exit(child)
    failure = sup.tick()  # servers restart at once, and are waited for
    assert failure is not None
    assert "nats could not be restarted" in failure
    assert "stopping everything" in failure


def test_state_file_is_only_read_while_its_launcher_lives(tmp_path: Path) -> None:
    (tmp_path / "processes.json").write_text(json.dumps(
        {"launcher_pid": os.getpid(), "processes": []}))
    assert read_state(tmp_path) == {"launcher_pid": os.getpid(), "processes": []}
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (tmp_path / "processes.json").write_text(json.dumps(
        {"launcher_pid": int(dead.stdout), "processes": []}))
    assert read_state(tmp_path) is None
    (tmp_path / "processes.json").write_text("{half")
    assert read_state(tmp_path) is None


def test_names() -> None:
    assert names("edge", 1) == ["edge"]
    assert names("edge", 2) == ["edge-1", "edge-2"]
    assert names("worker", 1) == ["worker-1"]


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="crash_limit"):
        RestartPolicy(crash_limit=0)
    with pytest.raises(ValueError, match="backoff"):
        RestartPolicy(backoff_initial=2.0, backoff_max=1.0)


# --------------------------------------------------------------------------
# tidegate up as a subprocess
# --------------------------------------------------------------------------


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def start(*args: str) -> Up:
        running = Up(tmp_path / f"data{len(started)}", *args)
        started.append(running)
        return running

    try:
        yield start
    finally:
        for running in started:
            running.cleanup()


def _pids(up: Up, tier: str) -> list[int]:
    """Pids of the live ``python -m fleet <tier>`` children of ``up``."""
    state = read_state(up.data_dir)
    assert state is not None, up.diagnostics()
    return [p["pid"] for p in state["processes"]
            if p["name"].split("-")[0] == tier and p["running"]]


def _state_of(up: Up, name: str) -> dict[str, object]:
    state = read_state(up.data_dir) or {"processes": []}
    return next((p for p in state["processes"] if p["name"] == name), {})


def _chat(url: str) -> str:
    client = openai.OpenAI(base_url=url, api_key=DEV_KEY, max_retries=0, timeout=30)
    with client, client.chat.completions.create(
            model="tidegate-sim", stream=True, max_tokens=8,
            messages=[{"role": "user", "content": "hi"}]) as stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices)


@pytest.mark.pipeline
def test_a_killed_worker_comes_back_and_status_counts_it(start_up: Callable[..., Up]) -> None:
    up = start_up("--workers", "1")
    url = up.wait_url()
    (worker,) = _pids(up, "worker")
    os.kill(worker, signal.SIGKILL)
    assert wait_until(lambda: _state_of(up, "worker-1").get("restarts") == 1
                      and _state_of(up, "worker-1").get("running"), 30), up.diagnostics()
    assert _state_of(up, "worker-1")["pid"] != worker
    assert _state_of(up, "worker-1")["last_exit_code"] == -signal.SIGKILL
    assert up.proc.poll() is None, "tidegate up stopped instead of restarting"
    # The new worker serves: streams complete again (it re-registers and pulls).
    assert wait_until(lambda: bool(_chat(url).strip()), 60, interval=0.5), up.diagnostics()
    assert "restarted worker-1" in up.stderr_path.read_text(), up.diagnostics()

    status = subprocess.run(
        [sys.executable, "-m", "fleet", "status", "--json", "--interval", "0.2",
         "--config", str(up.data_dir / "tidegate.toml")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert status.returncode == 0, status.stderr
    procs = {p["name"]: p for p in json.loads(status.stdout)["processes"]}
    assert procs["worker-1"]["restarts"] == 1
    assert procs["worker-1"]["running"]
    assert procs["dispatcher"]["restarts"] == 0
    assert {"nats", "redis", "dispatcher", "worker-1", "edge"} <= set(procs)

    up.proc.send_signal(signal.SIGTERM)
    try:  # bounded by each wave's own timeout, which a loaded box may need
        code = up.proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tidegate up did not stop on SIGTERM\n{up.diagnostics()}")
    assert (code, "did not stop" in up.stderr_path.read_text()) == (0, False), up.diagnostics()
    assert not (up.data_dir / "processes.json").exists()


@pytest.mark.pipeline
def test_a_crash_loop_stops_the_stack_with_a_clear_message(
        start_up: Callable[..., Up]) -> None:
    up = start_up("--crash-limit", "2", "--crash-window", "120")
    up.wait_url()
    children = list(up.children)
    (first,) = _pids(up, "dispatcher")
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: _state_of(up, "dispatcher").get("restarts") == 1
                      and _state_of(up, "dispatcher").get("running"), 30), up.diagnostics()
    (second,) = _pids(up, "dispatcher")
    second_identity = proc_identity(second)
    os.kill(second, signal.SIGKILL)
    try:
        code = up.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tidegate up ignored a crash loop\n{up.diagnostics()}")
    assert code == 1
    err = up.stderr_path.read_text()
    assert "dispatcher exited 2 times within 120s" in err, err
    assert "crash loop" in err
    assert "dispatcher.log" in err  # the log tail is shown
    everyone = [*children, *([second_identity] if second_identity else [])]
    assert wait_until(lambda: not any(is_alive(c) for c in everyone), 15), up.diagnostics()
    kill_all(everyone)
    assert port_is_free(up.port)


@pytest.mark.pipeline
def test_two_edges_share_one_port_and_both_serve(start_up: Callable[..., Up]) -> None:
    up = start_up("--edges", "2")
    url = up.wait_url()
    assert "Edges:    2 on one port (SO_REUSEPORT)" in up.output()
    edges = _pids(up, "edge")
    assert len(edges) == 2
    # The launcher calls an edge ready only once that process itself listens.
    assert all(tcp_sockets(pid, up.port) == 1 for pid in edges)
    connections = []
    try:
        for _ in range(24):
            conn = http.client.HTTPConnection("127.0.0.1", up.port, timeout=10)
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            connections.append(conn)  # kept open: its socket stays in one edge
        held = {pid: tcp_sockets(pid, up.port, 'established') for pid in edges}
        # 24 connections spread by the kernel: all on one edge has p = 2^-23.
        assert all(n for n in held.values()), held
        assert sum(held.values()) == 24, held
    finally:
        for conn in connections:
            conn.close()
    assert _chat(url).strip(), up.diagnostics()

    # One edge killed: the other keeps serving on the port while it restarts.
    os.kill(edges[0], signal.SIGKILL)
    assert wait_until(lambda: _state_of(up, "edge-1").get("restarts") == 1
                      and _state_of(up, "edge-1").get("running"), 30), up.diagnostics()
    assert wait_until(lambda: bool(_chat(url).strip()), 30, interval=0.5), up.diagnostics()
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=30) == 0, up.diagnostics()
    assert wait_until(lambda: port_is_free(up.port), 10)
