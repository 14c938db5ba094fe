"""Integration tests: whole federations, subprocesses, real servers, Ray and the MLflow UI in a browser."""
