from django.urls import path

from registry import api, tenant_api

urlpatterns = [
    path("models", api.ModelListView.as_view(), name="model-list"),
    path("models/<str:model>", api.ModelDetailView.as_view(), name="model-detail"),
    path("models/<str:model>/versions", api.ModelVersionListView.as_view(), name="model-versions"),
    path("tenants", tenant_api.TenantListView.as_view(), name="tenant-list"),
    path("tenants/<str:tenant>/quota", tenant_api.QuotaView.as_view(), name="tenant-quota"),
    path("tenants/<str:tenant>/api-keys", tenant_api.ApiKeyListView.as_view(), name="tenant-api-keys"),
    path(
        "tenants/<str:tenant>/api-keys/<str:prefix>/revoke",
        tenant_api.ApiKeyRevokeView.as_view(),
        name="tenant-api-key-revoke",
    ),
]
