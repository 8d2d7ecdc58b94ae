"""KV storage: the block format, the store interface and its tiers (memory -> disk -> redis)."""

from kvboost_core.store.base import DensePayload, KVBlock, KVGeometry, KVPayload, KVStore
from kvboost_core.store.disk import DiskStore
from kvboost_core.store.eviction import EntryMeta, EvictionPolicy, ImportancePolicy, LRUPolicy
from kvboost_core.store.factory import build_store
from kvboost_core.store.memory import MemoryStore
from kvboost_core.store.redis_tier import RedisStore
from kvboost_core.store.serialize import CorruptEntry, ForeignEntry
from kvboost_core.store.tiered import TieredStore

__all__ = ["CorruptEntry", "DensePayload", "DiskStore", "EntryMeta", "EvictionPolicy", "ForeignEntry",
           "ImportancePolicy", "KVBlock", "KVGeometry", "KVPayload", "KVStore", "LRUPolicy", "MemoryStore",
           "RedisStore", "TieredStore", "build_store"]
