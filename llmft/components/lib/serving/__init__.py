"""Serving the adapter: servability, serving form, the InferenceService, a real local vLLM."""
