"""State kept per tenant: one bounded map for each tenant, so that one tenant's traffic only ever pushes out its
own oldest entries, never another tenant's."""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PerTenantLru(Generic[K, V]):
    """``tenant -> key -> value``, each tenant's map holding at most ``capacity`` entries (least recently put out
    first). Memory is bounded by tenants x ``capacity``; the tenants are those of the keys file."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._maps: dict[str, OrderedDict[K, V]] = {}
        self.evicted = 0  # entries pushed out by their own tenant's newer ones

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps.values())

    def tenants(self) -> Iterator[str]:
        return iter(list(self._maps))

    def size(self, tenant: str) -> int:
        return len(self._maps.get(tenant, ()))

    def put(self, tenant: str, key: K, value: V) -> list[tuple[K, V]]:
        """Store ``value``; the entries of ``tenant`` pushed out to make room (to forget elsewhere too)."""
        entries = self._maps.setdefault(tenant, OrderedDict())
        entries[key] = value
        entries.move_to_end(key)
        out: list[tuple[K, V]] = []
        while len(entries) > self.capacity:
            out.append(entries.popitem(last=False))
        self.evicted += len(out)
        return out

    def get(self, tenant: str, key: K) -> V | None:
        entries = self._maps.get(tenant)
        return entries.get(key) if entries is not None else None

    def pop(self, tenant: str, key: K) -> V | None:
        entries = self._maps.get(tenant)
        if entries is None:
            return None
        value = entries.pop(key, None)
        if not entries:
            del self._maps[tenant]
        return value
