"""Results of a benchmark run: ``results.json``, ``results.md`` and PNG plots.

Everything is derived from the JSON document, so ``python -m
bench.report DIR`` redraws the table and the plots of an earlier run.
Plots need matplotlib (the ``bench`` extra); without it they are skipped with
a note.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench import grpcbench, quota, resumable_bench, wsbench

__all__ = ["check_targets", "markdown", "plot", "write"]

# The targets for this 2-core machine; ``higher`` says which way is better.
TARGETS = [
    ("ttft_overhead_p99_ms", "TTFT overhead over direct, p99, at 200 streams", 20.0, False),
    ("throughput_ratio", "throughput at 200 streams, share of direct", 0.90, True),
    ("cpu_us_per_chunk", "CPU per relayed chunk, gateway processes summed (µs)", 50.0, False),
    ("rss_per_idle_stream_kib", "RSS per idle open stream at the edge (KiB)", 20.0, False),
    ("idle_streams_held", "concurrent idle SSE streams held by one edge", 10_000, True),
    ("cancel_p99_ms", "cancel latency, p99 (ms)", 100.0, False),
]


def _fmt(value: Any, digits: int | None = None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if digits is None:
            digits = 2 if abs(value) < 10 else 1
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _runs(results: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = results.get("scenarios", {}).get(scenario, {}).get("runs", [])
    return runs


def _spread(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Closed-loop runs with users spread over the warm-up (the targets' and
    the plots' baseline; results older than the "arrival" key are all that)."""
    return [r for r in runs if r["mode"] == "closed" and r.get("arrival", "spread") == "spread"]


def _at_200(results: dict[str, Any], target: str) -> dict[str, Any] | None:
    runs = [r for r in _spread(_runs(results, "a")) if r["target"] == target]
    return min(runs, key=lambda r: abs(r["concurrency"] - 200)) if runs else None


def _load_label(run: dict[str, Any]) -> str:
    """c=200, c=200 burst or 150/s: one (a) run's load."""
    if run["mode"] != "closed":
        return f"{run['rate']:g}/s"
    return f"c={run['concurrency']}{' burst' if run.get('arrival') == 'burst' else ''}"


