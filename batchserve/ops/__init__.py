"""Operational routes: health, readiness, metrics and the model list."""
