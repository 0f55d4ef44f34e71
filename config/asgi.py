"""ASGI entry point: the Django app first (so models are loaded), then routing by protocol; the server
process's start and stop by the lifespan (uvicorn) or by Twisted's reactor (daphne)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from config import daphne_host  # noqa: E402
from config.access_log import access_logged  # noqa: E402
from config.body_limit import body_limited  # noqa: E402
from config.draining import refused_while_draining  # noqa: E402
from config.inference import inference_or  # noqa: E402
from config.lifespan import lifespan  # noqa: E402
from config.routing import websocket_urlpatterns  # noqa: E402

if settings.SERVE_STATIC:
    # The embedded server has no web server in front of it; production serves collected static files.
    # Paths that leave the static root are a 404, not SuspiciousFileOperation's 500 (config/unrouted.py).
    from config.unrouted import ContainedStaticFilesHandler

    django_asgi_app = ContainedStaticFilesHandler(django_asgi_app)

http_app = refused_while_draining(body_limited(inference_or(django_asgi_app), settings.MAX_REQUEST_BYTES))
websocket_app = refused_while_draining(URLRouter(websocket_urlpatterns))
if settings.ACCESS_LOG:  # a line per request, and per WebSocket (config/access_log.py)
    http_app, websocket_app = access_logged(http_app), access_logged(websocket_app)

application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": websocket_app,
        "lifespan": lifespan,  # uvicorn's start and stop (config/server_process.py)
    }
)

# daphne has no lifespan: its reactor starts and stops the same process (config/daphne_host.py).
if (reactor := daphne_host.twisted_reactor()) is not None:
    daphne_host.attach(reactor)
