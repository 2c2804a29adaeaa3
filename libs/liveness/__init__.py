"""Who is alive on the mesh, from heartbeats, and which node holds which in-flight item."""

# `LivenessTable` and `Holders` are pure (times passed in); `LivenessWatch` feeds a table from the bus
# (worker and scheduler heartbeats) and reports deaths, measuring silence on a `StallClock` (this
# process's own stalls excluded). The scheduler's worker view, the gateway
# (request migration) and the decode worker (reservations whose prefill worker died) share the rule.

from libs.liveness.holders import Holders
from libs.liveness.stall_clock import StallClock
from libs.liveness.table import LivenessTable, expires_at
from libs.liveness.watch import LivenessWatch

__all__ = ["Holders", "LivenessTable", "LivenessWatch", "StallClock", "expires_at"]
