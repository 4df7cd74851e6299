"""Promotion of the best checkpoint and the MLflow Model Registry."""
