"""What every deployment file must get right, checked against the project itself: the commands a
container runs exist (`moemesh` subcommands and their flags, `python -m` modules), and the MOEMESH_*
settings it sets are fields a service reads, with values its settings class accepts."""

from __future__ import annotations

import argparse
import importlib.util
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from libs.bus.settings import SHARED_FIELDS, ServiceSettings, env_prefix, load_settings
from libs.cli.main import build_parser
from libs.cli.serve import SERVICES
from services.decode_worker.service import DecodeWorker
from services.gateway.service import Gateway
from services.kv_broker.service import KvBroker
from services.prefill_worker.service import PrefillWorker
from services.scheduler.service import SchedulerService

ROOT = Path(__file__).resolve().parents[2]
SETTINGS: dict[str, type[ServiceSettings]] = {
    cls.name: cls.settings_class for cls in (Gateway, SchedulerService, KvBroker, PrefillWorker, DecodeWorker)
}
SHARED = {"MOEMESH_" + f.upper() for f in SHARED_FIELDS}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def module_exists(module: str) -> bool:
    """`python -m module` would run something: a package with __main__, or a module."""
    try:
        return (
            importlib.util.find_spec(module + ".__main__") is not None
            or importlib.util.find_spec(module) is not None
        )
    except ModuleNotFoundError:
        return False


def check_command(cmd: Sequence[str], system: Sequence[str] = ()) -> str | None:
    """The moemesh service a command runs (None for tools), or AssertionError when it does not exist.
    `system`: other executables the image is known to have (e.g. curl from the Dockerfile)."""
    assert cmd, "empty command"
    exe = Path(cmd[0]).name
    if exe == "moemesh":
        assert len(cmd) >= 2 and cmd[1] in subcommands(), f"no moemesh subcommand {cmd[1:2]} in {cmd}"
        args = build_parser().parse_args(list(cmd[1:]))  # exits (SystemExit) on unknown flags
        if cmd[1] == "serve":
            assert module_exists(SERVICES[args.service]), cmd
            assert SERVICES[args.service].removeprefix("services.").replace("_", "-") == args.service
            return args.service
        return None
    if exe.startswith("python") and len(cmd) >= 3 and cmd[1] == "-m":
        assert module_exists(cmd[2]), f"no module {cmd[2]} for {cmd}"
        by_module = {m: s for s, m in SERVICES.items()}
        return by_module.get(cmd[2])
    assert exe in system, f"{exe} ({cmd}) is neither moemesh, python -m, nor a known tool {sorted(system)}"
    return None


def check_env_names(env: Mapping[str, str]) -> None:
    """Every MOEMESH_* variable is shared or a field of the service its prefix names."""
    for key in env:
        if not key.startswith("MOEMESH_") or key in SHARED:
            continue
        owners = [s for s in SETTINGS if key.startswith(env_prefix(s))]
        assert owners, f"{key} names no service (prefixes: {[env_prefix(s) for s in SETTINGS]})"
        service = max(owners, key=len)
        field = key[len(env_prefix(service)) :].lower()
        fields = SETTINGS[service].__struct_fields__
        assert field in fields, f"{key}: {SETTINGS[service].__name__} has no field {field!r}"


def check_settings(service: str, env: Mapping[str, str]) -> ServiceSettings:
    """The service's settings as its container would load them (errors name the variable)."""
    check_env_names(env)
    return load_settings(SETTINGS[service], service, env=env)


_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR:?error}` with `env` (default: nothing set), where a
    required variable gets a placeholder path."""
    env = env or {}

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if env.get(name):
            return env[name]
        if op and op.endswith("?"):
            return "/required/" + name.lower()
        return arg if op else ""

    return _INTERP.sub(one, value)


def dockerfile_stages(path: Path) -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", path.read_text(), flags=re.M | re.I))


def dockerfile_tools(path: Path) -> set[str]:
    """Executables apt-get installs in the Dockerfile (named like their package here: curl)."""
    tools: set[str] = set()
    for line in re.findall(r"apt-get install ([^&\n]+)", path.read_text()):
        tools |= {w for w in line.split() if not w.startswith("-") and w not in ("\\",)}
    return tools
