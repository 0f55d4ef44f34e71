"""Checks of what runs the platform beyond one process: the Kubernetes manifests."""
