"""Deploy files that have been run through their tools: compose.yaml, deploy/k8s/.

* compose.yaml: checked structurally here (3 NATS nodes routed to each
  other with JetStream, Redis, 2 edges, 2 dispatchers, 2 workers, every
  service with a healthcheck and a restart policy, R3 streams); and with
  ``docker compose config`` where the compose plugin exists.
* With a Docker engine: NATS and Redis containers (testcontainers) and the
  pipeline through them (skipped with the reason otherwise).
* deploy/k8s/: rendered with ``kubectl kustomize`` and schema-checked with
  kubernetes-validate (--strict); every Deployment's probes, the preStop
  drain within terminationGracePeriodSeconds, PDBs, the KEDA trigger, and the
  NATS chart's values. Skipped with a note where a tool is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.servers import ContainerServer, docker_engine_available
from tidegate import config as tgconfig

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return doc


def test_compose_runs_a_three_node_nats_cluster() -> None:
    services = _compose()["services"]
    nodes = [services[f"nats-{i}"] for i in (1, 2, 3)]
    names = set()
    for i, node in enumerate(nodes, 1):
        cmd = node["command"]
        assert "-js" in cmd
        names.add(cmd[cmd.index("--server_name") + 1])
        routes = cmd[cmd.index("--routes") + 1].split(",")
        assert sorted(routes) == sorted(f"nats://nats-{j}:6222" for j in (1, 2, 3) if j != i)
        assert cmd[cmd.index("--cluster_name") + 1] == "tidegate"
        assert node["volumes"] == [f"nats-{i}:/data"]
    assert len(names) == 3


def test_compose_tiers_two_of_each_healthchecked_on_all_nats_urls() -> None:
    services = _compose()["services"]
    assert {"redis", "edge-1", "edge-2", "dispatcher", "worker"} <= set(services)
    assert services["dispatcher"]["deploy"]["replicas"] == 2
    assert services["worker"]["deploy"]["replicas"] == 2
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in ("edge-1", "edge-2", "dispatcher", "worker"):
        env = services[name]["environment"]
        assert env["TIDEGATE_NATS_URL"].split(",") == [
            f"nats://nats-{i}:4222" for i in (1, 2, 3)]
        # The tiers accept this environment as it is.
        cfg = tgconfig.load(None, {k: str(v) for k, v in env.items()
                                   if k.startswith("TIDEGATE")} | {"TIDEGATE_DEV_KEY": "k"}, {})
        assert cfg.streams.replicas == 3
    assert "/readyz" in " ".join(services["edge-1"]["healthcheck"]["test"])
    assert "9100/healthz" in " ".join(services["worker"]["healthcheck"]["test"])
    assert {p.split(":")[0] for s in ("edge-1", "edge-2") for p in services[s]["ports"]} == {
        "8080", "8081"}
    # The edges' /metrics (keyless) is on the unpublished metrics port, not the API's.
    assert all(p.endswith(":8080") for s in ("edge-1", "edge-2") for p in services[s]["ports"])
    assert services["edge-1"]["environment"]["TIDEGATE_METRICS_PORT"] == "9100"


def _has_compose_plugin() -> bool:
    if not shutil.which("docker"):
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _has_compose_plugin(), reason="no `docker compose` plugin here")
def test_docker_compose_config_accepts_it() -> None:
    out = subprocess.run(["docker", "compose", "-f", str(ROOT / "compose.yaml"), "config", "-q"],
                         capture_output=True, text=True, timeout=60,
                         env={"TIDEGATE_DEV_KEY": "sk-test",
                              "PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert out.returncode == 0, out.stderr


@pytest.mark.pipeline
@pytest.mark.skipif(not docker_engine_available(),
                    reason="no Docker engine answers (testcontainers needs one)")
def test_pipeline_runs_against_nats_and_redis_containers(tmp_path: Path) -> None:
    from tests.pipeline import Pipeline

    nats_c, redis_c = ContainerServer.nats(), ContainerServer.redis()
    try:
        pipeline = Pipeline(tmp_path, nats_c.url, redis_c.url)
        pipeline.start()
        try:
            status, body = pipeline.post("/v1/chat/completions", {
                "model": "tidegate-sim", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200, body
        finally:
            pipeline.stop()
    finally:
        nats_c.stop()
        redis_c.stop()


# --------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    if not shutil.which("kubectl"):
        pytest.skip("kubectl not installed (Debian: apt-get install kubernetes-client)")
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _of(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_kustomize_renders_schema_valid_manifests(rendered: list[dict[str, Any]],
                                                  tmp_path: Path) -> None:
    validate = Path(sys.executable).parent / "kubernetes-validate"
    if not validate.exists() and not shutil.which("kubernetes-validate"):
        pytest.skip("kubernetes-validate not installed (pip install kubernetes-validate)")
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(rendered))
    out = subprocess.run([str(validate if validate.exists() else "kubernetes-validate"),
                          "--strict", "--quiet", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # The one resource without a built-in schema is KEDA's CRD, checked below.
    unknown = [line for line in out.stdout.splitlines() if "Couldn't find schema" in line]
    assert all("ScaledObject" in line for line in unknown), unknown


def test_tiers_have_probes_and_drain_within_the_grace_period(
        rendered: list[dict[str, Any]]) -> None:
    deployments = _of(rendered, "Deployment")
    assert {"edge", "dispatcher", "worker"} <= set(deployments)
    defaults = tgconfig.Config()
    drains = {"edge": defaults.edge.shutdown_timeout,
              "worker": defaults.worker.shutdown_timeout, "dispatcher": 5.0}
    for name, drain in drains.items():
        pod = deployments[name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["readinessProbe"]["httpGet"]["path"] in ("/readyz", "/healthz")
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        pre_stop_s = float(pre_stop["command"][-1]) if pre_stop else 0.0
        assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain, name
    edge = deployments["edge"]["spec"]["template"]["spec"]["containers"][0]
    assert edge["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # /metrics on its own container port; the Service exposes the API port only.
    assert {p["name"]: p["containerPort"] for p in edge["ports"]} == {"http": 8080,
                                                                      "metrics": 9100}
    (service,) = [r for r in rendered if r.get("kind") == "Service"
                  and r["metadata"]["name"] == "edge"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    assert edge["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_pdbs_keda_and_config(rendered: list[dict[str, Any]]) -> None:
    pdbs = _of(rendered, "PodDisruptionBudget")
    assert set(pdbs) == {"edge", "dispatcher", "worker"}
    (scaled,) = _of(rendered, "ScaledObject").values()
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "worker"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "nats-jetstream"
    subjects = tgconfig.Config().nats.subjects
    assert trigger["metadata"]["stream"] == subjects.jobs_stream
    assert trigger["metadata"]["consumer"] == subjects.worker_consumer("tidegate-sim")
    env = _of(rendered, "ConfigMap")["tidegate-env"]["data"]
    assert len(env["TIDEGATE_NATS_URL"].split(",")) == 3
    cfg = tgconfig.load(None, dict(env), {})
    assert cfg.streams.replicas == 3
    assert all(d["metadata"].get("namespace", "tidegate") == "tidegate" for d in rendered)
    # The admin step the tiers' restricted credentials rely on (docs/security.md).
    setup = _of(rendered, "Job")["tidegate-setup"]["spec"]["template"]["spec"]
    (container,) = setup["containers"]
    assert container["args"] == ["setup"]
    assert container["envFrom"] == [{"configMapRef": {"name": "tidegate-env"}}]


def test_nats_chart_values_run_a_jetstream_cluster_of_three() -> None:
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    assert values["fullnameOverride"] == "nats"  # the pod names config.yaml lists
    # Routes keep nats-server's own pings (fleet.run.nats_sync.ROUTE_PING).
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3,
                                           "merge": {"ping_interval": "2m"}}
    js = values["config"]["jetstream"]
    assert js["enabled"] is True
    assert js["fileStore"]["pvc"]["enabled"] is True
