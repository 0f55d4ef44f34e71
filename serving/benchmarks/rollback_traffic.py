"""The rollback benchmark's traffic: requests sent steadily through every gateway, which version served each
and when, and whether the canary stopped getting them in time."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

import httpx

from serving.benchmarks.rollback_platform import MODEL, Platform


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as a client saw it; times are wall clock (time.time()), as the servers' are."""

    client: int
    gateway: int
    pin: str | None
    sent_at: float
    status: int
    version: str | None  # X-Served-Version, or the version named by a 503 "no ready replica"
    tpot_s: float | None


class Traffic:
    """Client threads, each sending its next request when the last one ends (and no sooner than
    `min_interval_s` after the last one began), keeping every outcome as a Sample."""

    def __init__(
        self,
        platform: Platform,
        key: str,
        *,
        clients: Sequence[tuple[int, str | None]],  # (gateway, pinned version or None) per client
        max_tokens: int = 1,
        min_interval_s: float = 0.0,
    ) -> None:
        self._platform = platform
        self._key = key
        self._clients = list(clients)
        self._max_tokens = max_tokens
        self._min_interval_s = min_interval_s
        self._samples: list[Sample] = []
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def __enter__(self) -> Traffic:
        for index, (gateway, pin) in enumerate(self._clients):
            thread = threading.Thread(target=self._run, args=(index, gateway, pin), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def samples(self, *, gateway: int | None = None, pinned: bool | None = None) -> list[Sample]:
        with self._changed:
            samples = list(self._samples)
        return [
            s
            for s in samples
            if (gateway is None or s.gateway == gateway) and (pinned is None or (s.pin is not None) == pinned)
        ]

    def wait_for(self, predicate: Callable[[Traffic], bool], timeout_s: float) -> None:
        """Until predicate(self) holds; re-checked as each request ends."""
        deadline = time.monotonic() + timeout_s
        with self._changed:  # an RLock: the predicate may read samples()
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"traffic condition not met within {timeout_s} s")
                self._changed.wait(left)

    def _run(self, index: int, gateway: int, pin: str | None) -> None:
        headers = {"Authorization": f"Bearer {self._key}"}
        if pin is not None:
            headers["X-Version-Pin"] = pin
        body = {"input": "A request arrives at the gateway", "max_tokens": self._max_tokens, "temperature": 0}
        url = f"{self._platform.urls[gateway]}/v1/models/{MODEL}/infer"
        with httpx.Client(timeout=60, headers=headers) as client:
            while not self._stopping.is_set():
                sent_at = time.time()
                try:
                    response = client.post(url, json=body)
                except httpx.HTTPError as exc:
                    self.errors.append(f"client {index}: {exc!r}")
                    time.sleep(0.1)
                    continue
                sample = Sample(
                    index, gateway, pin, sent_at, response.status_code, *_version_and_tpot(response)
                )
                with self._changed:
                    self._samples.append(sample)
                    self._changed.notify_all()
                if response.status_code == 429:
                    time.sleep(0.05)
                wait_s = self._min_interval_s - (time.time() - sent_at)
                if wait_s > 0:
                    self._stopping.wait(wait_s)  # pacing, not synchronization


def _version_and_tpot(response: httpx.Response) -> tuple[str | None, float | None]:
    if response.status_code == 200:
        body = response.json()
        timings, usage = body.get("timings") or {}, body.get("usage") or {}
        tokens = usage.get("completion_tokens") or 0
        tpot_s = None
        if timings.get("ttft_s") is not None and tokens > 1:
            tpot_s = (timings["total_s"] - timings["ttft_s"]) / (tokens - 1)
        return response.headers.get("X-Served-Version"), tpot_s
    if response.status_code == 503:
        message = (response.json().get("error") or {}).get("message", "")
        if message.startswith("no ready replica for "):
            return message.rpartition(":")[2], None
    return None, None


@dataclass(frozen=True, slots=True)
class Obedience:
    """Where one gateway's requests went around a routing change at `since`."""

    lag_s: float  # the last request routed to the canary was sent this long after `since` (0: before)
    num_canary_before: int  # requests routed to the canary in the 2 s before `since`
    num_after_limit: int  # requests sent more than `limit_s` after `since` (none went to the canary)
    num_canary_after_limit: int


def obedience(samples: Sequence[Sample], *, since: float, canary: str, limit_s: float = 1.0) -> Obedience:
    routed = [s.sent_at for s in samples if s.version == canary]
    after = [s for s in samples if s.sent_at > since + limit_s]
    return Obedience(
        lag_s=max(0.0, max(routed, default=since) - since),
        num_canary_before=sum(1 for t in routed if since - 2.0 <= t <= since),
        num_after_limit=len(after),
        num_canary_after_limit=sum(1 for s in after if s.version == canary),
    )


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def parse_time(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None
