from django.urls import path

from serving import api

urlpatterns = [
    path("models/<str:model>/infer", api.infer, name="infer"),
]
