from django.urls import path

from registry import api

urlpatterns = [
    path("models", api.ModelListView.as_view(), name="model-list"),
    path("models/<str:model>", api.ModelDetailView.as_view(), name="model-detail"),
    path("models/<str:model>/versions", api.ModelVersionListView.as_view(), name="model-versions"),
]
