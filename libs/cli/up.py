"""`moemesh up [--model DIR]`: start nats-server and every service on loopback, supervised (a service
that exits is restarted with backoff, or given up on after too many restarts while the rest keeps
serving); Ctrl-C / SIGTERM drains and stops them all."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libs.launch.natsauth import NatsAuth

DEFAULT_TINY = Path.home() / ".cache" / "moemesh" / "tiny-v3"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "up",
        help="run the whole mesh (nats-server, kv-broker, scheduler, workers, gateway) on this machine",
        description="Starts the embedded default: every service as its own process on 127.0.0.1. Without "
        "--model it serves the trained demo model when `moemesh demo-model` has cached it, else a tiny "
        "random DeepSeek-V3-architecture model (written in seconds on first use).",
    )
    p.add_argument(
        "--model", default=None,
        help="checkpoint folder, or 'tiny' (random), or 'demo' (trained on first use, minutes); "
        "default: demo if cached, else tiny",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="gateway port (0: any free port)")
    p.add_argument("--nats-port", type=int, default=0, help="nats-server port (0: any free port)")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--schedulers", type=int, default=1, help="scheduler replicas (one queue group)")
    p.add_argument(
        "--scheduler", choices=["process", "embedded"], default="process",
        help="process: scheduler replicas as their own processes (--schedulers); embedded: none, each gateway "
        "hosts one in its process and submits to it without a bus hop",
    )  # fmt: skip
    p.add_argument(
        "--gateways", type=int, default=1,
        help="gateway processes sharing the API port (SO_REUSEPORT, Linux); one streams ~20k tokens/s per core",
    )  # fmt: skip
    p.add_argument("--nats-user", default=os.environ.get("MOEMESH_NATS_USER", ""))
    p.add_argument(
        "--nats-password", default=None, help="default: $MOEMESH_NATS_PASSWORD (prefer it: argv is visible)"
    )
    p.add_argument("--nats-token", default=None, help="default: $MOEMESH_NATS_TOKEN")
    p.add_argument("--nats-tls-cert", default="", help="server certificate of the embedded nats-server")
    p.add_argument("--nats-tls-key", default="", help="its key")
    p.add_argument("--nats-tls-ca", default="", help="CA the services verify the server with")
    p.add_argument("--transfer-protocol", default="tcp", choices=["tcp", "rdma", "nvlink_intra"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument(
        "--ep-size", type=int, default=1,
        help="expert parallelism: rank processes per prefill and decode worker (DP attention + EP MoE)",
    )  # fmt: skip
    p.add_argument(
        "--mtp-k", type=int, default=0,
        help="MTP speculative decoding on the decode workers: draft tokens per step (needs a checkpoint with "
        "an MTP layer, e.g. the demo model; 0: off)",
    )  # fmt: skip
    p.add_argument("--dp-size", type=int, default=0, help="attention DP ranks per worker: 0 or --ep-size")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--log-dir", default=None, help="where each service writes its log (default: a temp dir)")
    p.add_argument("--restart-backoff", type=float, default=0.5, help="seconds before the first restart")
    p.add_argument("--restart-max-backoff", type=float, default=30.0, help="cap of the doubling backoff")
    p.add_argument(
        "--restart-limit", type=int, default=5,
        help="restarts of one service allowed within --restart-window; one more exit gives it up",
    )  # fmt: skip
    p.add_argument("--restart-window", type=float, default=60.0, help="seconds")
    p.add_argument(
        "--ready-timeout", type=float, default=None,
        help="seconds to wait for every service to be ready; default 120, or 900 with a CUDA --device (the "
        "workers load, then warm up: kernels compiled and tuned, CUDA graphs captured, before they serve)",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from libs.launch.mesh import Mesh, MeshConfig
    from libs.launch.restart_policy import RestartPolicy

    model = _choose_model(args.model)
    if not (model / "config.json").is_file():
        raise ValueError(f"{model} is not a checkpoint folder (no config.json)")
    if args.ep_size < 1 or args.dp_size not in (0, args.ep_size):
        raise ValueError(
            f"--ep-size must be >= 1 and --dp-size 0 or --ep-size, got {args.ep_size}, {args.dp_size}"
        )
    if args.gateways < 1 or args.schedulers < 1:
        raise ValueError(f"--gateways and --schedulers must be >= 1, got {args.gateways}, {args.schedulers}")
    if args.scheduler == "embedded" and args.schedulers != 1:
        raise ValueError(
            "--scheduler embedded: each gateway hosts one scheduler; use --gateways, not --schedulers"
        )
    if not 0 <= args.mtp_k <= 8:
        raise ValueError(f"--mtp-k must be in 0..8, got {args.mtp_k}")
    cfg = MeshConfig(
        model_dir=model, host=args.host, port=args.port, nats_port=args.nats_port,
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers, schedulers=args.schedulers,
        gateways=args.gateways, embedded_scheduler=args.scheduler == "embedded",
        nats_auth=_nats_auth(args),
        served_model_name=args.served_model_name or _default_name(model), transfer_protocol=args.transfer_protocol,
        device=args.device, dtype=args.dtype, log_dir=Path(args.log_dir) if args.log_dir else None,
        ep_size=args.ep_size,
        restart=RestartPolicy(
            backoff_s=args.restart_backoff, max_backoff_s=args.restart_max_backoff,
            max_restarts=args.restart_limit, window_s=args.restart_window,
        ),
        extra_env={"services.decode_worker": {"MOEMESH_DECODE_WORKER_MTP_K": str(args.mtp_k)}} if args.mtp_k else {},
    )  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mesh = Mesh(cfg, report=lambda line: print(line, flush=True))
    print(f"starting moemesh ({model}); logs in {mesh.log_dir}", flush=True)
    mesh.start(timeout=ready_timeout(args.ready_timeout, args.device))
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

    password = (
        args.nats_password if args.nats_password is not None else os.environ.get("MOEMESH_NATS_PASSWORD", "")
    )
    token = args.nats_token if args.nats_token is not None else os.environ.get("MOEMESH_NATS_TOKEN", "")
    auth = NatsAuth(
        user=args.nats_user, password=password, token=token, tls_cert=args.nats_tls_cert,
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
