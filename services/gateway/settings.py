"""Gateway settings: env `MOEMESH_GATEWAY_<FIELD>` or `--<field>` flags (libs.bus.load_settings).

The gateway's id on the bus is `instance_id` (random per process unless set): tokens for this
gateway arrive on `mesh.stream.<instance_id>`, so two gateways must never share one. The Service
side port (`http_port`) stays off by default: the API port serves /health and /metrics itself; replicas
sharing one API port (`reuse_port`) turn it on, so each one's /metrics and /ready can be asked directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from libs.bus.settings import ServiceSettings


class GatewaySettings(ServiceSettings, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000  # 0: any free port
    # bind the API port with SO_REUSEPORT (Linux): several gateway processes listen on one port and the
    # kernel spreads new connections over them (`moemesh up --gateways N`); every one of them must set it
    reuse_port: bool = False
    model_dir: str = ""  # checkpoint folder: config.json + tokenizer files (no weights needed)
    served_model_name: str = ""  # the `model` clients name; default: the folder's name
    api_key: str = ""  # when set, `Authorization: Bearer <api_key>` is required on /v1/*
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0  # a whole request, first byte to last
    submit_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0  # waiting for the scheduler's answer
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16 * 1024 * 1024
    enable_admin: bool = False  # /admin/* (worker stats, decode slow-down), behind api_key when set
    # a choice whose worker dies is re-submitted (prompt + tokens so far) up to this many times
    max_migrations: Annotated[int, msgspec.Meta(ge=0)] = 3
    # how long a migration's re-submit is tried again while the mesh refuses it 503 (right after a death no
    # live worker or scheduler may be left until the supervisor has restarted one), within the request's
    # own deadline; at least submit_timeout_s
    migration_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    dead_after_intervals: Annotated[float, msgspec.Meta(gt=0)] = 3.0  # heartbeat periods of silence
    # overload: mesh requests (choices) in flight at this gateway before it answers 429 itself, and the
    # Retry-After (s) sent with every 429 / 503
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 4096
    retry_after_s: Annotated[int, msgspec.Meta(ge=0)] = 1
    # refuse unknown request fields with a 400 (OpenAI's behaviour) instead of ignoring them (vLLM's)
    strict_fields: bool = False
    # host a scheduler replica in this process (services/gateway/embedded_scheduler.py; its settings from
    # MOEMESH_SCHEDULER_*): this gateway's submits reach it without a bus hop; `moemesh up --scheduler embedded`
    embedded_scheduler: bool = False

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir is required (MOEMESH_GATEWAY_MODEL_DIR or --model-dir)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name
