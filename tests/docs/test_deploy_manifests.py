"""deploy/: every manifest a cluster admin applies is valid and says what the code needs.

Core kinds are checked with kubernetes-validate (strict: unknown fields fail);
the kustomization is rendered both by kustomize_lite and, where installed, by
`kubectl kustomize`, and the two must agree.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kustomize_lite import read_env_file, render

K8S_VERSION = "1.30"
CORE_KINDS = {
    "Namespace",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ClusterRole",
    "ClusterRoleBinding",
    "PersistentVolumeClaim",
    "Job",
    "CronJob",
    "Secret",
    "ConfigMap",
    "Deployment",
    "Service",
}
NAMESPACE_LABEL = ("katib.kubeflow.org/metrics-collector-injection", "enabled")

# (apiGroup, resource) -> verbs the project's cluster code needs (llmft/components/lib/*, llmft/katib/).
REQUIRED_RULES = {
    ("kubeflow.org", "pytorchjobs"): {"create", "get", "list", "watch", "delete"},
    ("kubeflow.org", "experiments"): {"create", "get", "list", "watch", "delete"},
    ("kubeflow.org", "trials"): {"get", "list", "watch"},
    ("kubeflow.org", "suggestions"): {"get", "list"},
    ("serving.kserve.io", "inferenceservices"): {"create", "get", "list", "watch", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/log"): {"get"},
    ("", "events"): {"get", "list", "watch"},
}


# Shapes of real credentials; none may appear anywhere under deploy/.
REAL_LOOKING = [
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),  # Hugging Face token
    re.compile(r"\b[ps]k-lf-[0-9a-f-]{8,}"),  # Langfuse keys
    re.compile(r"\b(?:sk|dapi|ghp|xox[bp])[-_][A-Za-z0-9]{16,}"),  # OpenAI/Databricks/GitHub/Slack style
    re.compile(r"\b[A-Za-z0-9+/]{40,}={0,2}"),  # long base64 blobs
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
]


def manifest_files(deploy_dir: Path) -> list[Path]:
    return sorted(p for p in deploy_dir.rglob("*.yaml") if p.name != "kustomization.yaml")


def load_objects(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_objects(deploy_dir: Path) -> list[tuple[Path, dict]]:
    return [(path, obj) for path in manifest_files(deploy_dir) for obj in load_objects(path)]


def test_deploy_has_the_manifests_the_cluster_guide_names(deploy_dir):
    names = {p.relative_to(deploy_dir).as_posix() for p in manifest_files(deploy_dir)}
    for expected in [
        "namespace.yaml",
        "role.yaml",
        "rolebinding.yaml",
        "cluster-role.yaml",
        "pvc-data.yaml",
        "volume-permissions.yaml",
        "janitor.yaml",
        "secrets/llmft-hf-token.yaml",
        "secrets/llmft-mlflow.yaml",
        "secrets/llmft-langfuse.yaml",
        "secrets/llmft-s3.yaml",
    ]:
        assert expected in names, f"deploy/{expected} is missing"


def test_every_core_object_validates_strictly(deploy_dir):
    checked = 0
    for path, obj in all_objects(deploy_dir):
        assert obj.get("apiVersion") and obj.get("kind"), f"{path}: object without apiVersion/kind"
        assert obj["kind"] in CORE_KINDS, f"{path}: unexpected kind {obj['kind']} (extend CORE_KINDS and the docs)"
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 7


def test_validator_rejects_a_broken_manifest(deploy_dir):
    """Negative control: the same validator fails on a mistyped field."""
    pvc = load_objects(deploy_dir / "pvc-data.yaml")[0]
    pvc["spec"]["accessModes"] = "ReadWriteMany"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pvc, K8S_VERSION, strict=True)


def test_every_manifest_outside_secrets_is_in_the_kustomization(deploy_dir):
    kustomization = yaml.safe_load((deploy_dir / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    for resource in listed:
        assert (deploy_dir / resource).is_file(), f"kustomization lists missing file {resource}"
    on_disk = {p.relative_to(deploy_dir).as_posix() for p in manifest_files(deploy_dir) if p.parent == deploy_dir}
    assert on_disk == listed, f"not applied by `kubectl apply -k deploy/`: {sorted(on_disk - listed)}"


@pytest.fixture(scope="module")
def rendered(deploy_dir) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in render(deploy_dir)}


def test_rendered_objects_take_params_and_namespace(deploy_dir, rendered):
    params = read_env_file(deploy_dir / "params.env")
    namespace = yaml.safe_load((deploy_dir / "kustomization.yaml").read_text())["namespace"]
    expected = {"Namespace", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "PersistentVolumeClaim", "Job"}
    expected.add("CronJob")
    assert set(rendered) == expected, "ConfigMap must stay local"
    pvc = rendered["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == params["PVC_NAME"]
    assert pvc["spec"]["storageClassName"] == params["STORAGE_CLASS"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == params["PVC_SIZE"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    subject = rendered["RoleBinding"]["subjects"][0]
    assert (subject["kind"], subject["name"], subject["namespace"]) == (
        "ServiceAccount",
        params["PIPELINE_SERVICE_ACCOUNT"],
        namespace,
    )
    assert rendered["RoleBinding"]["roleRef"]["name"] == rendered["Role"]["metadata"]["name"]
    assert rendered["Namespace"]["metadata"]["name"] == namespace
    for kind in ("Role", "RoleBinding", "PersistentVolumeClaim"):
        assert rendered[kind]["metadata"]["namespace"] == namespace
    for obj in rendered.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("folder", [".", "tensorboard"])
def test_kubectl_kustomize_agrees_with_kustomize_lite(deploy_dir, folder):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; kustomize_lite rendering is checked above")
    out = subprocess.run([kubectl, "kustomize", str(deploy_dir / folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    by_kubectl = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(by_kubectl, key=key) == sorted(render(deploy_dir / folder), key=key)


def test_tensorboard_reads_the_data_pvc_with_the_trainer_image(deploy_dir):
    from llmft.components.images import IMAGE_REGISTRY, IMAGE_TAG

    objects = {o["kind"]: o for o in render(deploy_dir / "tensorboard")}
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"{IMAGE_REGISTRY}/llmft-trainer:{IMAGE_TAG}", (
        "keep in step with llmft/components/images.py"
    )
    assert container["command"] == ["tensorboard"] and any("/data/runs" in a for a in container["args"])
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == read_env_file(deploy_dir / "params.env")["PVC_NAME"]
    assert volume["persistentVolumeClaim"]["readOnly"] and container["volumeMounts"][0]["readOnly"]
    service = objects["Service"]
    assert service["spec"]["selector"] == objects["Deployment"]["spec"]["selector"]["matchLabels"]
    for obj in objects.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_cluster_role_lets_the_pipeline_read_cluster_training_runtimes_and_nothing_else(deploy_dir, rendered):
    """Kubeflow SDK 0.5 get_runtime reads the ClusterTrainingRuntime (cluster-scoped: no Role can grant it);
    upstream grants it only in kubeflow/trainer v2.3.0 manifests/overlays/kubeflow-platform/
    kubeflow-trainer-roles.yaml 83-108 (to system:authenticated)."""
    from llmft.components.lib.jobs.trainjob_runtime import CLUSTER_RBAC_FILE, RUNTIME_VERBS

    assert CLUSTER_RBAC_FILE == "deploy/cluster-role.yaml"
    role, binding = rendered["ClusterRole"], rendered["ClusterRoleBinding"]
    assert _granted(role) == {("trainer.kubeflow.org", "clustertrainingruntimes"): set(RUNTIME_VERBS)}
    assert "namespace" not in role["metadata"] and "namespace" not in binding["metadata"]
    params = read_env_file(deploy_dir / "params.env")
    namespace = yaml.safe_load((deploy_dir / "kustomization.yaml").read_text())["namespace"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "llmft-training-runtime-reader",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": params["PIPELINE_SERVICE_ACCOUNT"], "namespace": namespace}
    ]
    assert binding["metadata"]["name"] == f"llmft-training-runtime-reader-{namespace}", "one binding per namespace"


def test_the_permissions_job_gives_the_volume_root_to_the_images_uid_and_touches_nothing_else(deploy_dir, rendered):
    """Volume ownership (issue 29.4): no KFP task can chown (2.17.0 backend/src/v2/driver/k8s.go 749-785 drops
    every capability), so deploy/ does it once, as root with CHOWN and FOWNER only (Pod Security baseline)."""
    from llmft.components.images import IMAGE_REGISTRY, IMAGE_TAG, IMAGE_UID
    from llmft.components.lib.plan.volume_access import PERMISSIONS_FILE

    assert (deploy_dir.parent / PERMISSIONS_FILE).is_file()
    job = rendered["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"{IMAGE_REGISTRY}/llmft-pipeline:{IMAGE_TAG}", (
        "keep in step with llmft/components/images.py"
    )
    script = container["args"][0]
    assert f"chown {IMAGE_UID}:{IMAGE_UID} /data" in script and f'"{IMAGE_UID}:{IMAGE_UID}"' in script
    assert "-R" not in script and "*" not in script, "the root only: never what is below it"
    assert pod["securityContext"]["runAsUser"] == 0 and pod["restartPolicy"] == "Never"
    caps = container["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert job["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == read_env_file(deploy_dir / "params.env")["PVC_NAME"]
    assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": "/data"}]


def test_the_janitor_runs_the_pipeline_image_as_the_pipeline_account_every_period(deploy_dir, rendered):
    """Issue 42.2/42.3: the CronJob that deletes the jobs of ended runs (llmft/components/lib/jobs/orphans.py)
    runs `llmft pipeline janitor` on the period and keep window the code states, with the RBAC it needs."""
    from llmft.components.images import IMAGE_REGISTRY, IMAGE_TAG
    from llmft.components.lib.jobs.orphans import JANITOR_PERIOD_S, KEEP_FOR_RETRY_S

    cron = rendered["CronJob"]
    assert cron["spec"]["schedule"] == f"*/{JANITOR_PERIOD_S // 60} * * * *"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    template = cron["spec"]["jobTemplate"]["spec"]["template"]
    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"{IMAGE_REGISTRY}/llmft-pipeline:{IMAGE_TAG}", "keep in step with images.py"
    assert container["command"] == ["llmft", "pipeline", "janitor", "--keep-for-retry-s", str(KEEP_FOR_RETRY_S)]
    assert pod["serviceAccountName"] == read_env_file(deploy_dir / "params.env")["PIPELINE_SERVICE_ACCOUNT"]
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert pod["securityContext"]["runAsNonRoot"] is True
    granted = _granted(rendered["Role"])
    assert {"get", "list"} <= granted[("argoproj.io", "workflows")]
    for kind in (
        ("kubeflow.org", "pytorchjobs"),
        ("trainer.kubeflow.org", "trainjobs"),
        ("kubeflow.org", "experiments"),
    ):
        assert {"list", "delete"} <= granted[kind]
    assert {"list"} <= granted[("", "pods")]


def test_namespace_enables_katib_metrics_collection(rendered):
    key, value = NAMESPACE_LABEL
    assert rendered["Namespace"]["metadata"]["labels"].get(key) == value


def _granted(role: dict) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_role_grants_what_the_cluster_code_needs_and_no_more(rendered):
    granted = _granted(rendered["Role"])
    for (group, resource), verbs in REQUIRED_RULES.items():
        missing = verbs - granted.get((group, resource), set())
        assert not missing, f"Role lacks {sorted(missing)} on {group or 'core'}/{resource}"
    for (group, resource), verbs in granted.items():
        assert "*" not in verbs and resource != "*" and group != "*", f"wildcard in rule {group}/{resource}"
        assert resource not in {"secrets", "configmaps"}, "secrets reach pods as env; the Role must not read them"


def rbac_gaps(role: dict, cluster_role: dict, registered) -> list[str]:
    """What the Role (namespaced grants) and the ClusterRole (cluster-scoped ones) lack of the grants each
    training backend of ``registered`` needs (llmft/components/lib/jobs/backends.py ``Backend.grants``)."""
    granted = {False: _granted(role), True: _granted(cluster_role)}
    gaps = []
    for backend in registered:
        for grant in backend.grants():
            missing = set(grant.verbs) - granted[grant.cluster_scoped].get((grant.group, grant.resource), set())
            if missing:
                where = "deploy/cluster-role.yaml" if grant.cluster_scoped else "deploy/role.yaml"
                gaps.append(f"{backend.name}: {where} lacks {sorted(missing)} on {grant.group}/{grant.resource}")
    return gaps


def test_the_roles_grant_what_every_registered_training_backend_needs(rendered):
    """YAML cannot import the registry, so this test holds deploy/ and the registry together (issue 38.2)."""
    from llmft.components.lib.jobs.backends import BACKENDS

    assert len(BACKENDS) >= 3
    assert rbac_gaps(rendered["Role"], rendered["ClusterRole"], BACKENDS.values()) == []


def test_a_backend_whose_kind_the_role_does_not_grant_is_named(rendered):
    from llmft.components.lib.jobs.backends import Backend, Grant
    from llmft.katib.trial_kinds import JobResource

    ray = Backend(name="rayjob", resource=JobResource("ray.io", "v1", "rayjobs", "RayJob"))
    reader = Backend(name="reader", reads=(Grant("ray.io", "rayclusters", ("get",), cluster_scoped=True),))
    assert rbac_gaps(rendered["Role"], rendered["ClusterRole"], [ray, reader]) == [
        "rayjob: deploy/role.yaml lacks ['create', 'delete', 'get', 'list', 'patch', 'watch'] on ray.io/rayjobs",
        "reader: deploy/cluster-role.yaml lacks ['get'] on ray.io/rayclusters",
    ]


TASK_ONLY_SECRETS = {"s3": "llmft-s3"}
"""Secrets only the pipeline's own tasks mount (the s3 one: prepare), never a training job: template names."""


