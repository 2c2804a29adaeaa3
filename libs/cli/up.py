"""`moemesh up [--model DIR]`: start nats-server and every service on loopback, supervised (a service
that exits is restarted with backoff, or given up on after too many restarts while the rest keeps
serving); Ctrl-C / SIGTERM drains and stops them all."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.bus.settings import (
    CONFIG_ENV,
    ENGINE_KEYS,
    LAUNCHER_KEYS,
    aliases_of,
    describe,
    flag_of,
    read_config,
)

if TYPE_CHECKING:
    from libs.launch.mesh import MeshConfig
    from libs.launch.natsauth import NatsAuth
    from libs.worker.settings import WorkerSettings

DEFAULT_TINY = Path.home() / ".cache" / "moemesh" / "tiny-v3"


class _Default:
    """An option's default, told apart from a value given on the command line (the file fills those)."""

    def __init__(self, value: Any, tp: Callable[[Any], Any]) -> None:
        self.value = value
        self.type = tp

    def __str__(self) -> str:
        return str(self.value)


# up's options whose default comes from the environment when it is set (flag > env > file > default)
_ENV_OF = {
    "nats_user": "MOEMESH_NATS_USER", "nats_password": "MOEMESH_NATS_PASSWORD", "nats_token": "MOEMESH_NATS_TOKEN",
}  # fmt: skip
# worker settings `up` takes as flags, for both worker kinds (MTP drafts only on the decode workers)
BOTH_WORKERS = ENGINE_KEYS
DECODE_ONLY = ("mtp_k",)
PREFILL_PREFIX, DECODE_PREFIX = "MOEMESH_PREFILL_WORKER_", "MOEMESH_DECODE_WORKER_"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "up",
        help="run the whole mesh (nats-server, kv-broker, scheduler, workers, gateway) on this machine",
        description="Starts the embedded default: every service as its own process on 127.0.0.1. Without "
        "--model it serves the trained demo model when `moemesh demo-model` has cached it, else a tiny "
        "random DeepSeek-V3-architecture model (written in seconds on first use). Settings: flag > env var > "
        "--config file > default (docs/configuration.md).",
    )
    p.add_argument(
        "--config", default=os.environ.get(CONFIG_ENV, ""), metavar="FILE",
        help=f"YAML config file: up's options and worker settings at the top level, a section per service; "
        f"every service reads it too (default: ${CONFIG_ENV})",
    )  # fmt: skip
    opt = _option(p)
    opt(
        "--model", None,
        help="checkpoint folder, or 'tiny' (random), or 'demo' (trained on first use, minutes); "
        "default: demo if cached, else tiny",
    )  # fmt: skip
    opt("--host", "127.0.0.1", help="address the gateway and the side ports listen on")
    opt("--port", 8000, type=int, help="gateway port (0: any free port)")
    opt("--nats-port", 0, type=int, help="nats-server port (0: any free port)")
    opt("--prefill-workers", 1, type=int, help="prefill worker processes (0: decode workers prefill)")
    opt("--decode-workers", 1, type=int, help="decode worker processes")
    opt("--schedulers", 1, type=int, help="scheduler replicas (one queue group)")
    opt(
        "--scheduler", "process", choices=["process", "embedded"], dest="scheduler_mode",
        help="process: scheduler replicas as their own processes (--schedulers); embedded: none, each gateway "
        "hosts one in its process and submits to it without a bus hop",
    )  # fmt: skip
    opt(
        "--gateways", 1, type=int,
        help="gateway processes sharing the API port (SO_REUSEPORT, Linux); one streams ~20k tokens/s per core",
    )  # fmt: skip
    opt("--nats-user", "", help="default: $MOEMESH_NATS_USER")
    opt("--nats-password", "", help="default: $MOEMESH_NATS_PASSWORD (prefer it: argv is visible)")
    opt("--nats-token", "", help="default: $MOEMESH_NATS_TOKEN")
    opt("--nats-tls-cert", "", help="server certificate of the embedded nats-server")
    opt("--nats-tls-key", "", help="its key")
    opt("--nats-tls-ca", "", help="CA the services verify the server with")
    opt("--served-model-name", "", help="the model name clients use; default: the folder's name")
    opt(
        "--reasoning-parser", "", choices=["", "auto", "none", "deepseek_r1"],
        help="the gateways' reasoning_parser: deepseek_r1 (reasoning_content from <think>...</think>), none, or "
        "auto (deepseek_r1 when the chat template writes <think>); default: the gateway's setting (auto)",
    )  # fmt: skip
    opt(
        "--prefill-gpus", "",
        help="GPU ids for the prefill workers, e.g. 0,1,2,3: split over them in order, ep_size each, as each "
        "worker's CUDA_VISIBLE_DEVICES (EP rank r on its r-th GPU); default: inherited",
    )  # fmt: skip
    opt("--decode-gpus", "", help="GPU ids for the decode workers, e.g. 4,5,6,7 (as --prefill-gpus)")
    opt("--log-dir", None, help="where each service writes its log (default: a temp dir)")
    opt("--restart-backoff", 0.5, type=float, help="seconds before the first restart")
    opt("--restart-max-backoff", 30.0, type=float, help="cap of the doubling backoff")
    opt(
        "--restart-limit", 5, type=int,
        help="restarts of one service allowed within --restart-window; one more exit gives it up",
    )  # fmt: skip
    opt("--restart-window", 60.0, type=float, help="seconds over which --restart-limit counts")
    opt(
        "--ready-timeout", None, type=float,
        help="seconds to wait for every service to be ready; default 120, or 900 with a CUDA --device (the "
        "workers load, then warm up: kernels compiled and tuned, CUDA graphs captured, before they serve)",
    )  # fmt: skip
    p.add_argument(
        "--kv-store", default=_Default(False, bool), action="store_true",
        help="start a Mooncake Store master (like the nats-server) and share every worker's cached KV pages "
        "through it (needs the host tier: --host-kv-pages or --host-kv-cache-gb)",
    )  # fmt: skip
    _add_worker_flags(p)
    p.set_defaults(func=run)


