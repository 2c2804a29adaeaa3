"""docker-compose.yml and deploy/compose.gpu.yml, validated against the Compose specification's JSON
schema and checked against the project (no Docker engine or compose plugin here, so the files are made
correct by construction and held to it by these checks)."""

# The schema is the compose-spec project's `schema/compose-spec.json` (Apache-2.0) as vendored by
# check-jsonschema, pinned in pyproject.toml (0.39.0: sha256 d549057e... of the file); its licence ships
# beside it (check_jsonschema/builtin_schemas/vendor/licenses/LICENSE.compose-spec).

from __future__ import annotations

import importlib.resources
import json
import re
from typing import Any

import jsonschema
import pytest
import yaml

from libs.telemetry import otlp_config
from tests.deploy.checks import (
    ROOT,
    check_command,
    check_settings,
    dockerfile_stages,
    dockerfile_tools,
    interpolate,
)

MESH = ("kv-broker", "scheduler", "prefill-worker", "decode-worker", "gateway")
SCALED = ("gateway", "prefill-worker", "decode-worker")
DOCKERFILE = ROOT / "deploy/Dockerfile"
TOOLS = dockerfile_tools(DOCKERFILE)


def load(path: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / path).read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load("docker-compose.yml")


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return load("deploy/compose.gpu.yml")


COMPOSE_SCHEMA = json.loads(
    (importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
)
_Validator = jsonschema.validators.validator_for(COMPOSE_SCHEMA)
COMPOSE_VALIDATOR = _Validator(COMPOSE_SCHEMA, format_checker=_Validator.FORMAT_CHECKER)


def schema_errors(doc: Any) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
        for e in COMPOSE_VALIDATOR.iter_errors(doc)
    ]


def interpolated(doc: Any) -> Any:
    """The file as compose sees it after `${VAR:-default}` interpolation with nothing set."""
    if isinstance(doc, dict):
        return {k: interpolated(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [interpolated(v) for v in doc]
    return interpolate(doc) if isinstance(doc, str) else doc


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/compose.gpu.yml"])
def test_compose_files_follow_the_compose_specification(path: str) -> None:
    doc = load(path)
    assert COMPOSE_SCHEMA["title"] == "Compose Specification"
    assert not schema_errors(doc), schema_errors(doc)
    assert not schema_errors(interpolated(doc)), schema_errors(interpolated(doc))


def test_the_compose_schema_catches_a_misspelt_key(compose) -> None:
    bad = json.loads(json.dumps(compose))  # a deep copy the module fixture does not share
    bad["services"]["gateway"]["healthchek"] = bad["services"]["gateway"].pop("healthcheck")
    bad["services"]["decode-worker"]["depends_on"]["nats"]["condition"] = "service_ready"
    errors = schema_errors(bad)
    assert any("healthchek" in e for e in errors) and any("service_ready" in e for e in errors), errors


def env_of(svc: dict[str, Any], over: dict[str, Any] | None = None) -> dict[str, str]:
    env = {**(svc.get("environment") or {}), **((over or {}).get("environment") or {})}
    return {k: interpolate(str(v)) for k, v in env.items()}


def test_top_level_shape(compose) -> None:
    assert set(compose) <= {"name", "services", "volumes", "networks", "configs", "secrets"} | {
        k for k in compose if k.startswith("x-")
    }
    assert {"nats", "jaeger", "tiny-model", *MESH} <= set(compose["services"])


def test_images_build_from_the_dockerfile(compose, gpu) -> None:
    stages = dockerfile_stages(DOCKERFILE)
    assert {"cpu", "gpu"} <= stages
    assert {"curl", "libibverbs1", "libnuma1"} <= TOOLS
    for name, svc in [*compose["services"].items(), *gpu["services"].items()]:
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            b = svc["build"]
            assert (ROOT / b["context"]).is_dir() and (ROOT / b["context"] / b["dockerfile"]).is_file(), name
            assert b["target"] in stages, name
    ignored = (ROOT / ".dockerignore").read_text()
    assert ".venv/" in ignored and ".git/" in ignored  # the build context stays small


def test_the_gpu_image_installs_one_cuda_major_throughout() -> None:
    """The gpu stage pins every CUDA package and they agree on the CUDA major of the base image: torch's
    wheel index, Mooncake's wheel, FlashInfer's JIT (the base's nvcc)."""
    text = DOCKERFILE.read_text()
    gpu = text[text.index(" AS gpu") :]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))
    major = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-devel-ubuntu[\d.]+", args["CUDA_IMAGE"]).group(1)
    assert args["TORCH_INDEX_URL"].endswith(f"/cu{major}0")
    pins = dict(re.findall(r'"([a-z0-9-]+)==\$\{(\w+)\}"', gpu))
    assert pins.keys() >= {
        "torch",
        "triton",
        "flashinfer-python",
        "apache-tvm-ffi",
        f"mooncake-transfer-engine-cuda{major}",
    }
    assert all(args.get(arg) for arg in pins.values()), pins
    assert "/opt/moemesh/versions.txt" in gpu  # the image says what it installed


