import asyncio
from typing import Any

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from serving.edge.http_limits import LimitedHttpToolsProtocol

# How long a stop (SIGTERM, Ctrl-C) waits for responses in flight before it closes their connections.
GRACEFUL_SHUTDOWN_S = 8
WS_FRAME_GUARD = 4


class Command(BaseCommand):
    help = "Serve HTTP and WebSocket (uvicorn), with the data-plane runtime and embedded replicas started."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args: object, **options: object) -> None:
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
            # (serving/edge/http_limits.py); limit_concurrency answers 503 past the connection cap.
            http=LimitedHttpToolsProtocol,
            limit_concurrency=settings.EDGE_MAX_CONNECTIONS,
            ws="websockets-sansio",
            # Above the consumer's limit (MAX_REQUEST_BYTES), so that a message a little over it gets the
            # JSON error there before the close; a frame past this is not even buffered, and closes 1009.
            ws_max_size=WS_FRAME_GUARD * settings.MAX_REQUEST_BYTES,
            lifespan="on",  # config/asgi.py starts the runtime (and embedded replicas) on startup
            log_config=None,  # Django's LOGGING stays in charge
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        asyncio.run(_AnnouncingServer(config, self.stdout).serve())


class _AnnouncingServer(uvicorn.Server):  # type: ignore[misc]
    def __init__(self, config: uvicorn.Config, stdout: Any) -> None:
        super().__init__(config)
        self._stdout = stdout

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._stdout.write(f"Switchyard listening on http://{self.config.host}:{self.config.port}/")
            self._stdout.flush()
