"""The Kubernetes manifests in ``deploy/kubernetes/`` (1P1D, xPyD with discovery, llm-d's
layout): every object valid against the Kubernetes schemas (``kubernetes-validate``, strict:
an unknown field fails), and every engine's and proxy's command line, environment, ports,
probes and drain settings agreeing with what our settings models and vLLM's own parser read.
No cluster: the objects are parsed from the files."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml

from mooncake_vllm.core.settings import CONFIG_PATH_ENV
from mooncake_vllm.p2p.config import load_settings, resolve
from mooncake_vllm.proxy.server import parse_args

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
LAYOUTS = ["pair.yaml", "xpyd.yaml", "llm-d.yaml"]
K8S_VERSION = "1.33"
POD_IP = "10.1.2.3"
SECRET = "mooncake-vllm-secret"


def objects(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def layout(name: str) -> list[dict]:
    """What ``kubectl apply -f base.yaml -f NAME`` creates."""
    return objects("base.yaml") + objects(name)


@pytest.mark.parametrize("name", ["base.yaml", *LAYOUTS])
def test_every_object_is_valid_against_the_kubernetes_schemas(name):
    for obj in objects(name):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_refuses_a_misspelt_field():
    deployment = copy.deepcopy(next(o for o in objects("pair.yaml") if o["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def containers(objs: list[dict], command: str) -> list[tuple[dict, dict]]:
    """(pod spec, container) of every container whose command starts with ``command``."""
    return [
        (o["spec"]["template"]["spec"], c)
        for o in objs
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        if c.get("command", [""])[0] == command
    ]


def mount(pod: dict, container: dict, kind: str) -> tuple[str, dict]:
    """The mount path and volume source of the container's volume of ``kind`` (configMap,
    secret)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    (found,) = [
        (m["mountPath"], volumes[m["name"]][kind])
        for m in container.get("volumeMounts", [])
        if kind in volumes[m["name"]]
    ]
    return found


def flag(args: list[str], name: str) -> str:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise KeyError(name)


# vLLM's own parser, in a child: building it loads vLLM's plugins, which would register our
# connectors in this process a second time (tests/test_plugin.py checks the first).
_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.stdin.read()):
    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    ktc = a.kv_transfer_config
    out.append({"port": a.port, "shutdown_timeout": a.shutdown_timeout,
                "kv_transfer_config": {"kv_connector": ktc.kv_connector, "kv_role": ktc.kv_role,
                                       "kv_connector_extra_config": ktc.kv_connector_extra_config}})
print(json.dumps(out))
"""


def _argv(container: dict) -> list[str]:
    model, *rest = container["args"]
    return ["--model", model, *(a.replace("$(POD_IP)", POD_IP) for a in rest)]


@pytest.fixture(scope="module")
def parsed() -> dict[str, SimpleNamespace]:
    """Every engine container's ``vllm serve`` line as vLLM's own parser reads it, by its
    arguments."""
    lines = [_argv(c) for name in LAYOUTS for _, c in containers(layout(name), "vllm")]
    run = subprocess.run([sys.executable, "-c", _PARSE], input=json.dumps(lines), text=True,
                         capture_output=True, timeout=300, check=True)  # fmt: skip
    answers = json.loads(run.stdout.strip().splitlines()[-1])
    return {
        json.dumps(line): SimpleNamespace(
            port=a["port"],
            shutdown_timeout=a["shutdown_timeout"],
            kv_transfer_config=SimpleNamespace(**a["kv_transfer_config"]),
        )
        for line, a in zip(lines, answers, strict=True)
    }


def vllm_args(parsed, container: dict) -> SimpleNamespace:
    return parsed[json.dumps(_argv(container))]


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_engines_settings_ports_probes_and_drain_agree_with_what_it_reads(
    name, tmp_path, parsed
):
    objs = layout(name)
    maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    engines = containers(objs, "vllm")
    assert engines
    for pod, c in engines:
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        config_dir, config_map = mount(pod, c, "configMap")
        assert env[CONFIG_PATH_ENV]["value"] == f"{config_dir}/mooncake.json"
        secret_dir, secret = mount(pod, c, "secret")
        assert secret["secretName"] == SECRET
        text = maps[config_map["name"]]["data"]["mooncake.json"]
        assert json.loads(text)["auth_secret_file"] == f"{secret_dir}/secret"
        # The file the engine reads, with the secret where this test has it.
        (tmp_path / "secret").write_text("s" * 32)
        local = tmp_path / "mooncake.json"
        local.write_text(text.replace(f"{secret_dir}/secret", str(tmp_path / "secret")))

        args = vllm_args(parsed, c)
        ktc = args.kv_transfer_config
        assert ktc.kv_connector == "MooncakeConnector"
        settings = load_settings(ktc.kv_connector_extra_config, env={CONFIG_PATH_ENV: str(local)})
        cfg = resolve(settings, ktc.kv_role, "engine", 1, env={})
        assert cfg.host == POD_IP  # each pod advertises its own address
        if settings.metadata_server != "P2PHANDSHAKE":
            assert settings.advertise_url == f"http://{POD_IP}:{args.port}"
        ports = {p["containerPort"] for p in c["ports"]}
        expected = {args.port, cfg.base_port, cfg.side_channel_port(0)}
        if cfg.is_producer:
            expected.add(cfg.bootstrap_port)
        assert ports == expected, (c["name"], ports, expected)
        for probe in ("readinessProbe", "startupProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": args.port}
        # vLLM drains on SIGTERM for --shutdown-timeout: longer than a lease lives, and the
        # grace period covers it after the preStop pause.
        assert args.shutdown_timeout >= settings.lease_ttl_s
        pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] >= pause + args.shutdown_timeout
        assert "nvidia.com/gpu" in c["resources"]["limits"] and c["resources"]["requests"]


@pytest.mark.parametrize("name", ["pair.yaml", "xpyd.yaml"])
def test_the_proxys_command_line_is_valid_and_names_what_the_layout_serves(name, tmp_path):
    objs = layout(name)
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    ((pod, c),) = containers(objs, "mooncake-vllm-proxy")
    args = list(c["args"])
    if any(a.startswith("--auth-secret-file") for a in args):
        secret_dir, secret = mount(pod, c, "secret")
        assert secret["secretName"] == SECRET
        assert flag(args, "--auth-secret-file") == f"{secret_dir}/secret"
        (tmp_path / "secret").write_text("s" * 32)
        args = [a.replace(f"{secret_dir}/secret", str(tmp_path / "secret")) for a in args]
    cfg = parse_args(args)
    backends = [*cfg.prefill, *cfg.decode] + ([cfg.discover] if cfg.discover else [])
    assert backends
    for url in backends:
        host, port = url.split("//")[1].split(":")
        assert host in services, url
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, url
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": cfg.port}


def test_llm_ds_sidecar_fronts_the_decode_in_mooncake_mode_and_prefills_serve_query(parsed):
    objs = layout("llm-d.yaml")
    decode = next(o for o in objs if o["metadata"]["name"] == "llm-d-decode")
    sidecar, vllm = decode["spec"]["template"]["spec"]["containers"]
    assert flag(sidecar["args"], "--kv-connector") == "mooncake"
    assert int(flag(sidecar["args"], "--vllm-port")) == vllm_args(parsed, vllm).port
    assert int(flag(sidecar["args"], "--port")) == sidecar["ports"][0]["containerPort"]
    ((_, prefill),) = [
        (p, c) for p, c in containers(objs, "vllm") if "kv_producer" in json.dumps(c["args"])
    ]
    assert 8998 in {p["containerPort"] for p in prefill["ports"]}  # the sidecar asks :8998/query
