# The Celery app loads with Django, so that shared tasks bind to it (not to Celery's default app).
from config.celery import app as celery_app

__all__ = ("celery_app",)
