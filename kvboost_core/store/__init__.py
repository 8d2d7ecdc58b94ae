"""KV storage: the block format, the store interface and its tiers."""

from kvboost_core.store.base import DensePayload, KVBlock, KVPayload, KVStore
from kvboost_core.store.eviction import EntryMeta, EvictionPolicy, LRUPolicy
from kvboost_core.store.memory import MemoryStore

__all__ = ["DensePayload", "EntryMeta", "EvictionPolicy", "KVBlock", "KVPayload", "KVStore", "LRUPolicy",
           "MemoryStore"]
