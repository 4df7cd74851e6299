"""Katib hyperparameter sweeps of the training step (a leaf package: of ours it imports only the
trainer's error root, its one ``key=value`` grammar (``llmft.trainer.config_load``), the searched fields' declared
ranges (``llmft.trainer.config``, the default search space) and the MLflow
parent-run variable name (``llmft.trainer.mlflow_settings``)).

- ``experiment``: ``SweepSpec`` and ``build_experiment(spec, trial_job_dict)`` -> ``V1beta1Experiment``
  (kubeflow-katib-api models, imported only where one is built or parsed); ``trial_overrides``,
  ``override_bindings``, ``parse_experiment``.
- ``experiment_yaml``: ``to_yaml``/``load_yaml`` (kubectl-ready YAML, read back strictly).
- ``search_space``: the searched hyperparameters, keyed by the trainer's dotted config names.
- ``webhook_rules``: Katib's admission rules (``validate_experiment``, ``check_experiment``).
- ``metrics``: the StdOut collector's filter and the same parse in Python: the one parser of the
  trainer's ``eval_loss=`` lines (the local sweep and the local training backend use it too).
- ``status``: Experiment status -> phase, counts and best ``key=value`` lines; submit / wait
  against any client with ``create_custom_object`` / ``get_custom_object``.
- ``local_sweep``: the same search space with Optuna, the real trainer as subprocesses.

Nothing heavy is imported here: import the submodule you need.
"""
