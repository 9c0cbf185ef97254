"""The container image and the Vast.ai templates.

Always run (no network, no Docker): every templates/*.json passes the validator of
ops/vast_templates.py, the validator catches the mistakes it exists for, and `create --dry-run`
prints the vastai commands without running anything.

`@pytest.mark.docker`: build the image from a local base image and run it as a user would,
`docker run -p <free>:3000 IMAGE` with no Vast variables: /ready turns 200 (the embedded tiny model
on the CPU), a chat completion through the official `openai` client, /health, the HEALTHCHECK turns
healthy, then `docker stop` (SIGTERM) and exit code 0. Skipped only when no Docker engine answers.

Environment for the docker test:
  GLMFLASH_TEST_BASE_IMAGE     base image (default python:3.11-slim; pulled if not present)
  GLMFLASH_TEST_TORCH_SPEC     TORCH_SPEC build arg (default torch==2.13.0; empty = torch already in
                               the base image's /opt/venv)
  GLMFLASH_TEST_TORCH_INDEX_URL  TORCH_INDEX_URL build arg (default the PyTorch CPU index; empty = PyPI)
  GLMFLASH_TEST_BUILD_NETWORK  network for the build's RUN steps (default host; 'default' = the daemon's)
  GLMFLASH_TEST_IMAGE_TAG      tag of the built image (default glmflash-test:local; kept for layer reuse)
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ops import vast_templates as vt

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = sorted((REPO_ROOT / "templates").glob("*.json"))


# --- templates (always run) ------------------------------------------------------------------------

def _load(path: Path) -> dict:
    return vt.load_template(path)


def _by_format(fmt: str) -> dict:
    [t] = [_load(p) for p in TEMPLATES if _load(p)["snapshot"]["format"] == fmt]
    return t


def test_templates_cover_the_three_builds():
    repos = {_load(p)["snapshot"]["repo"]: _load(p)["snapshot"]["format"] for p in TEMPLATES}
    assert repos.get("RedHatAI/GLM-5.3-Flash-NVFP4") == "nvfp4_ct"
    assert repos.get("zai-org/GLM-5.3-Flash") == "fp8_block"
    modelopt = [r for r, f in repos.items() if f == "nvfp4_modelopt"]
    assert modelopt in (["nvidia/GLM-5.3-Flash-NVFP4"], ["LibertAIDAI/GLM-5.3-Flash-NVFP4"])
    assert len(TEMPLATES) == 3


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_template_is_valid(path):
    assert vt.validate_template(_load(path), path.name) == []


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_template_sizes_and_filters(path):
    t = _load(path)
    floor = 400 if t["snapshot"]["format"] == "fp8_block" else 250
    assert t["recommended_disk_space"] >= floor
    clauses = {c.field: c for c in vt.parse_search_params(t["search_params"])}
    assert clauses["gpu_ram"].op == "gte" and clauses["gpu_ram"].value >= 140
    assert clauses["cpu_ram"].value >= 128 and clauses["disk_bw"].value >= 3000
    assert clauses["disk_space"].value >= t["recommended_disk_space"]
    variables, ports = vt.parse_env(t["env"])
    assert ports == ["3000:3000"]
    assert variables["GLMFLASH_CACHE_DIR"].startswith("/workspace/")
    assert "HF_TOKEN" not in variables and "API_KEY" not in variables
    assert set(vt.ENDPOINT_PARAMS) == set(t["endpoint"])


def test_modelopt_readme_says_which_build_and_why():
    readme = _by_format("nvfp4_modelopt")["readme"]
    assert "LibertAIDAI" in readme and "54150" in readme  # the token-corruption report
    assert "W4A4" in readme


def _mutate(path: str, value):
    def apply(t: dict) -> None:
        *parents, last = path.split(".")
        node = t
        for key in parents:
            node = node[key]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value(node[last]) if callable(value) else value
    return apply


BAD = {
    "small-disk": (_mutate("recommended_disk_space", 120), "recommended_disk_space"),
    "unknown-env": (_mutate("env", lambda e: e + " -e GLMFLASH_NOT_A_SETTING=1"), "does not read"),
    "secret-in-env": (_mutate("env", lambda e: e + " -e HF_TOKEN=hf_x"), "secrets"),
    "fake-vast-mode": (_mutate("env", lambda e: e + " -e CONTAINER_ID=1"), "injects"),
    "no-port": (_mutate("env", lambda e: e.replace("-p 3000:3000 ", "")), "3000:3000"),
    "cache-off-workspace": (_mutate("env", lambda e: e.replace("/workspace/glmflash", "/root/cache")), "/workspace"),
    "bad-revision": (_mutate("env", lambda e: e.replace("GLMFLASH_MODEL_REVISION=", "GLMFLASH_MODEL_REVISION=main#")),
                     "40-hex"),
    "bad-settings-value": (_mutate("env", lambda e: e + " -e GLMFLASH_MAX_MODEL_LEN=abc"), "Settings"),
    "scale-param-missing": (_mutate("endpoint.cold_mult", KeyError), "cold_mult"),
    "small-gpu": (_mutate("search_params", lambda s: s.replace("gpu_ram>=140", "gpu_ram>=80")), "gpu_ram"),
    "filters-disagree": (_mutate("search_params", lambda s: s.replace("disk_bw>=3000", "disk_bw>=4000")),
                         "extra_filters"),
    "runtype-ssh": (_mutate("runtype", "ssh"), "runtype"),
    "latest-tag": (_mutate("tag", "latest"), "tag"),
    "readme-no-lifecycle": (_mutate("readme", lambda r: r.replace("Inactive", "Stopped")), "Inactive"),
    "scale-to-zero-with-min-load": (_mutate("endpoint.min_load", 5), "min_load"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validator_catches(case):
    mutate, expected = BAD[case]
    t = copy.deepcopy(_by_format("nvfp4_ct"))
    mutate(t)
    errors = vt.validate_template(t)
    assert errors and any(expected in e for e in errors), errors


def test_cli_validate(capsys):
    assert vt.main(["validate"]) == 0
    assert capsys.readouterr().out.count("ok ") == len(TEMPLATES)


@pytest.fixture
def no_subprocess(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"tried to run {args!r}")
    monkeypatch.setattr(subprocess, "run", refuse)


def test_dry_run_prints_the_commands(no_subprocess, capsys):
    assert vt.main(["create", "--dry-run", "--image", "ghcr.io/example/glmflash"]) == 0
    # The output is shell: '#' comment lines, then each command (a readme spans lines, quoted).
    lines: list[list[str]] = []
    for token in shlex.split(capsys.readouterr().out, comments=True):
        if token == "vastai":
            lines.append([])
        lines[-1].append(token)
    commands = [cmd[:3] for cmd in lines]
    assert commands == [["vastai", "create", "template"], ["vastai", "create", "endpoint"],
                        ["vastai", "create", "workergroup"]] * len(TEMPLATES)
    for t_path, i in zip(TEMPLATES, range(0, len(lines), 3)):
        t = _load(t_path)
        template_cmd, endpoint_cmd, group_cmd = lines[i:i + 3]
        opts = dict(zip(template_cmd[3::2], template_cmd[4::2]))
        assert opts["--name"] == t["name"] and opts["--env"] == t["env"] and opts["--readme"] == t["readme"]
        assert opts["--image"] == "ghcr.io/example/glmflash"
        assert opts["--disk_space"] == str(t["recommended_disk_space"])
        ep = dict(zip(endpoint_cmd[3::2], endpoint_cmd[4::2]))
        assert {k.lstrip("-") for k in ep} == set(vt.ENDPOINT_PARAMS)
        wg = dict(zip(group_cmd[3::2], group_cmd[4::2]))
        assert wg["--template_hash"] == vt.HASH_PLACEHOLDER and wg["--endpoint_name"] == t["endpoint"]["endpoint_name"]


def test_real_run_refuses_placeholders(no_subprocess, capsys):
    path = next(p for p in TEMPLATES if "__PIN_REVISION__" in _load(p)["env"])
    assert vt.main(["create", str(path), "--image", "ghcr.io/example/glmflash"]) == 1
    assert "__PIN_REVISION__" in capsys.readouterr().err


def test_real_run_passes_the_new_hash_on(monkeypatch, capsys):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        out = {"template": "New Template: {'id': 7, 'hash_id': 'abc123def', 'name': 'x'}\n",
               "endpoint": "create endpoint {'success': True, 'result': 11}\n",
               "workergroup": "workergroup create {'success': True, 'id': 12}\n"}[cmd[2]]
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    path = REPO_ROOT / "templates" / "glm53-flash-nvfp4-ct.json"
    assert vt.main(["create", str(path), "--image", "ghcr.io/example/glmflash", "--revision", "a" * 40]) == 0
    assert [c[2] for c in calls] == ["template", "endpoint", "workergroup"]
    assert "GLMFLASH_MODEL_REVISION=" + "a" * 40 in calls[0][calls[0].index("--env") + 1]
    assert calls[2][calls[2].index("--template_hash") + 1] == "abc123def"


# --- the image (needs a Docker engine) ------------------------------------------------------------

READY_TIMEOUT_S = float(os.environ.get("GLMFLASH_TEST_READY_TIMEOUT_S", "600"))
VAST_VARIABLES = ("CONTAINER_ID", "REPORT_ADDR", "PUBLIC_IPADDR", "WORKER_PORT", "MASTER_TOKEN", "UNSECURED")


@pytest.fixture(scope="module")
def docker_client():
    try:
        import docker
    except ImportError as e:  # a missing SDK is a setup error, not a reason to skip
        pytest.fail(f"the docker SDK is not installed ({e}); add 'docker>=7' to the [test] extra")
    try:
        client = docker.from_env(timeout=3600)
        client.ping()
    except Exception as e:  # no socket, daemon down, permission denied
        pytest.skip(f"no Docker engine reachable (docker.from_env().ping() failed: {e})")
    yield client
    client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _ensure_base_image(client, base: str) -> None:
    import docker

    try:
        client.images.get(base)
        return
    except docker.errors.ImageNotFound:
        pass
    repo, _, tag = base.rpartition(":") if ":" in base.split("/")[-1] else (base, "", "latest")
    try:
        client.images.pull(repo, tag=tag or "latest")
    except Exception as e:  # an offline engine with no base image cannot build anything: environment, not code
        pytest.skip(f"base image {base!r} is not on this Docker engine and could not be pulled ({e}); "
                    "load one (python3 >= 3.10 with venv, or apt) and set GLMFLASH_TEST_BASE_IMAGE")


def _build_image(client, tag: str) -> None:
    base = os.environ.get("GLMFLASH_TEST_BASE_IMAGE", "python:3.11-slim")
    _ensure_base_image(client, base)
    buildargs = {
        "BASE_IMAGE": base,
        "TORCH_SPEC": os.environ.get("GLMFLASH_TEST_TORCH_SPEC", "torch==2.13.0"),
        "TORCH_INDEX_URL": os.environ.get("GLMFLASH_TEST_TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu"),
    }
    network = os.environ.get("GLMFLASH_TEST_BUILD_NETWORK", "host")
    log: list[str] = []
    stream = client.api.build(path=str(REPO_ROOT), tag=tag, buildargs=buildargs, rm=True, forcerm=True,
                              decode=True, pull=False,
                              network_mode=None if network in ("", "default") else network)
    for chunk in stream:
        if "stream" in chunk:
            log.append(chunk["stream"])
        if "error" in chunk:
            tail = "".join(log)[-6000:]
            pytest.fail(f"docker build failed: {chunk['error']}\n--- build output (tail) ---\n{tail}")


@pytest.mark.docker
def test_image_serves_and_stops_cleanly(docker_client, tmp_path):
    from openai import OpenAI

    client = docker_client
    tag = os.environ.get("GLMFLASH_TEST_IMAGE_TAG", "glmflash-test:local")
    _build_image(client, tag)

    image = client.images.get(tag)
    config = image.attrs["Config"]
    assert config["Entrypoint"] == ["glmflash", "boot"]
    assert "3000/tcp" in config["ExposedPorts"]
    assert "GLMFLASH_CACHE_DIR=/workspace/glmflash" in config["Env"]
    assert any("/ready" in part for part in config["Healthcheck"]["Test"])
    assert not [e for e in config["Env"] if e.split("=", 1)[0] in VAST_VARIABLES]

    port = _free_port()
    # `docker run -p <port>:3000 IMAGE`: no environment, no command, no Vast variables.
    container = client.containers.run(tag, detach=True, ports={"3000/tcp": ("127.0.0.1", port)})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        status = None
        while time.monotonic() < deadline:
            container.reload()
            if container.status not in ("created", "running"):
                pytest.fail(f"container exited ({container.attrs['State']}) before ready:\n"
                            f"{container.logs().decode(errors='replace')[-6000:]}")
            try:
                status, body = _get(base + "/ready", timeout=2)
            except OSError:  # not listening yet, or the proxy not yet connected
                status = None
            if status == 200:
                break
            time.sleep(1)
        else:
            pytest.fail(f"/ready never answered 200 in {READY_TIMEOUT_S:.0f} s (last {status}):\n"
                        f"{container.logs().decode(errors='replace')[-6000:]}")
        assert json.loads(body)  # /ready reports the stage as JSON

        api = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = api.models.list().data[0].id
        reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                            max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1
        assert reply.choices[0].message.role == "assistant"

        status, _ = _get(base + "/health")
        assert status == 200

        deadline = time.monotonic() + 60  # HEALTHCHECK interval is 5 s
        while time.monotonic() < deadline:
            container.reload()
            health = container.attrs["State"].get("Health", {}).get("Status")
            if health == "healthy":
                break
            time.sleep(1)
        assert health == "healthy", container.attrs["State"].get("Health")

        started = time.monotonic()
        container.stop(timeout=90)  # SIGTERM, then SIGKILL after 90 s (> the 30 s drain grace)
        result = container.wait(timeout=120)
        logs = container.logs().decode(errors="replace")
        assert result["StatusCode"] == 0, f"exit {result}; stop took {time.monotonic() - started:.1f} s\n{logs[-6000:]}"
        assert time.monotonic() - started < 85, "SIGTERM was not honoured (stopped by SIGKILL?)"
    finally:
        container.remove(force=True)