def _measures(results: dict[str, Any], target: str) -> dict[str, tuple[Any, str]]:
    """Each target measure for one gateway: (value, where it was measured)."""
    out: dict[str, tuple[Any, str]] = {}
    run = _at_200(results, target)
    if run is not None:
        where = f"c={run['concurrency']}"
        out["ttft_overhead_p99_ms"] = (run.get("ttft_overhead_ms", {}).get("p99"), where)
        out["throughput_ratio"] = (run.get("throughput_ratio"), where)
        out["cpu_us_per_chunk"] = (run.get("cpu_us_per_chunk"), where)
    for r in _runs(results, "b"):
        if r["target"] == target:
            name = "edge" if target == "tidegate" else target
            where = f"N={r['streams']}"
            out["rss_per_idle_stream_kib"] = (r["rss_per_stream_kib"].get(name), where)
            out["idle_streams_held"] = (r["open_ok"], where)
    for r in _runs(results, "c"):
        if r["target"] == target:
            out["cancel_p99_ms"] = (r["latency_ms"].get("p99"),
                                    f"c={results['scenarios']['c']['params']['concurrency']}")
    return out


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target measure: tidegate's value, the proxy's, and whether it is met."""
    ours = _measures(results, "tidegate")
    proxy = _measures(results, "proxy")
    rows = []
    for key, label, goal, higher in TARGETS:
        value, where = ours.get(key, (None, ""))
        met = None if value is None else (value >= goal if higher else value <= goal)
        rows.append({"key": key, "measure": label, "target": goal,
                     "tidegate": value, "where": where,
                     "proxy": proxy.get(key, (None, ""))[0], "met": met})
    return rows


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _pair(d: dict[str, Any], a: str = "p50", b: str = "p99") -> str:
    if not d or d.get(a) is None:
        return "-"
    return f"{_fmt(d.get(a))} / {_fmt(d.get(b))}"


def _telemetry_markdown(t: dict[str, Any]) -> list[str]:
    p = t["params"]
    env = "; ".join(f"{name}: " + (", ".join(f"`{k}={v}`" for k, v in e.items()) or "none")
                    for name, e in p["variants"].items())
    out = ["## (t) Telemetry overhead", "",
           f"(a)'s closed loop on tidegate at c={p['concurrency']} ({p['tokens']} tokens at "
           f"{p['itl_s'] * 1000:g} ms ITL; {p['warmup_s']:g} s warm-up, {p['window_s']:g} s "
           f"window), each variant {p['rounds']} time(s) on a fresh stack, the order "
           "alternating between rounds. OTEL_* variables of the tiers by variant "
           f"({env}; SINK is an OTLP/HTTP receiver in its own process, whose CPU is not "
           "counted as the gateway's). CPU sums edge, dispatcher, worker and nats-server.",
           ""]
    rows = []
    for r in t["runs"]:
        rows.append([r["variant"], r["round"], r["streams_per_s"], r["chunks_per_s"],
                     _pair(r["ttft_ms"]), r["error_count"], r.get("cpu_us_per_chunk"),
                     r.get("cpu_ms_per_request"),
                     ", ".join(f"{k} {_fmt(r['cpu_s'].get(k), 2)}"
                               for k in ("edge", "dispatcher", "worker", "nats-server",
                                         "otlp-sink")),
                     r.get("edge_metrics_bytes"), r.get("spans_per_request"),
                     "yes" if r.get("env_ok") else "**no**"])
    out += _table(["variant", "round", "streams/s", "chunks/s", "TTFT p50/p99", "errors",
                   "CPU µs/chunk", "CPU ms/req", "CPU s by process", "edge /metrics bytes",
                   "spans/request", "env checked"], rows)
    summary = t.get("summary", {})
    rows = []
    for name, v in summary.get("variants", {}).items():
        procs = v["process_us_per_chunk"]
        rows.append([name, v["rounds"], v["cpu_us_per_chunk"],
                     " / ".join(_fmt(x) for x in v["cpu_us_per_chunk_runs"]),
                     v["cpu_us_per_request"],
                     " / ".join(_fmt(procs.get(k)) for k in ("edge", "dispatcher", "worker",
                                                             "nats-server")),
                     v["streams_per_s"], v["spans_per_request"], v["sink_cpu_s"]])
    out += ["Means over the rounds (µs per chunk of each round after the slash list):", ""]
    out += _table(["variant", "rounds", "CPU µs/chunk", "each round", "CPU µs/request",
                   "µs/chunk edge / dispatcher / worker / nats", "streams/s", "spans/request",
                   "sink CPU s"], rows)
    rows = [[f"{d['variant']} - {d['against']}", d["cpu_us_per_chunk"],
             f"{d['cpu_us_per_chunk_pct']:+.1f} %", d.get("cpu_us_per_request"),
             "-" if d.get("cpu_us_per_request_pct") is None
             else f"{d['cpu_us_per_request_pct']:+.1f} %",
             " / ".join(_fmt(d["process_us_per_chunk"].get(k)) for k in
                        ("edge", "dispatcher", "worker", "nats-server"))]
            for d in summary.get("deltas", [])]
    out += ["Differences:", ""]
    out += _table(["difference", "µs/chunk", "share", "µs/request", "share",
                   "µs/chunk edge / dispatcher / worker / nats"], rows)
    return out


def _responses_markdown(r: dict[str, Any]) -> list[str]:
    p = r["params"]
    out = ["## (r) Responses and Messages API streaming overhead, next to chat's", "",
           f"(a)'s closed loop at c={p['concurrency']} ({p['tokens']} tokens at "
           f"{p['itl_s'] * 1000:g} ms ITL), chat completions, the Responses API and "
           "Anthropic's Messages API (passed through, and translated to chat), each against "
           "the direct run of the same API (the fake's own /v1/messages for both Messages "
           "rows).", ""]
    rows = [[run["api"], run["target"], run["streams_per_s"], run["chunks_per_s"],
             _pair(run["ttft_ms"]), _pair(run.get("ttft_overhead_ms", {})),
             run.get("cpu_us_per_chunk"), run.get("cpu_ms_per_request"),
             run.get("throughput_ratio"), run["error_count"]] for run in r["runs"]]
    out += _table(["API", "target", "streams/s", "chunks/s", "TTFT p50/p99",
                   "TTFT overhead p50/p99", "CPU µs/chunk", "CPU ms/req", "throughput ratio",
                   "errors"], rows)
    return out


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    m = meta["machine"]
    out = [f"# tidegate bench: {meta['profile']} run, {meta['started']}", "",
           f"Machine: {m['nproc']} cores ({m['cpu_model']}), {m['ram_gib']} GiB RAM, "
           f"Linux {m['kernel']}, Python {m['python']}. The load generator, the fake "
           "backend and every measured process share these cores.", "",
           f"Command: `{meta['command']}` ({meta['duration_s']} s). Load average "
           f"before / after: {meta['loadavg'][0]} / {meta['loadavg'][1]} (other work on "
           "the machine shows here).", ""]
    out += [f"- {note}" for note in meta.get("notes", [])]
    out += ["", "## Targets", ""]
    rows = []
    for r in check_targets(results):
        goal = f"{'≥' if r['key'] in ('throughput_ratio', 'idle_streams_held') else '≤'} " \
               f"{_fmt(r['target'], 2 if r['key'] == 'throughput_ratio' else 0)}"
        met = {True: "met", False: "**missed**", None: "not measured"}[r["met"]]
        rows.append([r["measure"], goal, r["tidegate"], r["where"], r["proxy"], met])
    out += _table(["measure", "target", "tidegate", "at", "plain proxy", "verdict"], rows)
    scen = results["scenarios"]
    if "a" in scen:
        p = scen["a"]["params"]
        out += ["## (a) Overhead and throughput", "",
                f"{p['tokens']} tokens at {p['itl_s'] * 1000:g} ms ITL, backend TTFT "
                f"{p['ttft_s'] * 1000:g} ms; {p['warmup_s']:g} s warm-up, then a "
                f"{p['window_s']:g} s window. Closed loop at each concurrency (users spread "
                "over the first half of the warm-up, and, marked burst, all at once), then an open "
                f"loop (Poisson, {p['open_rate_per_s']:g}/s, latency from the scheduled "
                "send time). Times in ms; CPU/chunk and CPU/req sum the gateway's processes "
                "(tidegate: edge, dispatcher, worker, nats-server); cores busy counts every "
                "process incl. the load generator and the fake backend.", ""]
        rows = []
        for r in scen["a"]["runs"]:
            rows.append([r["target"], _load_label(r), r["streams_per_s"], r["chunks_per_s"],
                         _pair(r["ttft_ms"]), _pair(r.get("ttft_overhead_ms", {})),
                         _pair(r["itl_ms"]), _pair(r["total_ms"]),
                         r.get("throughput_ratio"), r["error_count"],
                         r.get("cpu_us_per_chunk"), r.get("cpu_ms_per_request"),
                         r["machine_cores_busy"]])
        out += _table(["target", "load", "streams/s", "chunks/s", "TTFT p50/p99",
                       "TTFT overhead p50/p99", "ITL p50/p99", "total p50/p99",
                       "throughput vs direct", "errors", "CPU µs/chunk", "CPU ms/req",
                       "cores busy"], rows)
        over = [r for r in scen["a"]["runs"] if "over_floor" in r]
        if over:
            out += ["tidegate over the design's floor (`bench.floor`: the same edge -> "
                    "JetStream -> worker shape with none of the features) at the same load: "
                    "CPU per chunk and TTFT p99 as ratios, throughput as the difference of "
                    "the shares of direct (targets: ≤ 1.15x, ≤ 1.3x, ≥ -0.03).", ""]
            out += _table(["load", "CPU µs/chunk", "TTFT p99", "throughput share"],
                          [[_load_label(r), f"{_fmt(r['over_floor']['cpu_us_per_chunk'])}x",
                            f"{_fmt(r['over_floor']['ttft_p99'])}x",
                            r["over_floor"]["throughput_share"]] for r in over])
        cpu_rows = [[r["target"], r.get("concurrency", r.get("rate")),
                     ", ".join(f"{k} {_fmt(v, 2)}" for k, v in r["cpu_s"].items()),
                     ", ".join(f"{k} {_fmt(v, 2)}"
                               for k, v in r.get("runqueue_wait_s", {}).items()),
                     r["loadgen_cpu_s"]] for r in scen["a"]["runs"]]
        out += ["CPU seconds per process over the window, and seconds each was runnable "
                "but waiting for a core (run-queue wait, from /proc/<pid>/task/*/schedstat: "
                "where latency comes from when the machine has more work than cores):", ""]
        out += _table(["target", "load", "CPU s", "run-queue wait s", "load generator CPU s"],
                      cpu_rows)
    if "b" in scen:
        p = scen["b"]["params"]
        out += ["## (b) Idle streams", "",
                f"{p['streams']} streams held open by a backend that never answers "
                f"(heartbeat interval {p['heartbeat_interval_s']:g} s). RSS in KiB.", ""]
        rows = []
        for r in scen["b"]["runs"]:
            for name, rss in r["rss_kib"].items():
                rows.append([r["target"], name, r["open_ok"], r["open_s"],
                             r["pings_during_hold"], rss["before"], rss["held"],
                             rss["after_close"], r["rss_per_stream_kib"][name],
                             r["idle_cpu_cores"].get(name)])
        out += _table(["target", "process", "streams open", "open s", "pings in hold",
                       "RSS before", "RSS held", "RSS after close", "KiB/stream",
                       "idle CPU (cores)"], rows)
    if "c" in scen:
        p = scen["c"]["params"]
        out += ["## (c) Cancel latency", "",
                f"{p['concurrency']} clients x {p['rounds']} rounds; each closes its "
                f"connection after {p['cancel_after_chunks']} chunks. Latency from the "
                "client's close to the fake backend seeing its connection closed, in ms.",
                ""]
        rows = [[r["target"], r["cancels"], r["outcomes"]["closed"],
                 r["outcomes"]["completed_anyway"], r["outcomes"]["still_open"],
                 r["latency_ms"].get("p50"), r["latency_ms"].get("p99"),
                 r["latency_ms"].get("max")] for r in scen["c"]["runs"]]
        out += _table(["target", "cancels", "backend closed", "ran to the end",
                       "still open", "p50", "p99", "max"], rows)
    if "d" in scen:
        p = scen["d"]["params"]
        out += ["## (d) Slow clients", "",
                f"{p['clients']} clients reading {p['client_bytes_per_s']} B/s for "
                f"{p['duration_s']:g} s through a 4 KiB receive buffer; the backend writes "
                "as fast as it can, so only backpressure holds it back. Backend bytes are "
                "summed over all clients at half time and at the end: the same at both "
                "means the backend was stopped by backpressure; growth means kernel socket "
                "buffers on the way were still filling.", ""]
        rows = []
        for r in scen["d"]["runs"]:
            for name, rss in r["rss_kib"].items():
                rows.append([r["target"], name, r["client_bytes_p50"], r["backend_bytes_p50"],
                             r["backend_bytes_total_half"], r["backend_bytes_total_end"],
                             rss["start"], rss["max"], rss["end"]])
        out += _table(["target", "process", "client read B (p50)", "backend wrote B (p50)",
                       "backend total B at half time", "at end", "RSS start KiB", "RSS max",
                       "RSS end"], rows)
    if "r" in scen:
        out += _responses_markdown(scen["r"])
    if "w" in scen:
        out += wsbench.markdown(scen["w"])
    if "g" in scen:
        out += grpcbench.markdown(scen["g"])
    if "s" in scen:
        out += resumable_bench.markdown(scen["s"])
    if "t" in scen:
        out += _telemetry_markdown(scen["t"])
    if "q" in scen:
        out += quota.markdown(scen["q"])
    if "j" in scen:
        from bench import batch_bench

        out += batch_bench.markdown(scen["j"])
    if "f" in scen:
        from bench import affinity_bench

        out += ["## (f) affinity: routing across replicas", ""]
        out += affinity_bench.markdown(scen["f"])
    for key, prof in results.get("profiles", {}).items():
        out += [f"## Profile {key} ({prof['samples']} busy samples)", ""]
        out += _table(["library (self time)", "%"], prof.get("area_pct", []))
        out += _table(["self", "%"], prof["self_pct"][:15])
        out += _table(["inclusive", "%"], prof["inclusive_pct"][:25])
    return "\n".join(out)


def plot(results: dict[str, Any], out: Path) -> list[str]:
    """PNG plots next to the JSON; returns the files written (none without matplotlib)."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        return []
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    written: list[str] = []
    quantiles = [q / 100 for q in range(101)]
    runs_a = _runs(results, "a")
    closed = _spread(runs_a)
    if closed:
        loads = sorted({r["concurrency"] for r in closed})
        fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4), squeeze=False)
        for ax, c in zip(axes[0], loads, strict=True):
            for r in closed:
                if r["concurrency"] == c and r["ttft_cdf_ms"]:
                    ax.plot(r["ttft_cdf_ms"], quantiles, label=r["target"])
            ax.set_xscale("log")
            ax.set_title(f"TTFT CDF, {c} concurrent streams")
            ax.set_xlabel("time to first token (ms, client side)")
            ax.set_ylabel("fraction of streams")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ttft_cdf.png", dpi=100)
        plt.close(fig)
        written.append("ttft_cdf.png")

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for target in dict.fromkeys(r["target"] for r in closed):
            rs = sorted((r for r in closed if r["target"] == target),
                        key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in rs]
            ax1.plot(xs, [r["streams_per_s"] for r in rs], marker="o", label=target)
            ax2.plot(xs, [r["chunks_per_s"] for r in rs], marker="o", label=target)
        for ax, what in ((ax1, "completed streams/s"), (ax2, "chunks/s delivered")):
            ax.set_xscale("log")
            ax.set_xlabel("concurrent streams (closed loop)")
            ax.set_ylabel(what)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=100)
        plt.close(fig)
        written.append("throughput.png")
        written += _scale_plot(plt, runs_a, out)
    runs_c = [r for r in _runs(results, "c") if r["latency_cdf_ms"]]
    if runs_c:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs_c:
            ax.plot(r["latency_cdf_ms"], quantiles, label=r["target"])
        ax.set_xscale("log")
        ax.set_title("cancel latency CDF (client close -> backend closed)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of cancels")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "cancel_cdf.png", dpi=100)
        plt.close(fig)
        written.append("cancel_cdf.png")
    return written