def test_every_command_exists_in_the_project(compose) -> None:
    for name, svc in compose["services"].items():
        if "command" in svc and svc.get("image", "").startswith("moemesh"):
            service = check_command(svc["command"], TOOLS)
            assert service == (name if name in MESH else None), (name, svc["command"])
        health = (svc.get("healthcheck") or {}).get("test")
        if health:
            assert health[0] == "CMD", name
            tools = {"wget"} if svc.get("image", "").startswith("nats:") else TOOLS  # busybox in nats-alpine
            check_command(health[1:], tools)


def test_settings_are_fields_the_services_read_and_load(compose, gpu) -> None:
    for name in MESH:
        svc = compose["services"][name]
        cpu = check_settings(name, env_of(svc))
        gpu_settings = check_settings(name, env_of(svc, gpu["services"].get(name)))
        if name in ("prefill-worker", "decode-worker"):
            assert (cpu.device, cpu.model_dir) == ("cpu", "/models/tiny-v3")
            assert gpu_settings.device == "cuda" and gpu_settings.model_dir == "/models/model"
        if name != "gateway":  # the side port's readiness is what the health check asks
            assert cpu.http_port == 9090
            assert svc["healthcheck"]["test"][-1] == "http://127.0.0.1:9090/ready"
    gw = check_settings("gateway", env_of(compose["services"]["gateway"]))
    assert gw.host == "0.0.0.0" and f"{gw.port}/ready" in " ".join(
        compose["services"]["gateway"]["healthcheck"]["test"]
    )
    names = {
        check_settings(n, env_of(compose["services"][n], gpu["services"][n])).served_model_name
        for n in SCALED
    }
    assert names == {"deepseek-v3"}  # the gateway and the workers agree on the model's name


def test_tracing_goes_to_jaeger_over_otlp(compose) -> None:
    jaeger = compose["services"]["jaeger"]
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    ports = {p.split(":")[-1].split()[0] for p in jaeger["ports"]}
    for name in MESH:
        env = env_of(compose["services"][name])
        assert otlp_config(env) == ("otlp", "http/protobuf"), name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318" and "4318" in ports


def test_nats_runs_jetstream_and_services_wait_for_it(compose) -> None:
    services = compose["services"]
    assert "--jetstream" in services["nats"]["command"]
    for name in MESH:
        env = env_of(services[name])
        assert env["MOEMESH_NATS_URL"] == "nats://nats:4222"
        assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"


def test_dependencies_exist_and_health_conditions_have_health_checks(compose) -> None:
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        for dep, cond in deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps):
            assert dep in services, (name, dep)
            c = (cond or {}).get("condition", "service_started")
            assert c in ("service_started", "service_healthy", "service_completed_successfully"), (name, c)
            if c == "service_healthy":
                assert "healthcheck" in services[dep], (name, dep)
            if dep == "tiny-model":  # only in the cpu profile: optional elsewhere
                assert cond.get("required") is False


def test_scaled_services_have_no_fixed_names_or_host_ports(compose) -> None:
    for name in SCALED:
        svc = compose["services"][name]
        assert "container_name" not in svc and "hostname" not in svc, name
        for port in svc.get("ports", []):
            host = interpolate(str(port)).rsplit(":", 1)[0] if ":" in str(port) else ""
            assert not host or "-" in host, f"{name}: fixed host port {port} breaks --scale"
        assert svc["command"][:2] == ["moemesh", "serve"]  # instance id from the hostname


def test_cpu_profile_writes_the_model_the_services_read(compose) -> None:
    services = compose["services"]
    init = services["tiny-model"]
    assert init["profiles"] == ["cpu"] and init["restart"] == "no"
    out = init["command"][init["command"].index("--out") + 1]
    volume = next(v.split(":")[0] for v in init["volumes"] if out.startswith(v.split(":")[1]))
    for name in SCALED:
        model_dir = next(v for k, v in env_of(services[name]).items() if k.endswith("_MODEL_DIR"))
        assert model_dir == out
        mounts = {v.split(":")[0]: v.split(":")[1] for v in services[name]["volumes"]}
        assert model_dir.startswith(mounts[volume]) and volume in compose["volumes"]


def test_gpu_override_reserves_gpus_for_workers_only(gpu, compose) -> None:
    assert set(gpu["services"]) <= set(compose["services"])
    for name, svc in gpu["services"].items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if name in ("prefill-worker", "decode-worker"):
            assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            assert any("/models/model" in v for v in svc["volumes"])
        else:
            assert not devices, name
        assert svc["build"]["target"] == "gpu"


def test_monitoring_profile_scrapes_every_service(compose) -> None:
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    scraped: dict[str, int] = {}
    for job in prom["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            scraped.update({n: sd["port"] for n in sd["names"]})
    assert set(scraped) == set(MESH)
    for name in MESH:
        want = (
            8000 if name == "gateway" else check_settings(name, env_of(compose["services"][name])).http_port
        )
        assert scraped[name] == want, name
    for svc in ("prometheus", "grafana"):
        assert compose["services"][svc]["profiles"] == ["monitoring"]
        for v in compose["services"][svc]["volumes"]:
            assert (ROOT / v.split(":")[0]).exists(), v