def code_secret_keys() -> dict[str, set[str]]:
    """Secret name -> keys, as the PyTorchJob builder (and so the pipeline) reads them, plus the Secrets only the
    pipeline's tasks mount, with the keys ``NAME`` alone mounts (llmft/components/lib/plan/checks.py SECRET_KINDS)."""
    from llmft.components.lib.contracts.pod_parts import DEFAULT_SECRET_ENVS
    from llmft.components.lib.plan.checks import SECRET_KINDS

    keys: dict[str, set[str]] = {}
    for item in DEFAULT_SECRET_ENVS:
        keys.setdefault(item.secret_name, set()).add(item.key)
    for kind, name in TASK_ONLY_SECRETS.items():
        keys[name] = set(SECRET_KINDS[kind][0])
    return keys


def secret_templates(deploy_dir: Path) -> dict[str, set[str]]:
    return {
        obj["metadata"]["name"]: set(obj["stringData"])
        for path in sorted((deploy_dir / "secrets").glob("*.yaml"))
        for obj in load_objects(path)
    }


def test_secret_templates_carry_the_keys_and_no_values(deploy_dir):
    found = {}
    for path in sorted((deploy_dir / "secrets").glob("*.yaml")):
        (secret,) = load_objects(path)
        assert secret["kind"] == "Secret" and secret["type"] == "Opaque", path
        assert "data" not in secret, f"{path}: templates use stringData with empty values, never data"
        name = secret["metadata"]["name"]
        assert all(value == "" for value in secret["stringData"].values()), f"{path}: a value is filled in"
        assert path.stem == name, f"{path}: file name should be the Secret's name {name}"
        found[name] = set(secret["stringData"])
    assert found == code_secret_keys(), "deploy/secrets/ and llmft/components/lib/ (pytorchjob_spec, checks) disagree"


