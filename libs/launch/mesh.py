"""The whole mesh on one machine, supervised: nats-server and every service as its own process on loopback,
a process that exits restarted with backoff or given up on (libs.launch.restart_policy). `moemesh up`, the
e2e tests and the chaos benchmark all run it, so a fault test exercises the supervision users get."""

# Readiness is observed: every worker not given up on and every scheduler replica has heartbeated, and every
# gateway's /ready is 200. `start(hold=...)` leaves named services for `release(name)`. Ports are never
# picked in advance: services bind port 0 and write what they got to a ports file (libs.bus.ports). Settings
# layers: extra_env and the fields the mesh sets (env vars), the inherited environment, config_file as
# MOEMESH_CONFIG, defaults. `gateways` N > 1: N processes share the API port with SO_REUSEPORT (gateway-0
# binds first, the rest and any restart bind the port it got). `embedded_scheduler`: each gateway hosts a
# scheduler replica instead of a scheduler process. `placement`: a service (or the nats-server) named there
# binds, and is dialled at, its own address in its own network namespace (one host per service, for
# partition tests: libs.chaos.netns); the rest run at `host` (nats-server: 127.0.0.1) in the launcher's.

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import nats

from libs.bus.ports import read_ports
from libs.launch.gpu_placement import VISIBLE
from libs.launch.mooncake_master import MooncakeMaster, start_mooncake_master
from libs.launch.mooncake_master import argv as mooncake_argv
from libs.launch.natsauth import NatsAuth
from libs.launch.restart_policy import RestartPolicy, State
from libs.launch.supervision import SupervisionLoop, log
from libs.launch.supervisor import ServiceSpec, Supervisor, netns_exec
from libs.natsd import NatsServer, find_nats_server_binary, start_nats_server
from proto import decoder, subjects
from proto import messages as m


@dataclass(frozen=True)
class Host:
    """Where a placed service runs: the address it binds and peers dial, its network namespace."""

    address: str
    netns: str = ""


@dataclass
class MeshConfig:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000  # gateway; 0: any free port (the gateway binds it and writes it to its ports file)
    nats_port: int = 0  # 0: any free port (nats-server picks it and writes its ports file)
    prefill_workers: int = 1
    decode_workers: int = 1
    schedulers: int = 1  # replicas in one queue group; names "scheduler" (one) or "scheduler-<i>"
    # no scheduler processes: each gateway hosts a replica in its own process (`schedulers` must stay 1)
    embedded_scheduler: bool = False
    # gateway processes sharing the API port (SO_REUSEPORT); names "gateway" (one) or "gateway-<i>"
    gateways: int = 1
    served_model_name: str = ""
    # worker settings for both worker kinds; None leaves them to the workers' env, config file and defaults
    transfer_protocol: str | None = None
    device: str | None = None
    dtype: str | None = None
    ep_size: int | None = None  # EP ranks (processes) per prefill and decode worker
    log_dir: Path | None = None
    # a YAML config file every service reads (MOEMESH_CONFIG): below the env vars and extra_env
    config_file: Path | None = None
    # extra MOEMESH_* settings per service module name, e.g. {"services.scheduler": {"MOEMESH_SCHEDULER_MAX_QUEUE": "8"}};
    # they beat the launcher's own environment (what `moemesh up` passes its flags as)
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # worker name ("prefill-0", "decode-1", ...) -> the CUDA_VISIBLE_DEVICES it and its EP ranks get
    # (libs.launch.gpu_placement); a worker not named inherits the launcher's
    worker_gpus: dict[str, str] = field(default_factory=dict)
    # NATS security (libs.launch.natsauth): the embedded server requires it, every service is given it
    nats_auth: NatsAuth | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # service name ("decode-0", "gateway", NATS, ...) -> its own host; gateways share one (and the API port)
    placement: dict[str, Host] = field(default_factory=dict)
    # a mooncake_master (supervised, like the nats-server) for the workers' shared KV store tier
    kv_store: bool = False

    def __repr__(self) -> str:  # NatsAuth's repr masks its secrets
        return (
            f"MeshConfig(model_dir={str(self.model_dir)!r}, prefill={self.prefill_workers}, "
            f"decode={self.decode_workers}, schedulers={self.schedulers}, gateways={self.gateways}, "
            f"nats_auth={self.nats_auth!r})"
        )


