"""The server process's start and stop under daphne, which has no ASGI lifespan (docs/architecture.md,
"One start path for uvicorn and daphne"). Importing daphne's server installs Twisted's asyncio reactor
before the application is imported (`daphne config.asgi:application` and `manage.py serve --server
daphne` alike); when config/asgi.py finds that reactor it calls attach(), which has the reactor:

- start the process (config/server_process.py) on its loop as soon as it runs, so embedded replicas load
  and the periodic loops tick before any request;
- on SIGTERM or SIGINT, stop listening, drain the streams in flight as uvicorn's stop does (refusing new
  requests meanwhile: config/draining.py), stop the runtime, and only then stop the reactor, whose own
  shutdown cancels what is left. A second signal cuts the drain short.

Twisted's own handlers would stop the reactor at once, cancelling every stream mid-body and leaving the
replicas' threads running, so the process hung until SIGKILL: these replace them once the reactor runs."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

from config.server_process import SERVER_PROCESS

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def twisted_reactor() -> Any:
    """Twisted's asyncio reactor, if daphne installed one in this process; None under any other server
    (importing the reactor here would install one of its own)."""
    reactor = sys.modules.get("twisted.internet.reactor")
    asyncio_reactor = sys.modules.get("twisted.internet.asyncioreactor")
    if reactor is None or asyncio_reactor is None:
        return None
    return reactor if isinstance(reactor, asyncio_reactor.AsyncioSelectorReactor) else None


def attach(reactor: Any) -> None:
    reactor.callWhenRunning(_on_running, reactor)


def _on_running(reactor: Any) -> None:
    # The "startup" event fires before the reactor's loop runs: the start itself goes on the loop.
    loop: asyncio.AbstractEventLoop = reactor._asyncioEventloop
    loop.call_soon(_start, reactor, loop)


def _start(reactor: Any, loop: asyncio.AbstractEventLoop) -> None:
    SERVER_PROCESS.start()
    stopping: list[asyncio.Task[None]] = []
    forced = [False]

    def on_signal() -> None:
        if stopping:  # a second signal: cut the drain short
            forced[0] = True
            return
        stopping.append(loop.create_task(_stop(reactor, lambda: forced[0]), name="daphne-stop"))

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal)


async def _stop(reactor: Any, is_forced: Any) -> None:
    # Deferred: Twisted's TCP module is only wanted where daphne runs, and it is loaded by then.
    from twisted.internet.tcp import Port

    for reader in list(reactor.getReaders()):
        if isinstance(reader, Port):
            reader.stopListening()  # no new connections
    try:
        await SERVER_PROCESS.drain(is_forced=is_forced)
        await SERVER_PROCESS.stop()
    except Exception:
        logger.exception("stopping the server process failed")
    reactor.stop()
