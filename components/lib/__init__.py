"""Kubernetes-facing library of the pipeline components.

- ``cluster``: the one thin module every cluster call goes through (``Cluster``).
- ``pytorchjob``: build, validate and run the trainer's PyTorchJob (also the Katib trial's).
- ``serving``: build, deploy and smoke-test the KServe InferenceService; local generation check.
- ``servability``: can vLLM serve this adapter?

Nothing heavy is imported here: import the submodule you need.
"""