@pytest.fixture(scope="module")
def compiled_pipeline(tmp_path_factory) -> list[dict]:
    """The HPO pipeline compiled with every Secret the templates hold (Secrets are mounted only when named)."""
    from llmft.pipelines.llm_finetune import compile_pipeline

    path = tmp_path_factory.mktemp("compiled") / "pipeline.yaml"
    mlflow = "llmft-mlflow:MLFLOW_TRACKING_URI,MLFLOW_TRACKING_USERNAME,MLFLOW_TRACKING_PASSWORD"
    secrets = {"hf_token_secret": "llmft-hf-token", "mlflow_secret": mlflow, "langfuse_secret": "llmft-langfuse"}
    secrets["s3_secret"] = "llmft-s3"
    compile_pipeline(str(path), hpo=True, defaults=secrets)
    return list(yaml.safe_load_all(path.read_text()))


@pytest.mark.slow
def test_every_secret_the_pipeline_reads_has_a_template(deploy_dir, compiled_pipeline):
    templates = secret_templates(deploy_dir)
    executors = compiled_pipeline[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    used = 0
    for name, executor in executors.items():
        for ref in executor.get("secretAsEnv", []):
            secret = ref["secretName"]
            assert secret in templates, f"{name} reads Secret {secret}, which deploy/secrets/ lacks"
            for pair in ref["keyToEnv"]:
                assert pair["secretKey"] in templates[secret], f"{name}: {secret} has no key {pair['secretKey']}"
                used += 1
    assert used >= 8


def test_pipeline_default_pvc_is_the_one_deploy_creates(deploy_dir, compiled_pipeline):
    params = read_env_file(deploy_dir / "params.env")
    default = compiled_pipeline[0]["root"]["inputDefinitions"]["parameters"]["volume_pvc_name"]["defaultValue"]
    assert default == params["PVC_NAME"]


def test_nothing_under_deploy_looks_like_a_real_credential(deploy_dir):
    for path in sorted(p for p in deploy_dir.rglob("*") if p.is_file()):
        text = path.read_text()
        for pattern in REAL_LOOKING:
            match = pattern.search(text)
            assert match is None, f"{path}: {match.group(0)[:12]}... looks like a real credential"


def test_credential_scanner_catches_a_planted_token():
    """Negative control for the scanner above."""
    planted = "HF_TOKEN: hf_" + "aB3dE6gH9jK2mN5pQ8sT1vW4"
    assert any(p.search(planted) for p in REAL_LOOKING)
