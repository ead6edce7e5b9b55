"""Eviction priorities of SGLang 0.5.14 (``mem_cache/evict_policy.py``): a node with a
smaller priority is evicted first.  Priorities read the node's logical times
(``last_access_time``, ``creation_time``), hit count and request priority.

``get_eviction_strategy(name)`` maps SGLang's ``--radix-eviction-policy`` names to them.
"""
from __future__ import annotations

from sim.errors import InputError, show

__all__ = [
    "LRUStrategy",
    "LFUStrategy",
    "FIFOStrategy",
    "MRUStrategy",
    "FILOStrategy",
    "PriorityStrategy",
    "SLRUStrategy",
    "get_eviction_strategy",
    "EVICTION_POLICIES",
]


class LRUStrategy:
    """Least recently used first: ``last_access_time``."""

    def get_priority(self, node):
        return node.last_access_time


class LFUStrategy:
    """Fewest hits first, then least recently used: ``(hit_count, last_access_time)``."""

    def get_priority(self, node):
        return (node.hit_count, node.last_access_time)


class FIFOStrategy:
    """Oldest created first: ``creation_time``."""

    def get_priority(self, node):
        return node.creation_time


class MRUStrategy:
    """Most recently used first: ``-last_access_time``."""

    def get_priority(self, node):
        return -node.last_access_time


class FILOStrategy:
    """Newest created first: ``-creation_time``."""

    def get_priority(self, node):
        return -node.creation_time


class PriorityStrategy:
    """Lower request priority first, then least recently used."""

    def get_priority(self, node):
        return (node.priority, node.last_access_time)


class SLRUStrategy:
    """Segmented LRU: nodes hit fewer than ``protected_threshold`` times go first, LRU
    within each segment."""

    def __init__(self, protected_threshold: int = 2):
        self.protected_threshold = protected_threshold

    def get_priority(self, node):
        return (1 if node.hit_count >= self.protected_threshold else 0, node.last_access_time)


_FACTORIES = {
    "lru": LRUStrategy,
    "lfu": LFUStrategy,
    "fifo": FIFOStrategy,
    "mru": MRUStrategy,
    "filo": FILOStrategy,
    "priority": PriorityStrategy,
    "slru": SLRUStrategy,
}
#: the eviction policy names (SGLang's ``--radix-eviction-policy`` choices)
EVICTION_POLICIES = tuple(_FACTORIES)


def get_eviction_strategy(eviction_policy: str):
    """The strategy for a policy name (case-insensitive), as SGLang's
    ``get_eviction_strategy``; an unknown name is an ``InputError``."""
    policy = str(eviction_policy).lower()
    factory = _FACTORIES.get(policy)
    if factory is None:
        raise InputError("eviction_policy", f"expected one of {sorted(_FACTORIES)}, got {show(eviction_policy)}")
    return factory()
