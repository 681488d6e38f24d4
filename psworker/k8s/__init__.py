"""Kubernetes: manifests written from a spec (pure, `psworker.k8s.manifests`) and live commands (`.live`)."""
