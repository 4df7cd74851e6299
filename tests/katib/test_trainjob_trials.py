"""Katib trials on TrainJob (Kubeflow Trainer v2): the shipped template is the builder's output, passes
Katib's rules with Katib 0.19's TrainJob conditions, and - once Katib has filled the placeholders and
the Trainer has merged it onto torch-distributed - its primary pod labels select exactly node 0."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from katib_helpers import BEST, FakeKatibApi, katib_status, sweep_plan

from llmft.commands.sweep import TEMPLATE_ARGS, build_from_settings
from llmft.components import images
from llmft.components.lib.cluster import Cluster
from llmft.components.lib.jobs import katib_sweep as sweep_lib
from llmft.components.lib.jobs.trainjob_spec import trainjob_admission_errors
from llmft.katib.experiment import experiment_dict, override_bindings, parse_experiment
from llmft.katib.experiment_yaml import load_yaml
from llmft.katib.trial_kinds import TRAINJOB
from llmft.katib.webhook_rules import validate_experiment

TEMPLATE = Path(__file__).resolve().parents[2] / "katib" / "experiment_template_trainjob.yaml"
DEFAULT_IMAGE = f"{images.IMAGE_REGISTRY}/llmft-trainer:{images.IMAGE_TAG}"
SETTINGS = (*TEMPLATE_ARGS, "training_backend=trainjob")


@pytest.fixture(scope="module")
def built() -> dict:
    return experiment_dict(build_from_settings([*SETTINGS, f"image={DEFAULT_IMAGE}"]))


def test_template_equals_builder_output(built):
    assert yaml.safe_load(TEMPLATE.read_text()) == built, (
        "katib/experiment_template_trainjob.yaml is stale: regenerate with `llmft sweep create --dry-run "
        "--output ... training_backend=trainjob` and the TEMPLATE_ARGS, and carry its comments over"
    )


def test_template_parses_and_passes_katib_rules_with_trainjob_conditions():
    body = load_yaml(TEMPLATE)
    template = parse_experiment(body).spec.trial_template
    assert template.primary_container_name == "node"
    assert template.success_condition == 'status.conditions.#(type=="Complete")#|#(status=="True")#'
    assert template.failure_condition == 'status.conditions.#(type=="Failed")#|#(status=="True")#'
    assert template.primary_pod_labels == {
        "jobset.sigs.k8s.io/replicatedjob-name": "node",
        "batch.kubernetes.io/job-completion-index": "0",
    }
    assert validate_experiment(body) == []


def test_llmft_sweep_best_reads_the_bindings_of_a_trainjob_experiment(built):
    assert override_bindings(built) == {
        "learning_rate": "optim.lr",
        "lora_r": "lora.r",
        "lora_alpha": "lora.alpha",
        "lora_dropout": "lora.dropout",
        "warmup_ratio": "schedule.warmup_ratio",
    }


@pytest.mark.parametrize(
    ("edit", "path", "words"),
    [
        (lambda t: t.update(successCondition=t["successCondition"].replace("Complete", "Succeeded")),
         "spec.trialTemplate.successCondition", "Complete/Failed"),
        (lambda t: t.update(primaryContainerName="pytorch"), "spec.trialTemplate.primaryContainerName", "'node'"),
        (lambda t: t.update(primaryPodLabels={"training.kubeflow.org/job-role": "master"}),
         "spec.trialTemplate.primaryPodLabels", "node 0 only"),
        (lambda t: t["trialSpec"]["spec"].pop("runtimeRef"), "spec.trialTemplate.trialSpec.spec.runtimeRef.name",
         "required"),
        (lambda t: t["trialSpec"]["spec"]["trainer"].pop("command") and t["trialSpec"]["spec"]["trainer"].pop("args"),
         "spec.trialTemplate.trialSpec.spec.trainer", "no command"),
    ],
)  # fmt: skip
def test_webhook_rules_name_what_a_trainjob_trial_gets_wrong(built, edit, path, words):
    body = copy.deepcopy(built)
    edit(body["spec"]["trialTemplate"])
    problems = [v for v in validate_experiment(body) if v.path == path]
    assert problems and words in problems[0].message, validate_experiment(body)


def _as_katib_creates_it(body: dict, trial_name: str) -> dict:
    """The trial's TrainJob as Katib's trial controller creates it: placeholders replaced by the trial's
    assignments (``${trialParameters.x}``) and metadata (``${trialSpec.Name}``), name and namespace set."""
    template = body["spec"]["trialTemplate"]
    values = {"learning_rate": "0.0003", "lora_r": "16", "lora_alpha": "32", "lora_dropout": "0.05"}
    values |= {"warmup_ratio": "0.03", "trial_name": trial_name}
    text = re.sub(r"\$\{trialParameters\.([^}]+)\}", lambda m: values[m.group(1)], json.dumps(template["trialSpec"]))
    job = json.loads(text)
    job["metadata"].update(name=trial_name, namespace="team-a")
    return job


def _simulator():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))
    import trainer_v2_sim

    return trainer_v2_sim


def test_a_trial_as_katib_creates_it_is_a_valid_trainjob_whose_node_zero_katib_watches(built, crd_dir):
    import kubernetes_validate

    sim = _simulator()
    trial = f"{built['metadata']['name']}-x7k2m9qz"  # Katib names trials <experiment>-<8 random characters>
    job = _as_katib_creates_it(built, trial)
    crd = yaml.safe_load((crd_dir / "trainer.kubeflow.org_trainjobs.yaml").read_text())
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    assert list(jsonschema.Draft7Validator(schema).iter_errors(job)) == []
    assert trainjob_admission_errors(job) == []
    jobset = sim.build_jobset(sim.load_runtime(crd_dir, "torch_distributed"), job)
    pods = sim.node_pods(jobset, trial, "team-a")
    watched = [
        p for p in pods if all(p["metadata"]["labels"].get(k) == v for k, v in TRAINJOB.primary_pod_labels.items())
    ]
    assert [p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] for p in watched] == ["0"]
    node = watched[0]["spec"]["containers"][0]
    assert node["name"] == TRAINJOB.primary_container_name and node["command"] == ["sh", "-c"]
    assert f"output_dir=/data/sweeps/llmft-sweep/{trial}" in node["args"][0] and "lora.r=16" in node["args"][0]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": watched[0]["metadata"], "spec": watched[0]["spec"]}
    kubernetes_validate.validate(pod, "1.30.0", strict=True)


def test_the_hpo_step_runs_trainjob_trials_for_training_backend_trainjob(tmp_path):
    api = FakeKatibApi([katib_status("Succeeded", best=BEST, reason="ExperimentMaxTrialsReached")])
    plan = sweep_plan(training_backend="trainjob", training_workers=2, training_gpus_per_worker=8)
    sweep_lib.run_sweep_step(
        plan, tokenized_dir="/data/tokenized/abc123", output_dir=str(tmp_path), poll_s=0.001,
        cluster=Cluster("team-a", custom_api=api, core_api=object()),
    )  # fmt: skip
    _, created = api.created[0]
    trial = created["spec"]["trialTemplate"]["trialSpec"]
    assert (trial["apiVersion"], trial["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert trial["spec"]["trainer"]["numNodes"] == 2 and trial["spec"]["trainer"]["numProcPerNode"] == 8
    assert "data=/data/tokenized/abc123" in trial["spec"]["trainer"]["args"][0]
    assert created["spec"]["trialTemplate"]["primaryContainerName"] == "node"


def _owned(obj: dict, owner: dict) -> dict:
    reference = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
                 "uid": f"uid-{owner['metadata']['name']}", "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    obj.setdefault("metadata", {})["ownerReferences"] = [reference]
    return obj


def test_katibs_webhook_walks_from_a_trainjob_trials_pods_to_the_trial_and_injects_node_zero(built, crd_dir):
    """Issue 29.7: Katib v0.19.0 injects its metrics collector into a pod when the owner chain leads to a
    Trial (pkg/webhook/v1beta1/pod/inject_webhook.go 110-129, 255-300): Pod -> Job (the Job controller
    owns its pods) -> JobSet (the JobSet controller owns its Jobs) -> TrainJob (trainer v2.3.0
    pkg/runtime/framework/plugins/jobset/jobset.go 427-433) -> Trial (katib
    pkg/controller.v1beta1/trial/trial_controller.go 332), and the trial's job carries the trial's name.
    Katib's controller may read JobSets and TrainJobs (its manifests/v1beta1/components/controller/rbac.yaml
    93-110). Only the primary pod (primaryPodLabels: node 0) gets the collector, and it has the primary
    container; with a link of the chain unreadable nothing is injected."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))
    from cluster_sim import katib_mutates

    sim = _simulator()
    name = f"{built['metadata']['name']}-x7k2m9qz"
    template = built["spec"]["trialTemplate"]
    trial = {"apiVersion": "kubeflow.org/v1beta1", "kind": "Trial", "metadata": {"name": name},
             "spec": {k: template[k] for k in ("primaryPodLabels", "primaryContainerName")}}  # fmt: skip
    trainjob = _owned(_as_katib_creates_it(built, name), trial)
    jobset_spec = sim.build_jobset(sim.load_runtime(crd_dir, "torch_distributed"), trainjob)
    jobset = _owned({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name}}, trainjob)
    job = _owned({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-node-0"}}, jobset)
    pods = [_owned(p, job) for p in sim.node_pods(jobset_spec, name, "team-a")]
    objects = {(o["apiVersion"], o["kind"], o["metadata"]["name"]): o for o in (trial, trainjob, jobset, job)}

    def get(api_version: str, kind: str, obj_name: str):
        return objects.get((api_version, kind, obj_name))

    index = "batch.kubernetes.io/job-completion-index"
    done = {p["metadata"]["labels"][index]: katib_mutates(p, get, {name: trial}) for p in pods}
    assert done["0"] == "collector" and all(v == "labels" for k, v in done.items() if k != "0"), done
    del objects[("jobset.x-k8s.io/v1alpha2", "JobSet", name)]  # e.g. no RBAC on jobsets: the walk stops
    assert katib_mutates(pods[0], get, {name: trial}) == "none"
