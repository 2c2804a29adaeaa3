"""Gateway settings: env `MOEMESH_GATEWAY_<FIELD>` or `--<field>` flags (libs.bus.load_settings)."""

# The gateway's id on the bus is `instance_id` (random per process unless set): tokens for this
# gateway arrive on `mesh.stream.<instance_id>`, so two gateways must never share one. The Service
# side port (`http_port`) stays off by default: the API port serves /health and /metrics itself; replicas
# sharing one API port (`reuse_port`) turn it on, so each one's /metrics and /ready can be asked directly.

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from libs.bus.settings import ServiceSettings
from services.gateway.reasoning import CHOICES as REASONING_CHOICES


class GatewaySettings(ServiceSettings, frozen=True, kw_only=True):
    host: Annotated[str, msgspec.Meta(description="address of the API port")] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535, description="API port; 0: any free port")] = 8000
    reuse_port: Annotated[
        bool,
        msgspec.Meta(
            description="bind the API port with SO_REUSEPORT, shared by several gateway processes (each must set it)"
        ),
    ] = False
    model_dir: Annotated[
        str,
        msgspec.Meta(
            description="checkpoint folder: config.json and tokenizer files (no weights needed; required)"
        ),
    ] = ""
    served_model_name: Annotated[
        str, msgspec.Meta(description="the model name clients use; empty: the folder's name")
    ] = ""
    api_key: Annotated[
        str, msgspec.Meta(description="when set, /v1/* requires `Authorization: Bearer <api_key>` (secret)")
    ] = ""
    request_timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="seconds a whole request may take, first byte to last")
    ] = 600.0
    submit_timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="seconds to wait for the scheduler's answer to a submit")
    ] = 5.0
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, description="largest request body accepted")] = (
        16 * 1024 * 1024
    )
    enable_admin: Annotated[
        bool,
        msgspec.Meta(description="serve /admin/* (worker stats, decode slow-down), behind api_key when set"),
    ] = False
    max_migrations: Annotated[
        int,
        msgspec.Meta(
            ge=0, description="times a choice whose worker died is re-submitted (prompt plus tokens so far)"
        ),
    ] = 3
    migration_wait_s: Annotated[
        float,
        msgspec.Meta(
            ge=0, description="seconds a migration's re-submit is retried while the mesh answers 503"
        ),
    ] = 30.0
    dead_after_intervals: Annotated[
        float,
        msgspec.Meta(
            gt=0, description="heartbeat periods of silence before a worker or scheduler counts as gone"
        ),
    ] = 3.0
    max_in_flight: Annotated[
        int, msgspec.Meta(ge=1, description="requests in flight at this gateway before it answers 429")
    ] = 4096
    retry_after_s: Annotated[
        int, msgspec.Meta(ge=0, description="Retry-After seconds sent with every 429 and 503")
    ] = 1
    strict_fields: Annotated[
        bool,
        msgspec.Meta(
            description="refuse unknown request fields with a 400 (OpenAI's behaviour) instead of ignoring them"
        ),
    ] = False
    embedded_scheduler: Annotated[
        bool,
        msgspec.Meta(
            description="host a scheduler replica in this process (its settings from the scheduler's env and section)"
        ),
    ] = False
    reasoning_parser: Annotated[
        str,
        msgspec.Meta(
            description="split chat output into reasoning_content and content: deepseek_r1 (<think>...</think>, "
            "R1 and V3.1), none, or auto (deepseek_r1 when the chat template writes <think>)"
        ),
    ] = "auto"

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir is required (MOEMESH_GATEWAY_MODEL_DIR or --model-dir)")
        if self.reasoning_parser not in REASONING_CHOICES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_CHOICES)}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name
