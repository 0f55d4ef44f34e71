import asyncio
import logging
from typing import Any

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from config.openmp import runtime_in_use
from config.server_process import SERVER_PROCESS
from serving.edge.http_limits import LimitedHttpToolsProtocol

logger = logging.getLogger(__name__)

# After the drain (settings.SHUTDOWN_DRAIN_S) and its final events: how long the rest of a stop waits for
# responses still open before it cancels them.
GRACEFUL_SHUTDOWN_S = 5
WS_FRAME_GUARD = 4
LISTEN_POLL_S = 0.05


class Command(BaseCommand):
    help = (
        "Serve HTTP and WebSocket (uvicorn, or daphne), with the data-plane runtime and embedded replicas "
        "started."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--server",
            choices=("uvicorn", "daphne"),
            default="uvicorn",
            help='uvicorn (the default: docs/architecture.md, "uvicorn over daphne") or daphne',
        )

    def handle(self, *args: object, **options: object) -> None:
        logger.info("OpenMP runtime: %s (config/openmp.py)", runtime_in_use())
        if options["server"] == "daphne":
            _serve_daphne(str(options["host"]), int(options["port"]), self.stdout)  # type: ignore[call-overload]
            return
        from config.asgi import application

        # uvicorn rather than daphne (docs/architecture.md, "uvicorn over daphne"): less of every request's
        # time to first token, about half the CPU per SSE event, and backpressure: its send() waits while a
        # client is not reading, which is what lets a stream see a slow reader's backlog and cut it off
        # (serving/transport/reply_hub.py) where daphne buffers for it without bound.
        config = uvicorn.Config(
            application,
            host=str(options["host"]),
            port=int(options["port"]),  # type: ignore[call-overload]
            loop="asyncio",
            # uvicorn's httptools protocol with the edge's limits on headers and read times
            # (serving/edge/http_limits.py), which also answers the JSON 503 past the connection cap;
            # uvicorn's own plain-text one, a connection later, never comes first.
            http=LimitedHttpToolsProtocol,
            limit_concurrency=settings.EDGE_MAX_CONNECTIONS + 1,
            ws="websockets-sansio",
            # Above the consumer's limit (MAX_REQUEST_BYTES), so that a message a little over it gets the
            # JSON error there before the close; a frame past this is not even buffered, and closes 1009.
            ws_max_size=WS_FRAME_GUARD * settings.MAX_REQUEST_BYTES,
            lifespan="on",  # config/asgi.py starts the runtime (and embedded replicas) on startup
            log_config=None,  # Django's LOGGING stays in charge
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        asyncio.run(_Server(config, self.stdout).serve())


class _Server(uvicorn.Server):  # type: ignore[misc]
    """uvicorn's server, which says where it listens once it does, and stops by draining: SIGTERM stops
    new connections and new requests on kept-alive ones, lets the streams in flight (SSE and WebSocket)
    run on for up to SHUTDOWN_DRAIN_S, then ends those still open with a final error event
    (server_shutting_down) before it closes the connections (docs/reliability.md, "Shutdown").
    uvicorn's own shutdown closed every WebSocket at once (1012) and cut SSE bodies mid-stream once its
    graceful timeout ran out."""

    def __init__(self, config: uvicorn.Config, stdout: Any) -> None:
        super().__init__(config)
        self._stdout = stdout

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._stdout.write(f"Switchyard listening on http://{self.config.host}:{self.config.port}/")
            self._stdout.flush()

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:
            server.close()  # no new connections
        for connection in list(self.server_state.connections):
            if isinstance(connection, HttpToolsProtocol):
                connection.shutdown()  # idle: closed; mid-response: closed once it is sent
        await SERVER_PROCESS.drain(is_forced=lambda: bool(self.force_exit))
        await super().shutdown(sockets=sockets)  # then the lifespan's stop: SERVER_PROCESS.stop()


def _serve_daphne(host: str, port: int, stdout: Any) -> None:
    """daphne, as `daphne config.asgi:application` runs it: the process starts and stops from Twisted's
    reactor (config/daphne_host.py), not a lifespan. The edge's header limits and the slow-reader
    cut-off are uvicorn's alone (docs/architecture.md, "uvicorn over daphne")."""
    # Deferred, and in this order: daphne's server installs Twisted's asyncio reactor at import, which
    # must come before the application finds it (and before anything imports another reactor).
    from daphne.server import Server
    from twisted.internet import reactor

    from config.asgi import application

    server = Server(application, endpoints=[f"tcp:port={port}:interface={host}"], signal_handlers=False)

    def announce() -> None:
        if not server.listening_addresses:
            reactor.callLater(LISTEN_POLL_S, announce)
            return
        stdout.write(f"Switchyard listening on http://{host}:{port}/ (daphne)")
        stdout.flush()

    reactor.callWhenRunning(announce)
    server.run()
