from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"
    verbose_name = "Serving (data plane)"

    def ready(self) -> None:
        # The composition root registers this process's data plane with the gateway when it is imported
        # (serving/gateway/data_plane.py). Imported here, once the apps are loaded, as Django asks of
        # anything that reads models at import; not at this module's top.
        from serving import runtime  # noqa: F401
