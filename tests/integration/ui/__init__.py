"""The MLflow UI in a real browser."""
