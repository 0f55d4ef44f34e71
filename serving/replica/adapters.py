"""A replica's LoRA adapters (docs/architecture.md, "Adapters on a shared base"): a request for an adapter
version of this replica's base names it in its submission (its directory and digest); on its first use
the preparing thread checks the directory against the digest, reads it with the engine's checks
(serving/engine/lora.py's read_adapter) and keeps the adapter for the next requests, at most
REPLICA_MAX_LORAS of them (least recently used dropped first: the engine installs and evicts its own
slots, keyed by the adapter's id). The model thread only passes it to engine.add_request."""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings

from registry.adapters import verify_adapter_dir
from registry.artifacts import ArtifactError
from serving.telemetry.recorder import AdapterVersion
from serving.transport.protocol import Submit

logger = logging.getLogger(__name__)


class AdapterUnavailable(Exception):
    """The replica cannot serve the adapter a request names; the message says why, for its client."""


def adapter_version(submit: Submit) -> AdapterVersion | None:
    """The adapter version a submission is served as (its metrics' version), None for the base's own."""
    if submit.adapter is None:
        return None
    model_name, _, version = str(submit.adapter).partition(":")
    return AdapterVersion(model_name, version, int(submit.adapter_version_id or 0))


class ReplicaAdapters:
    """The adapters this replica has read, by name and digest. Thread-safe: the preparing thread reads
    them, and the model thread prepares a submission itself when it has nothing else to do."""

    def __init__(self, *, replica_id: str, max_loras: int | None = None) -> None:
        self._replica_id = replica_id
        self._max_loras = max_loras
        self._loaded: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, submit: Submit, engine: Any) -> Any:
        """The engine's LoraAdapter for the submission's adapter, read on first use. Raises
        AdapterUnavailable."""
        name, sha256, uri = str(submit.adapter), submit.adapter_sha256, submit.adapter_uri
        if not sha256 or not uri:
            raise AdapterUnavailable(f"adapter {name}: its directory and digest were not sent")
        key = (name, sha256)
        with self._lock:
            adapter = self._loaded.get(key)
            if adapter is not None:
                self._loaded.move_to_end(key)
                return adapter
        adapter = self._read(name, Path(uri), sha256, engine)
        with self._lock:
            self._loaded[key] = adapter
            self._loaded.move_to_end(key)
            limit = self._max_loras if self._max_loras is not None else settings.REPLICA_MAX_LORAS
            while len(self._loaded) > max(1, limit):
                self._loaded.popitem(last=False)
        return adapter

    def __len__(self) -> int:
        with self._lock:
            return len(self._loaded)

    def _read(self, name: str, directory: Path, sha256: str, engine: Any) -> Any:
        # Deferred (torch, via the engine's package): see serving/replica/engine_loading.py.
        from serving.engine.lora import AdapterError, read_adapter

        runner = getattr(engine, "runner", None)
        if runner is None:  # an encoder's engine
            raise AdapterUnavailable(f"adapter {name}: this model serves no LoRA adapters")
        started = time.perf_counter()
        try:
            verify_adapter_dir(directory, sha256=sha256)
            # Its id names its content: the engine's slots and prefix cache key on it.
            adapter = read_adapter(
                directory,
                f"{name}@{sha256[:16]}",
                runner.model.config,
                max_rank=settings.REPLICA_MAX_LORA_RANK,
            )
        except ArtifactError as exc:
            logger.error("replica %s: adapter %s refused: %s", self._replica_id, name, exc)
            raise AdapterUnavailable(
                f"adapter {name} could not be loaded: its files are missing or do not match their "
                "registered digest"
            ) from None
        except (AdapterError, OSError) as exc:
            logger.error("replica %s: adapter %s refused: %s", self._replica_id, name, exc)
            raise AdapterUnavailable(f"adapter {name} could not be loaded: {exc}") from None
        logger.info(
            "replica %s: adapter %s loaded in %.0f ms (rank %d)",
            self._replica_id,
            name,
            (time.perf_counter() - started) * 1000,
            adapter.rank,
        )
        return adapter
