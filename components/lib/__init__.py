"""The logic of the pipeline components (each component in components/ is a thin wrapper).

- ``plan``, ``plan_checks``: the run plan (``RunPlan``, plan.json) the first step builds from the
  pipeline parameters, its checks and the Secret preflight; ``DataLayout`` of the volume.
- ``local_train``, ``train_job``: the train step's backends (``llmft train`` here; the PyTorchJob).
- ``tokenized``, ``evaluation``, ``promote``, ``registry``, ``deployment``: tokenize, evaluate,
  promote, register in MLflow, deploy.
- ``sweep``: the HPO pipeline's sweep step (katib/ composed with the job builder).
- ``cluster``: the one thin module every cluster call goes through (``Cluster``).
- ``pytorchjob``: build, validate and run the trainer's PyTorchJob (also the Katib trial's).
- ``serving``: build, deploy and smoke-test the KServe InferenceService; local generation check.
- ``servability``: can vLLM serve this adapter?
- ``summary``: the one-screen summary of ``llmft pipeline run-local``.

Nothing heavy is imported here: import the submodule you need.
"""
