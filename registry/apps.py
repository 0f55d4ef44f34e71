from django.apps import AppConfig
from django.contrib.auth.signals import user_login_failed


class RegistryConfig(AppConfig):
    name = "registry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: the models it reads need the app registry ready.
        from registry.login_throttle import record_failed_login

        user_login_failed.connect(record_failed_login, dispatch_uid="registry.login_throttle")