def _option(p: argparse.ArgumentParser) -> Any:
    def opt(flag: str, default: Any, **kw: Any) -> None:
        p.add_argument(flag, default=_Default(default, kw.get("type", str)), **kw)

    return opt


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The engine settings of WorkerSettings as flags (and vLLM's aliases), given only when set."""
    from libs.worker.settings import WorkerSettings

    g = p.add_argument_group("worker settings (both worker kinds; --mtp-k: the decode workers)")
    for doc in describe(WorkerSettings):
        if doc.name not in BOTH_WORKERS + DECODE_ONLY:
            continue
        flags = (flag_of(doc.name), *aliases_of(WorkerSettings, doc.name))
        help_ = f"{doc.description} (default: {doc.default})".replace("%", "%%")
        if doc.type is bool:
            g.add_argument(
                *flags, dest=doc.name, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            g.add_argument(*flags, dest=doc.name, type=doc.type, default=None, help=help_)


def resolve_options(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """up's options with their layers resolved in place (flag > env > config file > default); returns the
    file's top level. Worker flags stay None unless given: the workers read env and file themselves."""
    top = read_config(args.config) if args.config else {}
    for key in LAUNCHER_KEYS:
        value = getattr(args, key)
        if not isinstance(value, _Default):
            continue
        if key in _ENV_OF and _ENV_OF[key] in env:
            value = env[_ENV_OF[key]]
        elif key in top:
            value = _coerce(key, top[key], value.type, args.config)
        else:
            value = value.value
        setattr(args, key, value)
    return top


def _coerce(key: str, value: Any, tp: Callable[[Any], Any], path: str) -> Any:
    """A value from the YAML file as the option's type (what argparse does to a flag's string)."""
    wrong = ValueError(
        f"config file {path}: {key} must be of type {getattr(tp, '__name__', tp)}, got {value!r}"
    )
    if tp is bool and isinstance(value, bool):
        return value
    if isinstance(value, bool | list | dict) or value is None:
        raise wrong
    try:
        return tp(value)
    except (TypeError, ValueError):
        raise wrong from None


def worker_view(
    args: argparse.Namespace, top: Mapping[str, Any], env: Mapping[str, str], model: Path, kind: str = "decode"
) -> WorkerSettings:
    """The worker settings a decode (or prefill) worker will see for what `up` needs itself (device, for the
    ready wait): the file's top level and the worker's section < env < flags; ValueError names the problem."""
    import msgspec

    from libs.worker.settings import WorkerSettings

    names = {d.name for d in describe(WorkerSettings)}
    section = top.get(f"{kind}-worker") or {}
    prefix, flags = (DECODE_PREFIX, BOTH_WORKERS + DECODE_ONLY) if kind == "decode" else (PREFILL_PREFIX, BOTH_WORKERS)
    values: dict[str, Any] = {k: top[k] for k in BOTH_WORKERS if k in top}
    values.update({k: v for k, v in section.items() if k in names})  # its own keys the worker checks
    values.update({k: env[e] for k in names if (e := prefix + k.upper()) in env})
    values.update({k: v for k in flags if (v := getattr(args, k)) is not None})
    try:
        return msgspec.convert({**values, "model_dir": str(model)}, WorkerSettings, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"{kind}-worker settings: {e}") from None


def worker_env(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """The worker flags given on `up` as env overrides of each worker module (they beat env and file)."""
    out: dict[str, dict[str, str]] = {"services.prefill_worker": {}, "services.decode_worker": {}}
    for key in BOTH_WORKERS + DECODE_ONLY:
        value = getattr(args, key)
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out["services.decode_worker"][DECODE_PREFIX + key.upper()] = text
        if key in BOTH_WORKERS:
            out["services.prefill_worker"][PREFILL_PREFIX + key.upper()] = text
    return {k: v for k, v in out.items() if v}


def mesh_config(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[MeshConfig, WorkerSettings]:
    """`up`'s parsed arguments as the mesh to start, with the decode workers' settings as `up` sees them;
    ValueError (SettingsError) names a bad option, flag or key."""
    from libs.launch.mesh import MeshConfig
    from libs.launch.restart_policy import RestartPolicy

    top = resolve_options(args, env)
    model = _choose_model(args.model)
    if not (model / "config.json").is_file():
        raise ValueError(f"{model} is not a checkpoint folder (no config.json)")
    worker = worker_view(args, top, env, model)
    prefill = worker_view(args, top, env, model, "prefill")
    if args.prefill_workers and prefill.kv_cache_dtype != worker.kv_cache_dtype:
        raise ValueError(
            f"prefill workers would run kv_cache_dtype {prefill.kv_cache_dtype} and decode workers "
            f"{worker.kv_cache_dtype}: their KV pages must mean the same bytes; set one kv_cache_dtype for both"
        )
    fp8 = worker.kv_cache_dtype != "auto"
    if args.prefill_workers and fp8 and prefill.attention_backend != worker.attention_backend:
        raise ValueError(  # FP8 rows are laid out for the decode kernel the backend runs (attention_backend.fp8_scales)
            f"prefill workers would run attention_backend {prefill.attention_backend} and decode workers "
            f"{worker.attention_backend} over an FP8 KV cache, whose row layout follows the backend; set one "
            "attention_backend for both"
        )
    if args.kv_store and not (worker.host_kv_pages or worker.host_kv_cache_gb):
        raise ValueError("--kv-store stages KV pages in the host tier: give --host-kv-pages or --host-kv-cache-gb")
    if args.kv_store:
        from libs.kvtransfer.mooncake_store import store_unavailable

        if why := store_unavailable():
            raise ValueError(f"--kv-store needs Mooncake Store: {why}")
    if args.gateways < 1 or args.schedulers < 1:
        raise ValueError(f"--gateways and --schedulers must be >= 1, got {args.gateways}, {args.schedulers}")
    if args.scheduler_mode not in ("process", "embedded"):
        raise ValueError(f"--scheduler must be process or embedded, got {args.scheduler_mode!r}")
    if args.scheduler_mode == "embedded" and args.schedulers != 1:
        raise ValueError(
            "--scheduler embedded: each gateway hosts one scheduler; use --gateways, not --schedulers"
        )
    cfg = MeshConfig(
        model_dir=model, host=args.host, port=args.port, nats_port=args.nats_port,
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers, schedulers=args.schedulers,
        gateways=args.gateways, embedded_scheduler=args.scheduler_mode == "embedded",
        nats_auth=_nats_auth(args), served_model_name=args.served_model_name or _default_name(model),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        config_file=Path(args.config).resolve() if args.config else None,
        restart=RestartPolicy(
            backoff_s=args.restart_backoff, max_backoff_s=args.restart_max_backoff,
            max_restarts=args.restart_limit, window_s=args.restart_window,
        ),
        extra_env=worker_env(args) | _gateway_env(args), kv_store=args.kv_store,
        worker_gpus=_worker_gpus(args, worker.ep_size),
    )  # fmt: skip
    return cfg, worker


def _gateway_env(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """--reasoning-parser for every gateway, when given (else the gateways' env, file and default decide)."""
    if not args.reasoning_parser:
        return {}
    return {"services.gateway": {"MOEMESH_GATEWAY_REASONING_PARSER": args.reasoning_parser}}


def _worker_gpus(args: argparse.Namespace, ep_size: int) -> dict[str, str]:
    """--prefill-gpus / --decode-gpus split over the workers, ep_size GPUs each (libs.launch.gpu_placement)."""
    from libs.launch.gpu_placement import parse_gpus, worker_gpus

    prefill = [f"prefill-{i}" for i in range(args.prefill_workers)]
    decode = [f"decode-{i}" for i in range(args.decode_workers)]
    return worker_gpus(
        (parse_gpus(args.prefill_gpus, "--prefill-gpus"), prefill, ep_size),
        (parse_gpus(args.decode_gpus, "--decode-gpus"), decode, ep_size),
    )


def run(args: argparse.Namespace) -> int:
    from libs.launch.mesh import Mesh

    cfg, worker = mesh_config(args, os.environ)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mesh = Mesh(cfg, report=lambda line: print(line, flush=True))
    print(f"starting moemesh ({cfg.model_dir}); logs in {mesh.log_dir}", flush=True)
    mesh.start(timeout=ready_timeout(args.ready_timeout, worker.device))
    try:
        print(
            f"moemesh is up: {mesh.url}/v1  (model {mesh.model_name!r}, nats {mesh.nats_url}); Ctrl-C stops\n"
            f"{mesh.sup.summary()} (also on the gateway's /metrics: moemesh_launcher_service_*)",
            flush=True,
        )
        while not stop.wait(1.0):  # the supervision thread restarts services; this only waits for Ctrl-C
            mesh.check_serviceable()
    finally:
        print("stopping moemesh ...", flush=True)
        mesh.stop()
    return 0


def ready_timeout(given: float | None, device: str) -> float:
    """--ready-timeout, or its default for the device: GPU workers warm up before their first heartbeat."""
    if given is not None:
        return given
    return 900.0 if device.startswith("cuda") else 120.0


def _nats_auth(args: argparse.Namespace) -> NatsAuth | None:
    from libs.launch.natsauth import NatsAuth

    auth = NatsAuth(
        user=args.nats_user, password=args.nats_password, token=args.nats_token, tls_cert=args.nats_tls_cert,
        tls_key=args.nats_tls_key, tls_ca=args.nats_tls_ca,
    )  # fmt: skip
    return auth if auth != NatsAuth() else None


def _choose_model(arg: str | None) -> Path:
    """A fresh machine must be serving within two minutes, and training the demo model takes longer: so
    the default is the demo model only once it is cached, else the tiny random one (with a hint)."""
    from libs.demo.cache import cached_demo_model, ensure_demo_model

    if arg == "demo":
        return ensure_demo_model()
    if arg == "tiny":
        return _tiny_model()
    if arg:
        return Path(arg)
    try:
        demo = cached_demo_model()
    except ValueError:  # no pydoc corpus on this Python: no demo model either
        demo = None
    if demo is not None:
        return demo
    print("serving the tiny random model; `moemesh demo-model` trains one that speaks (minutes, cached)")
    return _tiny_model()


def _default_name(model: Path) -> str:
    """The cached demo folder's name carries its cache key; clients see plain "demo-v3"."""
    return "demo-v3" if model.name.startswith("demo-v3-") else ""


def _tiny_model() -> Path:
    if not (DEFAULT_TINY / "config.json").is_file():
        from libs.engine.tiny import write_tiny_model

        write_tiny_model(DEFAULT_TINY, seed=0, overwrite=True)
    return DEFAULT_TINY
