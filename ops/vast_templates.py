"""Validate the Vast.ai endpoint templates in templates/*.json and create them with the `vastai` CLI.

    python -m ops.vast_templates validate [FILE ...]
    python -m ops.vast_templates create [FILE ...] --dry-run
    python -m ops.vast_templates create templates/glm53-flash-nvfp4-ct.json \
        --image ghcr.io/ORG/glmflash --tag 0.1.0-cu128 --revision <40-hex commit>

A template file holds the Vast template fields (`name`, `image`, `tag`, `env`, `onstart`, `runtype`,
`recommended_disk_space`, `extra_filters`, `readme`, ...) plus three of ours, which are not sent as
template fields: `search_params` (the offer query, in `vastai search offers` syntax; `extra_filters`
must say the same), `endpoint` (every scale parameter, set explicitly) and `workergroup`, and
`snapshot` (which checkpoint, its format and size, for the disk check).

`create` runs three commands per template: `vastai create template`, `vastai create endpoint` and
`vastai create workergroup --template_hash <hash of the new template>`. With `--dry-run` it prints
them, exactly as they would run, and touches nothing. Placeholders (`__IMAGE__`,
`__PIN_REVISION__`) are allowed in the files and in a dry run, never in a real run: pass `--image`
and `--revision` instead.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_DIR = REPO_ROOT / "templates"

PLACEHOLDER_RE = re.compile(r"__[A-Z][A-Z0-9_]*__")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
GB_PER_GIB = 1024**3 / 1e9

# Vast template fields (creating-and-using-templates-with-api) and ours.
VAST_FIELDS = {
    "name", "image", "tag", "env", "onstart", "runtype", "args_str", "ssh_direct", "use_ssh", "jup_direct",
    "docker_login_repo", "docker_login_user", "docker_login_pass", "extra_filters", "recommended_disk_space",
    "private", "readme", "readme_visible", "href", "repo", "desc",
}
OUR_FIELDS = {"search_params", "endpoint", "workergroup", "snapshot"}
REQUIRED = ["name", "image", "tag", "env", "runtype", "recommended_disk_space", "extra_filters", "readme",
            "search_params", "endpoint", "workergroup", "snapshot"]
ENDPOINT_PARAMS = ["endpoint_name", "min_load", "min_cold_load", "target_util", "cold_mult", "cold_workers",
                   "max_workers", "max_queue_time", "target_queue_time", "inactivity_timeout"]
SNAPSHOT_FORMATS = {"fp8_block", "nvfp4_ct", "nvfp4_modelopt"}

# Offer-filter floors for GLM-5.3-Flash on one H200.
MIN_DISK_GB = 250
DISK_HEADROOM = 1.2  # snapshot + HF temp files, logs, the venv-free image layers are not on /workspace
FILTER_FLOORS = {"gpu_ram": 140, "cpu_ram": 128, "disk_bw": 3000, "inet_down": 1000}

# Platform variables a template may set besides ours; secrets never.
PLATFORM_ENV = {"WORKER_PORT", "WORKER_HTTP_PORT", "USE_SSL", "ROTATE_MODEL_LOG", "MODEL_LOG",
                "MODEL_HEALTH_ENDPOINT", "WORKSPACE_DIR", "PYWORKER_STATUS_FILE"}
SECRET_ENV = {"HF_TOKEN", "GLMFLASH_HF_TOKEN", "API_KEY", "GLMFLASH_API_KEY", "MASTER_TOKEN",
              "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN"}
# Set by the platform at run time; a template that sets them fakes Vast mode or breaks it.
PLATFORM_INJECTED = {"CONTAINER_ID", "REPORT_ADDR", "PUBLIC_IPADDR", "UNSECURED", "CONTAINER_API_KEY"}

# `vastai search offers` query syntax: field<op>value, whitespace separated.
_OPS = [(">=", "gte"), ("<=", "lte"), ("!=", "neq"), ("==", "eq"), (">", "gt"), ("<", "lt"), ("=", "eq")]
_FIELD_ALIAS = {"cuda_vers": "cuda_max_good", "dph": "dph_total"}
_FIELD_MULT = {"cpu_ram": 1000, "gpu_ram": 1000, "gpu_total_ram": 1000, "duration": 86400.0}
DEFAULT_FILTERS = {"verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True}}


class TemplateError(ValueError):
    pass


@dataclass
class Clause:
    field: str  # as written in search_params (before aliasing)
    op: str  # gte, lte, eq, ...
    value: float | bool | str


def parse_search_params(query: str) -> list[Clause]:
    """The `field<op>value` clauses of an offer query (the subset our templates use)."""
    clauses = []
    for token in query.split():
        for sym, op in _OPS:
            name, sep, raw = token.partition(sym)
            if sep and name and raw and re.fullmatch(r"[a-z_]+", name):
                break
        else:
            raise TemplateError(f"search_params: cannot parse {token!r} (want field<op>value, no spaces)")
        value: float | bool | str
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            try:
                value = float(raw)
            except ValueError:
                value = raw
        clauses.append(Clause(name, op, value))
    return clauses


def extra_filters_for(query: str) -> dict[str, dict[str, Any]]:
    """The `extra_filters` dict that `vastai create template --search_params QUERY` sends."""
    filters: dict[str, dict[str, Any]] = {k: dict(v) for k, v in DEFAULT_FILTERS.items()}
    for c in parse_search_params(query):
        value = c.value
        if isinstance(value, float):
            value *= _FIELD_MULT.get(c.field, 1)
            value = int(value) if value == int(value) else value
        filters.setdefault(_FIELD_ALIAS.get(c.field, c.field), {})[c.op] = value
    return filters


def settings_env_names() -> set[str]:
    """Every environment name that worker.settings.Settings reads."""
    from pydantic import AliasChoices

    from worker.settings import Settings

    names = set()
    for f in Settings.model_fields.values():
        alias = f.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(a for a in alias.choices if isinstance(a, str))
        elif isinstance(alias, str):
            names.add(alias)
    return names


def parse_env(env: str) -> tuple[dict[str, str], list[str]]:
    """(-e K=V variables, -p mappings) of a Vast docker-flag `env` string."""
    tokens = shlex.split(env)
    variables: dict[str, str] = {}
    ports: list[str] = []
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        if flag not in ("-e", "-p", "--env", "--publish") or i + 1 >= len(tokens):
            raise TemplateError(f"env: unexpected {flag!r} (only '-e KEY=VALUE' and '-p HOST:CONTAINER')")
        arg = tokens[i + 1]
        if flag in ("-e", "--env"):
            key, sep, value = arg.partition("=")
            if not sep or not key:
                raise TemplateError(f"env: '-e {arg}' is not KEY=VALUE")
            if key in variables:
                raise TemplateError(f"env: {key} is set twice")
            variables[key] = value
        else:
            ports.append(arg)
        i += 2
    return variables, ports


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _lower_bound(clauses: list[Clause], name: str) -> float | None:
    bounds = [c.value for c in clauses if c.field == name and c.op in ("gte", "gt", "eq") and _num(c.value)]
    return max(bounds) if bounds else None


def validate_template(t: dict[str, Any], source: str = "template") -> list[str]:
    """Every problem with one template, as readable lines (empty: valid)."""
    errors: list[str] = []

    def err(msg: str) -> None:
        errors.append(f"{source}: {msg}")

    unknown = set(t) - VAST_FIELDS - OUR_FIELDS
    if unknown:
        err(f"unknown fields {sorted(unknown)}")
    missing = [k for k in REQUIRED if k not in t or t[k] in (None, "")]
    if missing:
        err(f"missing fields {missing}")
        return errors

    for key in ("name", "image", "tag", "env", "readme"):
        if not isinstance(t[key], str):
            err(f"{key} must be a string")
    if errors:
        return errors
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{2,63}", t["name"]):
        err(f"name {t['name']!r}: use 3-64 letters, digits, '.', '_' or '-'")
    if not PLACEHOLDER_RE.fullmatch(t["image"]) and not re.fullmatch(r"[a-z0-9][a-z0-9./_:-]*", t["image"]):
        err(f"image {t['image']!r} is not a docker repository")
    if ":" in t["image"].split("/")[-1]:
        err("image must not carry the tag; put it in 'tag'")
    if t["tag"] == "latest" or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", t["tag"]):
        err(f"tag {t['tag']!r}: pin a version (not 'latest')")

    # Run type: the image's ENTRYPOINT (`glmflash boot`) must run, so 'args' (ssh/jupyter replace it).
    if t["runtype"] != "args":
        err(f"runtype {t['runtype']!r}: must be 'args' so the image entrypoint `glmflash boot` runs")
    if len(t.get("onstart") or "") > 4048:
        err("onstart is longer than 4048 characters (gzip+base64 it)")

    # env: ports, our variables, no secrets.
    try:
        variables, ports = parse_env(t["env"])
    except TemplateError as e:
        err(str(e))
        variables, ports = {}, []
    if "3000:3000" not in ports:
        err("env must publish '-p 3000:3000'")
    known = settings_env_names() | PLATFORM_ENV
    for key, value in variables.items():
        if key in SECRET_ENV:
            err(f"env sets {key}: secrets belong to the Vast account environment, not the template")
        elif key in PLATFORM_INJECTED:
            err(f"env sets {key}: the platform injects it (setting it fakes or breaks Vast mode)")
        elif key not in known:
            err(f"env sets {key}, which worker.settings.Settings does not read")
    model = variables.get("GLMFLASH_MODEL", variables.get("MODEL_NAME"))
    revision = variables.get("GLMFLASH_MODEL_REVISION", variables.get("MODEL_REVISION"))
    cache_dir = variables.get("GLMFLASH_CACHE_DIR")
    if not model:
        err("env must set GLMFLASH_MODEL (the Hugging Face id)")
    if not revision:
        err("env must set GLMFLASH_MODEL_REVISION (a pinned commit, or __PIN_REVISION__ until known)")
    elif not (COMMIT_RE.fullmatch(revision) or PLACEHOLDER_RE.fullmatch(revision)):
        err(f"GLMFLASH_MODEL_REVISION {revision!r} is neither a 40-hex commit nor a placeholder")
    if not cache_dir or not (cache_dir == "/workspace" or cache_dir.startswith("/workspace/")):
        err("env must set GLMFLASH_CACHE_DIR under /workspace (it survives Inactive)")
    if variables.get("GLMFLASH_PORT", "3000") != "3000":
        err("GLMFLASH_PORT must stay 3000")
    if not errors:
        from pydantic import ValidationError

        from worker.settings import Settings

        try:  # the values themselves must pass Settings (types, bounds)
            Settings(**{k: v for k, v in variables.items() if k not in PLATFORM_ENV})
        except ValidationError as e:
            err(f"env values rejected by Settings: {e}")

    # Snapshot and disk.
    snap = t["snapshot"]
    if not isinstance(snap, dict) or not {"repo", "format", "size_gib"} <= set(snap):
        err("snapshot must hold repo, format and size_gib")
    else:
        if model and snap["repo"] != model:
            err(f"snapshot.repo {snap['repo']!r} differs from GLMFLASH_MODEL {model!r}")
        if snap["format"] not in SNAPSHOT_FORMATS:
            err(f"snapshot.format {snap['format']!r} not in {sorted(SNAPSHOT_FORMATS)}")
        if not _num(snap["size_gib"]) or snap["size_gib"] <= 0:
            err("snapshot.size_gib must be a positive number")
        else:
            disk = t["recommended_disk_space"]
            need = max(MIN_DISK_GB, math.ceil(snap["size_gib"] * GB_PER_GIB * DISK_HEADROOM))
            if not _num(disk) or disk < need:
                err(f"recommended_disk_space {disk} GB < {need} GB "
                    f"({snap['size_gib']} GiB snapshot x {DISK_HEADROOM}, at least {MIN_DISK_GB})")

    # Offer filters: the floors, and extra_filters == what the CLI sends for search_params.
    try:
        clauses = parse_search_params(t["search_params"])
    except TemplateError as e:
        err(str(e))
        clauses = []
    if clauses:
        for name, floor in FILTER_FLOORS.items():
            bound = _lower_bound(clauses, name)
            if bound is None or bound < floor:
                err(f"search_params needs {name}>={floor} (has {bound})")
        gpus = [c for c in clauses if c.field == "num_gpus"]
        if not (len(gpus) == 1 and gpus[0].op == "eq" and gpus[0].value == 1):
            err("search_params needs num_gpus=1 (one GPU per worker)")
        disk_bound = _lower_bound(clauses, "disk_space")
        if disk_bound is None or (_num(t["recommended_disk_space"]) and disk_bound < t["recommended_disk_space"]):
            err("search_params needs disk_space>= recommended_disk_space")
        if t["extra_filters"] != extra_filters_for(t["search_params"]):
            err(f"extra_filters disagrees with search_params; expected {extra_filters_for(t['search_params'])}")

    # Endpoint scale parameters, every one explicit.
    ep = t["endpoint"]
    if not isinstance(ep, dict):
        err("endpoint must be an object")
    else:
        absent = [k for k in ENDPOINT_PARAMS if k not in ep]
        if absent:
            err(f"endpoint is missing {absent} (set every scale parameter explicitly)")
        extra = set(ep) - set(ENDPOINT_PARAMS)
        if extra:
            err(f"endpoint has unknown keys {sorted(extra)}")
        if not absent:
            if not (isinstance(ep["endpoint_name"], str) and ep["endpoint_name"]):
                err("endpoint.endpoint_name must be a name")
            for k in ENDPOINT_PARAMS[1:]:
                if not _num(ep[k]):
                    err(f"endpoint.{k} must be a number")
            if not errors:
                if ep["min_load"] < 0 or ep["min_cold_load"] < 0 or ep["cold_mult"] < 0:
                    err("endpoint min_load, min_cold_load and cold_mult must be >= 0")
                if not (0 < ep["target_util"] <= 1):
                    err("endpoint.target_util must be in (0, 1]")
                for k in ("cold_workers", "max_workers"):
                    if ep[k] != int(ep[k]) or ep[k] < 0:
                        err(f"endpoint.{k} must be a whole number >= 0")
                if ep["max_workers"] < 1 or ep["cold_workers"] > ep["max_workers"]:
                    err("endpoint needs 1 <= max_workers and cold_workers <= max_workers")
                if ep["max_queue_time"] <= 0 or ep["target_queue_time"] <= 0:
                    err("endpoint max_queue_time and target_queue_time must be > 0")
                if ep["inactivity_timeout"] > 0 and ep["min_load"] != 0:
                    err("endpoint.inactivity_timeout > 0 only scales to zero with min_load = 0")

    wg = t["workergroup"]
    if not isinstance(wg, dict) or not _num(wg.get("gpu_ram")) or wg["gpu_ram"] < FILTER_FLOORS["gpu_ram"]:
        err(f"workergroup.gpu_ram must be >= {FILTER_FLOORS['gpu_ram']} (GB)")
    elif set(wg) - {"gpu_ram", "launch_args"}:
        err(f"workergroup has unknown keys {sorted(set(wg) - {'gpu_ram', 'launch_args'})}")

    # What an operator must read.
    readme = t["readme"].lower()
    if not ("inactive" in readme and "/workspace" in readme and " ram" in readme):
        err("readme must say that Inactive keeps /workspace but not RAM")
    if not ("restart" in readme and "gpu" in readme and "wait" in readme):
        err("readme must say that a restart may wait for the GPU")
    if "hf_token" not in readme:
        err("readme must say where HF_TOKEN comes from (the account)")
    if model and model.lower() not in readme:
        err(f"readme must name the model {model}")
    return errors


def load_template(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def template_paths(paths: Sequence[str | Path] = ()) -> list[Path]:
    return [Path(p) for p in paths] if paths else sorted(TEMPLATE_DIR.glob("*.json"))


# --- creation --------------------------------------------------------------------------------------

HASH_PLACEHOLDER = "<TEMPLATE_HASH>"


@dataclass
class Plan:
    template: dict[str, Any]
    create_template: list[str]
    create_endpoint: list[str]
    create_workergroup: list[str]  # carries HASH_PLACEHOLDER until the template exists
    placeholders: list[str] = field(default_factory=list)


def _fmt(value: Any) -> str:
    return str(int(value)) if _num(value) and value == int(value) else str(value)


def substitute(t: dict[str, Any], image: str | None = None, tag: str | None = None,
               revision: str | None = None) -> dict[str, Any]:
    t = json.loads(json.dumps(t))
    if image:
        t["image"] = image
    if tag:
        t["tag"] = tag
    if revision:
        if not COMMIT_RE.fullmatch(revision):
            raise TemplateError(f"--revision {revision!r} is not a 40-hex commit")
        t["env"] = re.sub(r"((?:GLMFLASH_)?MODEL_REVISION=)\S+", lambda m: m.group(1) + revision, t["env"])
    return t


def plan(t: dict[str, Any], vastai: str = "vastai") -> Plan:
    cmd = [vastai, "create", "template", "--name", t["name"], "--image", t["image"], "--image_tag", t["tag"],
           "--env", t["env"], "--search_params", t["search_params"],
           "--disk_space", _fmt(t["recommended_disk_space"]), "--readme", t["readme"]]
    if t.get("desc"):
        cmd += ["--desc", t["desc"]]
    if t.get("onstart"):
        cmd += ["--onstart-cmd", t["onstart"]]
    if t.get("href"):
        cmd += ["--href", t["href"]]
    if t.get("repo"):
        cmd += ["--repo", t["repo"]]
    ep = t["endpoint"]
    endpoint = [vastai, "create", "endpoint", "--endpoint_name", ep["endpoint_name"]]
    for k in ENDPOINT_PARAMS[1:]:
        endpoint += [f"--{k}", _fmt(ep[k])]
    wg = t["workergroup"]
    workergroup = [vastai, "create", "workergroup", "--template_hash", HASH_PLACEHOLDER,
                   "--endpoint_name", ep["endpoint_name"], "--gpu_ram", _fmt(wg["gpu_ram"]),
                   "--search_params", t["search_params"]]
    if wg.get("launch_args"):
        workergroup += ["--launch_args", wg["launch_args"]]
    found = sorted(set(PLACEHOLDER_RE.findall(" ".join([t["image"], t["tag"], t["env"]]))))
    return Plan(t, cmd, endpoint, workergroup, found)


def _run(cmd: list[str]) -> str:
    print("+ " + shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    print(out, end="" if out.endswith("\n") else "\n", flush=True)
    # The CLI prints errors and still exits 0 in places; look at what it said too.
    failed = re.search(r"'success': False|\"success\": false|Error creating|not valid JSON|Traceback", out)
    if proc.returncode != 0 or failed:
        raise RuntimeError(f"{cmd[1:3]} failed (exit {proc.returncode})")
    return out


def execute(p: Plan) -> str:
    """Run the plan; returns the new template's hash."""
    if p.placeholders:
        raise TemplateError(f"{p.template['name']}: placeholders {p.placeholders} left; "
                            "pass --image/--tag/--revision (or edit the file) before a real run")
    out = _run(p.create_template)
    m = re.search(r"""['"]hash_id['"]\s*:\s*['"]([0-9a-fA-F]+)['"]""", out)
    if not m:
        raise RuntimeError("could not find the new template's hash_id in the output above")
    _run(p.create_endpoint)
    _run([m.group(1) if a == HASH_PLACEHOLDER else a for a in p.create_workergroup])
    return m.group(1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.vast_templates", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    val = sub.add_parser("validate", help="check templates (default: templates/*.json)")
    val.add_argument("files", nargs="*")
    cr = sub.add_parser("create", help="create template + endpoint + workergroup with the vastai CLI")
    cr.add_argument("files", nargs="*")
    cr.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    cr.add_argument("--image", help="image repository (replaces the template's)")
    cr.add_argument("--tag", help="image tag (replaces the template's)")
    cr.add_argument("--revision", help="pinned model commit (replaces GLMFLASH_MODEL_REVISION)")
    cr.add_argument("--vastai", default="vastai", help="the vastai executable")
    args = parser.parse_args(argv)

    paths = template_paths(args.files)
    if args.command == "create" and args.revision and len(paths) != 1:
        print("--revision pins one model: name exactly one template file", file=sys.stderr)
        return 2
    if not paths:
        print("no templates found", file=sys.stderr)
        return 1
    templates, bad = [], False
    for path in paths:
        t = load_template(path)
        if args.command == "create":
            t = substitute(t, args.image, args.tag, args.revision)
        errors = validate_template(t, str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path))
        for e in errors:
            print(e, file=sys.stderr)
        bad |= bool(errors)
        templates.append(t)
        if args.command == "validate" and not errors:
            print(f"ok {path.name}: {t['name']} ({t['snapshot']['repo']}, disk {t['recommended_disk_space']} GB)")
    if bad:
        return 1
    if args.command == "validate":
        return 0

    for t in templates:
        p = plan(t, args.vastai)
        if args.dry_run:
            print(f"# {t['name']}" + (f"  (placeholders to fill: {', '.join(p.placeholders)})" if p.placeholders else ""))
            for cmd in (p.create_template, p.create_endpoint, p.create_workergroup):
                print(shlex.join(cmd))
            print()
        else:
            try:
                h = execute(p)
            except (TemplateError, RuntimeError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(f"created {t['name']}: template {h}, endpoint {t['endpoint']['endpoint_name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
