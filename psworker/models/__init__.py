"""Registered workloads (`registry`) and what a model is to the trainer (`base`)."""

from __future__ import annotations

from psworker.models.base import InputSpec, Model
from psworker.models.registry import get, names, register

__all__ = ["InputSpec", "Model", "register", "get", "names"]
