"""Issue 34.4: a redeploy needs no spare GPU. Replacing the InferenceService's storageUri rolls its
Deployment; KServe's default is RollingUpdate with 25% surge (v0.20.0 pkg/controller/v1beta1/
inferenceservice/reconcilers/deployment/deployment_reconciler.go 340-350), one surge pod for a one-GPU
predictor, Pending without a free GPU: the deploy step waited serving_timeout_s (1,800 s) and failed.
The predictor now carries ``deploymentStrategy: {type: Recreate}``, which KServe copies onto the
Deployment in RawDeployment mode (deployment_reconciler.go 162-164; the field's doc,
pkg/apis/serving/v1beta1/component.go 129-131: "Only applicable for raw deployment mode")."""

from __future__ import annotations

import pytest
import yaml

from llmft.components.lib.serving.deployment import DeployRequest, inference_service_body, write_manifest
from llmft.trainer.errors import ConfigError


def _request(**change) -> DeployRequest:
    fields = dict(adapter_dir="/data/models/m/run-1", base_model="org/base", adapter_name="m", version="2",
                  deploy=True, mode="kserve", name="m-serve", namespace="team-a", gpus=1, max_lora_rank=16,
                  pvc_name="llmft-data", data_root="/data")  # fmt: skip
    return DeployRequest(**{**fields, **change})


def test_the_manifest_replaces_the_predictor_pod_instead_of_surging(tmp_path, crd_dir):
    path = tmp_path / "isvc.yaml"
    result = write_manifest(inference_service_body(_request()), path, crd_dir=str(crd_dir))
    assert result["schema_validated"]  # the field is in KServe's CRD (predictor.deploymentStrategy)
    manifest = yaml.safe_load(path.read_text())
    assert manifest["spec"]["predictor"]["deploymentStrategy"] == {"type": "Recreate"}


def test_a_rolling_update_can_be_asked_for_and_anything_else_is_refused():
    body = inference_service_body(_request(rollout="RollingUpdate"))
    assert body["spec"]["predictor"]["deploymentStrategy"] == {"type": "RollingUpdate"}
    with pytest.raises(ConfigError, match="rollout 'Surge': use one of Recreate, RollingUpdate"):
        inference_service_body(_request(rollout="Surge"))
