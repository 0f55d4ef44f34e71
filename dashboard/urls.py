from django.urls import path

from dashboard import views

app_name = "dashboard"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("models/<str:model>/", views.model_detail, name="model"),
    path("models/<str:model>/rollout/", views.model_rollout, name="model-rollout"),
    path("rollouts/", views.rollouts, name="rollouts"),
    path("deployments/<int:deployment_id>/", views.deployment_detail, name="deployment"),
    path("deployments/<int:deployment_id>/rollback", views.deployment_rollback, name="deployment-rollback"),
    path("deployments/<int:deployment_id>/promote", views.deployment_promote, name="deployment-promote"),
    path("tenants/", views.tenants, name="tenants"),
    path("audit/", views.audit_log, name="audit"),
    path("tenants/<int:tenant_id>/api-keys", views.tenant_api_key_create, name="tenant-api-key-create"),
]
