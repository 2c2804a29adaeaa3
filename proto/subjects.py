"""Every NATS subject of the mesh, in one place. Routing data (worker id, gateway id) sits in the subject so
NATS does the routing; request ids ride in the message bodies. Each subject carries exactly one union of
message types (proto.messages)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proto.messages import WorkerGone, WorkerHeartbeat

PREFIX = "mesh"

# gateway -> scheduler (request/reply, queue group QUEUE_SCHEDULER): Submit -> SubmitReply
SCHED_SUBMIT = f"{PREFIX}.sched.submit"
QUEUE_SCHEDULER = "scheduler"

# anyone -> everyone holding a request (broadcast): Cancel
CANCEL = f"{PREFIX}.cancel"

# workers -> schedulers, broker, gateways, decode workers (broadcast): WorkerHeartbeat / WorkerGone, on
# one subject per worker role, so each process subscribes to the roles it needs: a decode worker hears
# only prefill workers (those that fill its reservations), never its decode peers. Without this every
# decode worker received every heartbeat: deliveries grew with workers squared.
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*"


def heartbeat(role: str) -> str:
    """Heartbeats of one worker role ("decode" or "prefill": `proto.messages.Role` names, lower case)."""
    return f"{PREFIX}.heartbeat.{check_token(role)}"


def heartbeat_of(msg: WorkerHeartbeat | WorkerGone) -> str:
    """The subject a worker's heartbeat (or goodbye) goes to."""
    return heartbeat(msg.role.name.lower())


# scheduler replicas -> gateways (broadcast): SchedulerHeartbeat
SCHED_HEARTBEAT = f"{PREFIX}.sched.heartbeat"

# the embedded launcher -> gateways (broadcast): LauncherStatus
LAUNCHER_STATUS = f"{PREFIX}.launcher.status"

# kv-broker (request/reply, queue group QUEUE_BROKER): BrokerRequest union -> BrokerReply union
BROKER = f"{PREFIX}.broker"
QUEUE_BROKER = "kv-broker"

# admin requests (request/reply) to one service instance: Admin* -> AdminReply
ADMIN_ALL = f"{PREFIX}.admin.>"


def decode_inbox(worker_id: str) -> str:
    """A decode worker's control inbox: DecodeInbox union (ReserveKv is request/reply)."""
    return f"{PREFIX}.decode.{worker_id}"


def prefill_inbox(worker_id: str) -> str:
    """A prefill worker's task inbox: PrefillInbox union."""
    return f"{PREFIX}.prefill.{worker_id}"


def stream(gateway_id: str) -> str:
    """Token stream to one gateway: StreamMessage union (coalesced per decode step)."""
    return f"{PREFIX}.stream.{gateway_id}"


def admin(service: str, instance_id: str) -> str:
    """Admin request/reply subject of one service instance (stats, slow-down, ...)."""
    return f"{PREFIX}.admin.{service}.{instance_id}"


def kv_events(worker_id: str) -> str:
    """A worker's KV cache events (blocks stored / removed), for prefix-aware routing: KvEvent union."""
    return f"{PREFIX}.kv_events.{worker_id}"


# every worker's KV cache events (the kv-broker's prefix index listens to all, no queue group)
KV_EVENTS_ALL = f"{PREFIX}.kv_events.*"

# prefix overlap queries (request/reply, queue group QUEUE_BROKER): PrefixQuery -> PrefixReply
BROKER_PREFIX = f"{PREFIX}.broker.prefix"


def kv_snapshot(worker_id: str) -> str:
    """A worker's snapshot subject (request/reply): KvSnapshotRequest -> KvSnapshot."""
    return f"{PREFIX}.kv_snapshot.{worker_id}"


def check_token(token: str) -> str:
    """Ids placed into subjects must be single NATS tokens."""
    if not token or any(c in token for c in ". *>\t\r\n"):
        raise ValueError(f"invalid id for a NATS subject token: {token!r}")
    return token
