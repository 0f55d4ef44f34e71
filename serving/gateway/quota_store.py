"""The process's quota store, chosen once: Redis when REDIS_URL is set (shared by every gateway
process), process memory otherwise."""

from __future__ import annotations

import threading

from django.conf import settings

from serving.gateway.quota import QuotaStore
from serving.gateway.quota_memory import MemoryQuotaStore
from serving.gateway.quota_redis import RedisQuotaStore

_quota_store: QuotaStore | None = None
_quota_store_lock = threading.Lock()


def quota_store() -> QuotaStore:
    global _quota_store
    with _quota_store_lock:
        if _quota_store is None:
            _quota_store = RedisQuotaStore(settings.REDIS_URL) if settings.REDIS_URL else MemoryQuotaStore()
        return _quota_store


def reset_quota_store(store: QuotaStore | None = None) -> None:
    global _quota_store
    with _quota_store_lock:
        _quota_store = store
