"""Observability artefacts generated from code: the Grafana dashboard."""
