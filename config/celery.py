"""The Celery app: settings under the CELERY_ namespace, tasks discovered in the apps.

Production runs `celery -A config worker` and `celery -A config beat` on Redis. The embedded default
runs the same task functions on the same schedule from the server process (see platform/README.md)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("switchyard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
