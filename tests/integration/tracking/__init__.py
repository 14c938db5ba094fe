"""Tracking across processes: the MLflow writer process, spools to unreachable servers, compare and report."""
