"""Which node holds each in-flight item (a request at a gateway: its scheduler replica, then its decode
worker; a reservation at a decode worker: its prefill worker), with the reverse index, so a node's death
finds its items in O(items of that node). Pure; bounded by the items the caller tracks."""

from __future__ import annotations


class Holders:
    def __init__(self) -> None:
        self._holder: dict[str, str] = {}
        self._items: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._holder)

    def holder(self, item: str) -> str | None:
        return self._holder.get(item)

    def set(self, item: str, node: str) -> None:
        """`node` holds `item` now (replacing any earlier holder)."""
        old = self._holder.get(item)
        if old == node:
            return
        if old is not None:
            self._unlink(item, old)
        self._holder[item] = node
        self._items.setdefault(node, set()).add(item)

    def setdefault(self, item: str, node: str) -> None:
        """`node` holds `item` unless a holder is already known (a later, more precise one wins)."""
        if item not in self._holder:
            self.set(item, node)

    def drop(self, item: str) -> None:
        node = self._holder.pop(item, None)
        if node is not None:
            self._unlink(item, node)

    def items_of(self, node: str) -> list[str]:
        return sorted(self._items.get(node, ()))

    def nodes(self) -> list[str]:
        return list(self._items)

    def _unlink(self, item: str, node: str) -> None:
        items = self._items.get(node)
        if items is not None:
            items.discard(item)
            if not items:
                del self._items[node]
