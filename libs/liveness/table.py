"""The liveness rule, as pure code: a node is dead once unheard for `dead_after_intervals` times its own
heartbeat interval, or at once when it says it is gone. Times are local monotonic seconds passed in
(receive time, so clock skew between hosts does not matter)."""

# A node can be `assume`d alive before it was ever heard (a request names a holder this process has not
# heard from yet): it gets one grace period from then, with a default interval, and is declared dead if
# no heartbeat follows. After this process's own outage (its bus was disconnected, so silence proves
# nothing) `restart_clock` gives every node a fresh grace period.

from __future__ import annotations

from dataclasses import dataclass


def expires_at(last_seen: float, interval_ms: float, dead_after_intervals: float) -> float:
    """When a node last heard at `last_seen` is declared dead if it stays silent."""
    return last_seen + dead_after_intervals * interval_ms / 1000.0


@dataclass
class _Node:
    last_seen: float
    interval_ms: float


class LivenessTable:
    """Nodes heard recently. Bounded: at most `max_nodes` are tracked (new unknown ids beyond that are
    not tracked, and count as alive), so heartbeats with made-up ids cannot grow it without bound."""

    def __init__(
        self, dead_after_intervals: float = 3.0, default_interval_ms: float = 250.0, max_nodes: int = 4096
    ) -> None:
        if not dead_after_intervals > 0:
            raise ValueError(f"dead_after_intervals must be > 0, got {dead_after_intervals}")
        if not default_interval_ms > 0:
            raise ValueError(f"default_interval_ms must be > 0, got {default_interval_ms}")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.dead_after_intervals = dead_after_intervals
        self.default_interval_ms = default_interval_ms
        self.max_nodes = max_nodes
        self._nodes: dict[str, _Node] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def _room(self, node_id: str) -> bool:
        return node_id in self._nodes or len(self._nodes) < self.max_nodes

    def beat(self, node_id: str, interval_ms: float, now: float) -> None:
        """A heartbeat from `node_id`, which promises the next within `interval_ms`."""
        if not interval_ms > 0:
            raise ValueError(f"heartbeat of {node_id!r}: interval_ms must be > 0, got {interval_ms}")
        if self._room(node_id):
            self._nodes[node_id] = _Node(now, interval_ms)

    def assume(self, node_id: str, now: float) -> None:
        """Treat a node never heard as alive for one grace period from `now` (no-op when known)."""
        if node_id not in self._nodes and self._room(node_id):
            self._nodes[node_id] = _Node(now, self.default_interval_ms)

    def gone(self, node_id: str) -> bool:
        """The node left (graceful shutdown): forget it now; True if it was known."""
        return self._nodes.pop(node_id, None) is not None

    def expiry(self, node_id: str) -> float | None:
        n = self._nodes.get(node_id)
        return None if n is None else expires_at(n.last_seen, n.interval_ms, self.dead_after_intervals)

    def is_alive(self, node_id: str, now: float) -> bool:
        """Known and not yet past its expiry. An unknown node is not alive (call `assume` first)."""
        t = self.expiry(node_id)
        return t is not None and now <= t

    def expire(self, now: float) -> list[str]:
        """Forget and return the nodes silent past their expiry."""
        dead = [k for k in self._nodes if now > (self.expiry(k) or 0.0)]
        for k in dead:
            del self._nodes[k]
        return dead

    def next_expiry(self) -> float | None:
        return min((self.expiry(k) or 0.0 for k in self._nodes), default=None)

    def restart_clock(self, now: float) -> None:
        """Our own outage is over: silence during it proves nothing, so everyone starts afresh."""
        for n in self._nodes.values():
            n.last_seen = now
