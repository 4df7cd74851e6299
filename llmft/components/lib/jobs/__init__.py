"""Training backends on a cluster (PyTorchJob, TrainJob) and locally, their specs, launchers, sweep, cleanup."""