NATS = "nats-server"  # the supervisor's name for the embedded nats-server
MOONCAKE = "mooncake-master"  # and for the KV store tier's Mooncake Store master


class Mesh:
    def __init__(self, cfg: MeshConfig, report: Callable[[str], None] = log.warning) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="moemesh-logs-"))
        self.nats: NatsServer | None = None
        self.mooncake: MooncakeMaster | None = None
        self.sup = Supervisor(self.log_dir, cfg.restart)
        self.report = report  # the supervisor's lines for the operator (exits, restarts, give-ups)
        self._loop: SupervisionLoop | None = None
        self.launcher_id = f"launcher-{uuid.uuid4().hex[:8]}"  # in its LauncherStatus on the bus
        self.port = cfg.port  # the gateway's; with 0, the port it bound, once start() returned
        self.model_name = cfg.served_model_name or Path(cfg.model_dir).resolve().name
        # the JetStream store and the 0600 nats-auth.conf: private to this Mesh, kept across
        # restart_nats (state survives a server restart), removed in stop()
        self._nats_dir: Path | None = None
        self._held: dict[str, ServiceSpec] = {}  # services start(hold=...) left for release()

    @property
    def url(self) -> str:
        return f"http://{self.host_of(self.gateway_names()[0]).address}:{self.port}"

    def host_of(self, name: str) -> Host:
        """Where a service (or the nats-server) runs: its placement, else `host` in this namespace."""
        return self.cfg.placement.get(name) or Host("127.0.0.1" if name == NATS else self.cfg.host)

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def worker_ids(self, role: m.Role) -> list[str]:
        n, p = (
            (self.cfg.prefill_workers, "prefill")
            if role == m.Role.PREFILL
            else (self.cfg.decode_workers, "decode")
        )
        return [f"{p}-{i}" for i in range(n)]

    def _spec(self, name: str, module: str, prefix: str, **fields: object) -> ServiceSpec:
        c = self.cfg
        env = {"MOEMESH_NATS_URL": self.nats_url, "MOEMESH_LOG_LEVEL": "INFO"}
        if c.config_file is not None:
            env["MOEMESH_CONFIG"] = str(c.config_file)
        env.update(c.nats_auth.client_env() if c.nats_auth else {})
        if module != "services.gateway" or c.gateways > 1:  # one gateway: /health, /metrics on its API port
            fields = {"http_host": self.host_of(name).address, "http_port": -1, **fields}  # -1: any free port
        if name in c.placement and module in ("services.prefill_worker", "services.decode_worker"):
            fields = {"transfer_hostname": c.placement[name].address, **fields}
        fields = {"ports_file": self.ports_file(name), **fields}
        env.update({f"{prefix}{k.upper()}": str(v) for k, v in fields.items()})
        env.update(c.extra_env.get(module, {}))
        return ServiceSpec(
            name, module, env, ports_file=self.ports_file(name), netns=self.host_of(name).netns
        )

    def specs(self) -> list[ServiceSpec]:
        c = self.cfg
        model = str(Path(c.model_dir).resolve())
        spec = self._spec
        chosen = dict(
            transfer_protocol=c.transfer_protocol, device=c.device, dtype=c.dtype, ep_size=c.ep_size
        )
        worker: dict[str, object] = dict(model_dir=model, served_model_name=self.model_name)
        worker.update({k: v for k, v in chosen.items() if v is not None})
        if self.mooncake is not None:
            worker["kv_store_master"] = self.mooncake.address
        out = [spec("kv-broker", "services.kv_broker", "MOEMESH_KV_BROKER_")]
        out += [
            spec(name, "services.scheduler", "MOEMESH_SCHEDULER_", instance_id=name)
            for name in self.scheduler_names()
        ]
        out += [
            spec(w, "services.prefill_worker", "MOEMESH_PREFILL_WORKER_", instance_id=w, **worker)
            for w in self.worker_ids(m.Role.PREFILL)
        ]
        out += [
            spec(w, "services.decode_worker", "MOEMESH_DECODE_WORKER_", instance_id=w, **worker)
            for w in self.worker_ids(m.Role.DECODE)
        ]
        for s in out:
            if s.name in c.worker_gpus:
                s.env[VISIBLE] = c.worker_gpus[s.name]
        return out + [self.gateway_spec(name) for name in self.gateway_names()]

    def gateway_spec(self, name: str) -> ServiceSpec:
        """One gateway replica on `self.port` (0 until the first one bound it). Its bus id stays random
        per process (tokens come back on `mesh.stream.<id>`, so a restarted replica never gets its previous
        life's streams); replicas share the API port by SO_REUSEPORT and each has a side port."""
        reuse = {"reuse_port": "true"} if self.cfg.gateways > 1 else {}
        embedded = {"embedded_scheduler": "true"} if self.cfg.embedded_scheduler else {}
        spec = self._spec(
            name, "services.gateway", "MOEMESH_GATEWAY_", host=self.host_of(name).address, port=self.port,
            model_dir=str(Path(self.cfg.model_dir).resolve()), served_model_name=self.model_name, **reuse,
            **embedded,
        )  # fmt: skip
        if self.cfg.embedded_scheduler:  # the hosted scheduler reads its own settings there
            spec.env.update(self.cfg.extra_env.get("services.scheduler", {}))
        return spec

    def ports_file(self, service: str) -> Path:
        return self.log_dir / "ports" / f"{service}.json"

    def ports(self, service: str, timeout: float = 60.0) -> dict[str, int]:
        """The ports a service bound, waiting (up to `timeout`) for a just started one to write them."""
        deadline = time.monotonic() + timeout
        while (ports := read_ports(self.ports_file(service))) is None:
            proc = self.sup.procs.get(service)
            if proc is not None and not proc.alive:
                raise RuntimeError(f"{service} exited before binding its ports; log tail:\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{service} wrote no ports file within {timeout:.0f}s; logs in {self.log_dir}"
                )
            time.sleep(0.05)  # a child process writes the file: nothing to wait on but the file
        return ports

    def side_port(self, service: str) -> int:
        """The /health and /metrics port of a service other than the gateway."""
        return self.ports(service)["http"]

    def scheduler_names(self) -> list[str]:
        """The scheduler processes (none when every gateway embeds one)."""
        if self.cfg.embedded_scheduler:
            return []
        n = self.cfg.schedulers
        return ["scheduler"] if n == 1 else [f"scheduler-{i}" for i in range(n)]

    def gateway_names(self) -> list[str]:
        n = self.cfg.gateways
        return ["gateway"] if n == 1 else [f"gateway-{i}" for i in range(n)]

    def _pin_port(self, port: int) -> None:
        """The API port the first gateway bound: the other replicas bind it too, and a restarted replica
        binds it again (not another free port), so `url` stays the mesh's one URL."""
        self.port = port
        for name in self.gateway_names():
            if name in self._held:
                self._held[name] = self.gateway_spec(name)
            elif name in self.sup.procs:
                self.sup.respec(name, self.gateway_spec(name))

    def _start_nats(self, port: int) -> None:
        """The first start picks the port (the server binds it); the supervisor restarts the server on
        that port with the same JetStream store, so a restart loses no bucket."""
        self._nats_dir = Path(tempfile.mkdtemp(prefix="moemesh-nats-"))
        args = self.cfg.nats_auth.server_args(self._nats_dir) if self.cfg.nats_auth else []
        store = str(self._nats_dir / "store")
        host = self.host_of(NATS)
        self.nats = start_nats_server(
            port, jetstream=True, host=host.address, store_dir=store, extra_args=args,
            prefix=netns_exec(host.netns),
        )  # fmt: skip
        argv = (find_nats_server_binary(), "-a", host.address, "-p", str(self.nats.port), "-js", "-sd", store)
        spec = ServiceSpec(NATS, "", argv=(*argv, *args), netns=host.netns)
        self.sup.adopt(spec, self.nats.proc, Path(self.nats.log_path))

    def _start_mooncake(self) -> None:
        """The KV store tier's master, on a port the kernel picks; restarted by the supervisor on that port
        (the workers' store clients remount on their own once it is back, the pages it had are gone)."""
        host = self.host_of(MOONCAKE)
        self.mooncake = start_mooncake_master(host.address, prefix=netns_exec(host.netns))
        argv = tuple(mooncake_argv(host.address, self.mooncake.port))
        spec = ServiceSpec(MOONCAKE, "", argv=argv, netns=host.netns)
        self.sup.adopt(spec, self.mooncake.proc, self.mooncake.log_path)

    def restart_nats(self, timeout: float = 30.0) -> None:
        """Crash the nats-server (SIGKILL) and wait until the supervisor has it serving again on the
        same port with the same JetStream store (services reconnect on their own)."""
        n = self.sup.restarts(NATS)
        self.sup.kill(NATS)
        self.wait_restarted(NATS, n + 1, timeout)

    def wait_restarted(self, name: str, restarts: int, timeout: float = 60.0) -> None:
        """Until the supervisor restarted `name` at least `restarts` times in all and it is up again
        (for the nats-server: accepting connections; other services: see libs.chaos.scenarios)."""
        deadline = time.monotonic() + timeout
        while not (self.sup.restarts(name) >= restarts and self.sup.state(name) is State.UP):
            if self.sup.state(name) is State.GIVEN_UP or time.monotonic() > deadline:
                raise TimeoutError(f"{name} not restarted {restarts} times: {self.sup.summary()}")
            time.sleep(0.05)  # the supervision thread restarts it; nothing to wait on but its records
        if name == NATS:
            while not _accepts(self.host_of(NATS).address, self.nats.port if self.nats else 0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats-server not accepting connections after {timeout:.0f}s")
                time.sleep(0.05)  # a starting server: poll its port

    def start(self, timeout: float = 120.0, hold: Collection[str] = ()) -> Mesh:
        """Start nats-server and every service, and wait until the mesh is ready (module docstring);
        the services named in `hold` ("decode-0", ...) are not started: `release` starts them."""
        if self.cfg.schedulers < 1 or self.cfg.gateways < 1:
            raise ValueError(f"schedulers and gateways must be >= 1: {self.cfg!r}")
        if self.cfg.embedded_scheduler and self.cfg.schedulers != 1:
            raise ValueError(
                f"with embedded_scheduler each gateway hosts one: leave schedulers at 1: {self.cfg!r}"
            )
        try:
            self._start_nats(self.cfg.nats_port)
            if self.cfg.kv_store:
                self._start_mooncake()
            self._loop = SupervisionLoop(
                self.sup, self.nats_url, self.connect_options(), self.report, self.launcher_id
            )
            self._loop.start()
            specs = self.specs()
            unknown = set(hold) - {s.name for s in specs}
            if unknown:
                raise ValueError(f"hold: no services {sorted(unknown)} in this mesh")
            first, *rest = self.gateway_names()
            later = rest if self.port == 0 else []  # they bind the port the first one got
            if first in hold and later:
                raise ValueError(f"hold: {first} binds the API port the other gateways share")
            for s in specs:
                if s.name not in later:
                    self._start_or_hold(s, hold)
            if later:
                self._pin_port(self.ports(first, timeout)["api"])
                for name in later:
                    self._start_or_hold(self.gateway_spec(name), hold)
            asyncio.run(self._wait_ready(timeout))
        except BaseException:
            self.stop()
            raise
        return self

    def _start_or_hold(self, spec: ServiceSpec, hold: Collection[str]) -> None:
        if spec.name in hold:
            self._held[spec.name] = spec
        else:
            self.sup.start(spec)

    def release(self, name: str) -> None:
        """Start a service that `start(hold=...)` left out (no wait: the caller observes it)."""
        self.sup.start(self._held.pop(name))

    def check_serviceable(self) -> None:
        """Raise when what was given up on leaves nothing that can serve a request."""
        gone = set(self.sup.given_up())
        lost = [n for n in (NATS, "kv-broker") if n in gone]
        for group in (self.scheduler_names(), self.worker_ids(m.Role.DECODE), self.gateway_names()):
            if set(group) <= gone:
                lost += group
        if lost:
            raise RuntimeError(
                f"the mesh cannot serve: given up on {', '.join(lost)}; logs in {self.log_dir}"
            )

    async def _wait_ready(self, timeout: float) -> None:
        want = set(self.worker_ids(m.Role.PREFILL)) | set(self.worker_ids(m.Role.DECODE))
        want |= set(self.scheduler_names())  # every replica beats once its subscriptions are live
        want -= set(self._held)
        # a service the supervisor gave up on is not waited for (the operator saw why); the rest serves
        seen: set[str] = set()
        dec = decoder(m.Heartbeat)
        sched_dec = decoder(m.SchedulerHeartbeat)
        nc = await nats.connect(self.nats_url, **self.connect_options())

        async def on_hb(msg: object) -> None:
            hb = dec.decode(msg.data)  # type: ignore[attr-defined]
            if isinstance(hb, m.WorkerHeartbeat):
                seen.add(hb.worker_id)

        async def on_sched(msg: object) -> None:
            seen.add(sched_dec.decode(msg.data).scheduler_id)  # type: ignore[attr-defined]

        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_hb)
        await nc.subscribe(subjects.SCHED_HEARTBEAT, cb=on_sched)
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.check_serviceable()
                first = self.ports_file(self.gateway_names()[0])
                if self.port == 0 and (ports := read_ports(first)) is not None:
                    self._pin_port(ports["api"])
                if want - set(self.sup.given_up()) <= seen and self._gateways_healthy():
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"mesh not ready after {timeout:.0f}s: heard {sorted(seen)} of {sorted(want)}, "
                        f"gateways healthy={self._gateways_healthy()}; logs in {self.log_dir}"
                    )
                await asyncio.sleep(0.1)  # readiness poll of child processes; each check is a real condition
        finally:
            await nc.close()

    def connect_options(self) -> dict:
        """nats-py connect options for a client of this mesh (tests, benchmarks)."""
        return self.cfg.nats_auth.client_options() if self.cfg.nats_auth else {}

    def metrics_url(self, service: str) -> str:
        """Prometheus endpoint of one service ("gateway", "gateway-1", "scheduler", "prefill-0", ...)."""
        if service == "gateway" and self.cfg.gateways == 1:
            return f"{self.url}/metrics"
        if service == "gateway":
            raise ValueError(f"{self.cfg.gateways} gateways share the API port: ask {self.gateway_names()}")
        return f"http://{self.host_of(service).address}:{self.side_port(service)}/metrics"

    def gateway_metrics_urls(self) -> list[str]:
        """Every gateway replica's Prometheus endpoint (their counters add up to the mesh's)."""
        return [self.metrics_url(name) for name in self.gateway_names()]

    def _gateway_base(self, name: str) -> str | None:
        """Where this replica alone answers: the API port for one gateway, else its side port."""
        if self.cfg.gateways == 1:
            return self.url if self.port else None
        ports = read_ports(self.ports_file(name))
        return None if ports is None else f"http://{self.host_of(name).address}:{ports['http']}"

    def _gateways_healthy(self) -> bool:
        """Every gateway started and not given up on answers /ready (/health where no decode worker is
        started), and the API port is known."""
        decode_started = set(self.worker_ids(m.Role.DECODE)) - set(self._held)
        path = "/ready" if decode_started else "/health"
        skip = set(self._held) | set(self.sup.given_up())
        bases = [self._gateway_base(n) for n in self.gateway_names() if n not in skip]
        return self.port != 0 and bool(bases) and all(b is not None and _answers_200(b + path) for b in bases)

    def stop(self) -> None:
        """Drain and stop every service, then the nats-server (they drain over it)."""
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        self.sup.stop_all(last=(NATS, MOONCAKE))  # the workers leave the store while its master is up
        if self.mooncake is not None:
            self.mooncake.stop()
            self.mooncake = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self._nats_dir is not None:
            shutil.rmtree(self._nats_dir, ignore_errors=True)
            self._nats_dir = None

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False
