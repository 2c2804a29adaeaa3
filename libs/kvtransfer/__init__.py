"""KV transfer: the transport interface (base), Mooncake and in-process transports, the run planner."""

from libs.kvtransfer.base import KvTransport, Run, TransferError
from libs.kvtransfer.inprocess import InProcessTransport
from libs.kvtransfer.mooncake import PROTOCOLS, MooncakeTransport
from libs.kvtransfer.planner import Geometry, PageGeometry, check_compatible, merge_page_pairs, plan_page_runs
from libs.kvtransfer.skip import SkipTransport


def make_transport(protocol: str = "tcp", hostname: str = "127.0.0.1", device_name: str = "") -> KvTransport:
    """A worker's transport from its settings: "inprocess", "skip" (moves nothing, engine=sim) or a
    Mooncake protocol (tcp, rdma, nvlink_intra)."""
    if protocol == "inprocess":
        return InProcessTransport()
    if protocol == "skip":
        return SkipTransport()
    return MooncakeTransport(protocol, hostname, device_name)


__all__ = [
    "PROTOCOLS",
    "Geometry",
    "InProcessTransport",
    "KvTransport",
    "MooncakeTransport",
    "PageGeometry",
    "Run",
    "SkipTransport",
    "TransferError",
    "check_compatible",
    "make_transport",
    "merge_page_pairs",
    "plan_page_runs",
]
