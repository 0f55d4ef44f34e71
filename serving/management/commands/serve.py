import asyncio
import logging

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.utils.module_loading import import_string

logger = logging.getLogger(__name__)


class Command(BaseCommand):
    help = (
        "Serve HTTP and WebSocket with daphne, with the data-plane runtime (and embedded replicas) started."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args: object, **options: object) -> None:
        from daphne.server import Server  # installs the asyncio reactor; must come before twisted imports

        from config.asgi import application
        from serving.runtime import get_runtime

        def on_ready() -> None:
            # daphne has no ASGI lifespan: start the runtime ourselves once the loop exists, so replicas
            # load before the first request instead of on it; and, without Redis (so without Celery
            # beat), the periodic tasks (rollout judge, metrics maintenance) on the same schedule.
            loop = asyncio.get_event_loop()
            self._runtime_start = loop.create_task(get_runtime())
            loop.call_soon(import_string(settings.EMBEDDED_SCHEDULER_STARTER))
            self.stdout.write(
                f"Switchyard listening on http://{options['host']}:{options['port']}/", ending="\n"
            )
            self.stdout.flush()

        Server(
            application=application,
            endpoints=[f"tcp:port={options['port']}:interface={options['host']}"],
            ready_callable=on_ready,
            verbosity=0,
        ).run()