def write(results: dict[str, Any], out: Path) -> None:
    """results.json, results.md and the plots into ``out``."""
    plots = plot(results, out)
    if plots:
        results["meta"]["plots"] = plots
    else:
        results["meta"].setdefault("notes", []).append(
            "Plots skipped: matplotlib is not importable (pip install 'tidegate[bench]').")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results) + "\n")


def _main(directory: Path) -> None:
    from bench.profiling import summarize

    results = json.loads((directory / "results.json").read_text())
    for prof in results.get("profiles", {}).values():
        raw = directory / prof["file"]
        if raw.exists():  # summarise again: the summary may have changed since
            prof.update(summarize(raw))
    write(results, directory)


if __name__ == "__main__":
    _main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results"))


def _scale_plot(plt: Any, runs_a: list[dict[str, Any]], out: Path) -> list[str]:
    """The scale curve: throughput against direct, TTFT overhead p99 and CPU
    per chunk over the concurrencies, per target; burst arrivals dashed."""
    closed = [r for r in runs_a if r["mode"] == "closed"]
    if len({r["concurrency"] for r in closed}) < 2:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("throughput_ratio", "throughput vs direct"),
              ("ttft_overhead_p99", "TTFT overhead p99 (ms)"),
              ("cpu_us_per_chunk", "gateway CPU µs per chunk"))
    series = dict.fromkeys((r["target"], r.get("arrival", "spread")) for r in closed)
    for ax, (field, label) in zip(axes, panels, strict=True):
        for target, arrival in series:
            rs = sorted((r for r in closed if r["target"] == target
                         and r.get("arrival", "spread") == arrival),
                        key=lambda r: r["concurrency"])
            if field == "ttft_overhead_p99":
                ys = [r.get("ttft_overhead_ms", {}).get("p99") for r in rs]
            else:
                ys = [r.get(field) for r in rs]
            points = [(r["concurrency"], y) for r, y in zip(rs, ys, strict=True)
                      if y is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o",
                        linestyle="--" if arrival == "burst" else "-",
                        label=f"{target}{' (burst)' if arrival == 'burst' else ''}")
        ax.set_xscale("log")
        ax.set_xlabel("concurrent streams (closed loop)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "scale.png", dpi=100)
    plt.close(fig)
    return ["scale.png"]
