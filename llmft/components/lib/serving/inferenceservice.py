"""Serve the adapter: a KServe InferenceService on the Hugging Face runtime with vLLM.

The predictor runs the Hugging Face serving runtime with ``--backend=vllm`` (on the
fallback HF backend unknown flags are silently ignored, so the backend is always
named), LoRA enabled, and the adapter registered as a LoRA module::

    --enable-lora --max-lora-rank=64 --lora-modules <lora_name>=/mnt/models/<adapter>

Storage: ``storageUri: pvc://<pvc>/<root>`` mounts ``<root>`` of the PVC read-only at
/mnt/models. The base model comes either from the same PVC (``base_model_path``; the
root is then the deepest directory holding base and adapter, and ``--model_dir``
points at the base) or from the hub (``base_model_id``, ``--model_id``, with HF_TOKEN
from a Secret; the root is the adapter directory itself).

Clients request ``"model": "<lora_name>"`` on ``/openai/v1/completions`` to get the
adapter, and ``"model": "<lora_name>-base"`` (``--model_name``) for the base model. The two names
must differ: the huggingfaceserver registers every ``--lora-modules`` name as a model of the server
(kserve v0.20.0 ``python/huggingfaceserver/huggingfaceserver/__main__.py`` 332-336), and vLLM
resolves a request's name against the base names first (``OpenAIServing._maybe_get_adapter`` in
``vllm/entrypoints/openai/serving_engine.py``, as bundled with KServe 0.15/0.16) and LoRA names
first in later releases: with one shared name, either the adapter or the base is unreachable.
KServe lists the base name only: it registers the adapter's name onto the base model's object, and
``GET /openai/v1/models`` answers ``id = model.name`` for every registry entry (see :func:`smoke_test`).
The deploy step's :func:`smoke_test` checks the base is listed and that a completion asked of the
adapter's name differs from the base model's. KServe v0.15.0 registers no ``--lora-modules`` name at all
(kserve#4345, fixed in :data:`KSERVE_FIRST_LORA_NAMES`): the smoke test names that version when the
adapter's name is unknown to the server.

The merged form (``merged_model_path``: the adapter merged into its base by the serving-form step,
llmft/components/lib/serving/serving_form.py) is one plain model: ``storageUri`` is its directory on the PVC,
``--model_name=<lora_name> --model_dir=/mnt/models --backend=vllm`` and no LoRA flag (the
huggingfaceserver hands ``--model_dir`` to vLLM as the model and serves it under ``--model_name``:
kserve ``python/huggingfaceserver/huggingfaceserver/__main__.py`` ``load_model``). The label
``llmft/served-form`` names the form; :func:`inference_service_errors` refuses LoRA flags on a merged one.
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmft.components import images
from llmft.components.lib.contracts.pod_parts import GPU_TOLERATION, SecretEnv, Toleration
from llmft.components.lib.serving.deployment_mode import MODE_ANNOTATION
from llmft.katib.k8s_names import is_k8s_name
from llmft.trainer.errors import ConfigError

OPENAI_ROOT = "/openai/v1"
"""The OpenAI routes' root on KServe's Hugging Face runtime (/openai/v1/models, /completions, /chat/completions)."""
CHAT_ROUTE = OPENAI_ROOT + "/chat/completions"
"""The chat route a user calls (the deploy step's endpoint, the run summary's curl)."""

GROUP, VERSION, PLURAL, KIND = "serving.kserve.io", "v1beta1", "inferenceservices", "InferenceService"
MODEL_MOUNT = "/mnt/models"
"""Where KServe mounts the storageUri in the predictor container."""
HF_TOKEN_SECRET = SecretEnv("HF_TOKEN", "llmft-hf-token", "HF_TOKEN")
FORM_LABEL = "llmft/served-form"
"""Label of the InferenceService: ``lora`` (base + adapter as a LoRA module) or ``merged`` (one plain model)."""
LORA_FLAGS = ("--enable-lora", "--lora-modules", "--max-lora-rank")
DEFAULT_MAX_LORA_RANK = 64
"""vLLM ``--max-lora-rank`` of a :class:`ServeSpec` that names none (``llmft serve check`` without one)."""
_LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ServeSpec:
    """Everything that varies between InferenceServices of this project."""

    name: str
    """InferenceService name: a DNS-1035 label of at most 63 characters."""
    pvc_name: str
    """PVC that holds the adapter (and the base model, with ``base_model_path``)."""
    adapter_path: str
    """Adapter directory, relative to the PVC root (e.g. ``runs/demo/promoted/adapter``)."""
    lora_name: str
    """Model name clients request to get the fine-tuned model (``"model"`` in the OpenAI request): the adapter,
    or the merged model."""
    base_model_id: str | None = None
    """Hub id of the base model (downloaded by the server with HF_TOKEN); or use base_model_path."""
    base_model_path: str | None = None
    """Base model directory relative to the PVC root; or use base_model_id."""
    base_model_revision: str | None = None
    """Hub revision of ``base_model_id`` (a commit hash pins it)."""
    namespace: str | None = None
    """Namespace (None = the Cluster's namespace)."""
    model_name: str | None = None
    """Served name of the base model (None = ``<lora_name>-base``); never the LoRA name."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """vLLM ``--max-lora-rank``: at least the adapter's rank."""
    max_model_len: int | None = None
    """Context length the server allocates for (None = the model's maximum)."""
    dtype: str = "bfloat16"
    """Weights dtype of the vLLM engine."""
    gpus: int = 1
    """``nvidia.com/gpu`` requested and limited (0 only for experiments: vLLM needs a GPU)."""
    cpu: str = "4"
    """CPU request and limit."""
    memory: str = "32Gi"
    """Memory request and limit."""
    runtime: str = field(default_factory=lambda: images.SERVING_RUNTIME)
    """(Cluster)ServingRuntime name (llmft/components/images.py; override LLMFT_SERVING_RUNTIME)."""
    hf_token_secret: SecretEnv | None = HF_TOKEN_SECRET
    """Secret read into HF_TOKEN when the base model comes from the hub (optional key)."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """Node labels the predictor must match."""
    tolerations: tuple[Toleration, ...] | None = None
    """Tolerations; None = tolerate ``nvidia.com/gpu`` taints when GPUs are requested."""
    min_replicas: int = 1
    """Fewest replicas (1: no scale-to-zero, an LLM cold start takes minutes)."""
    max_replicas: int = 1
    """Most replicas."""
    deployment_mode: str | None = None
    """``serving.kserve.io/deploymentMode`` annotation; None (the deploy step's choice) = the cluster's default
    mode, whose spelling differs by KServe release (llmft/components/lib/serving/deployment_mode.py)."""
    extra_args: tuple[str, ...] = ()
    """More server/vLLM flags, e.g. ``("--gpu-memory-utilization=0.85",)``."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Extra labels of the InferenceService."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Extra annotations of the InferenceService."""
    service_account: str | None = None
    """Service account of the predictor pod."""
    merged_model_path: str | None = None
    """Merged form: the adapter merged into its base (``llmft export --merge``), relative to the PVC root, served
    alone as ``lora_name`` without LoRA flags; set no base model then. None = LoRA form."""


def _relative_path_error(what: str, path: str | None) -> str | None:
    if path is None:
        return None
    norm = posixpath.normpath(path)
    if not path or path.startswith("/") or norm == "." or norm.startswith(".."):
        return f"{what}={path!r}: must be a non-empty path relative to the PVC root, without '..'"
    return None


def _serve_spec_errors(spec: ServeSpec) -> list[str]:
    errors = []
    if not is_k8s_name(spec.name, kind="dns1035"):
        errors.append(f"name {spec.name!r}: must be a DNS-1035 label of at most 63 characters")
    if not _LORA_NAME.match(spec.lora_name):
        errors.append(f"lora_name {spec.lora_name!r}: letters, digits, '.', '_' and '-' only")
    if spec.merged_model_path is not None:
        if spec.base_model_id is not None or spec.base_model_path is not None:
            errors.append("merged_model_path: the merged model is served alone; set no base_model_id/base_model_path")
    elif (spec.base_model_id is None) == (spec.base_model_path is None):
        errors.append("set exactly one of base_model_id (hub) and base_model_path (on the PVC)")
    errors += [
        e
        for e in (
            _relative_path_error("adapter_path", spec.adapter_path),
            _relative_path_error("base_model_path", spec.base_model_path),
            _relative_path_error("merged_model_path", spec.merged_model_path),
        )
        if e
    ]
    if spec.max_lora_rank < 1:
        errors.append(f"max_lora_rank={spec.max_lora_rank}: must be positive")
    if not 0 <= spec.min_replicas <= spec.max_replicas or spec.max_replicas < 1:
        errors.append(
            f"replicas: need 0 <= min_replicas ({spec.min_replicas}) <= max_replicas "
            f"({spec.max_replicas}) and max_replicas >= 1"
        )
    return errors


def storage_layout(spec: ServeSpec) -> tuple[str, str, str | None]:
    """(storageUri, adapter path in the container, base model path in the container or None)."""
    adapter = posixpath.normpath(spec.adapter_path)
    if spec.base_model_path is None:
        return f"pvc://{spec.pvc_name}/{adapter}", MODEL_MOUNT, None
    base = posixpath.normpath(spec.base_model_path)
    root = posixpath.commonpath([adapter, base])

    def inside(path: str) -> str:
        return posixpath.join(MODEL_MOUNT, posixpath.relpath(path, root or ".")) if path != root else MODEL_MOUNT

    uri = f"pvc://{spec.pvc_name}/{root}" if root else f"pvc://{spec.pvc_name}"
    return uri, inside(adapter), inside(base)


def served_form(spec: ServeSpec) -> str:
    """``merged`` (one plain model) or ``lora`` (base model + adapter)."""
    return "lora" if spec.merged_model_path is None else "merged"


def storage_uri(spec: ServeSpec) -> str:
    """What KServe mounts at /mnt/models: the merged model's directory, or base and adapter's common root."""
    if spec.merged_model_path is not None:
        return f"pvc://{spec.pvc_name}/{posixpath.normpath(spec.merged_model_path)}"
    return storage_layout(spec)[0]


BASE_SUFFIX = "-base"


def served_names(spec: ServeSpec) -> tuple[str, str]:
    """(base model's served name, adapter's served name) of the LoRA form: distinct by construction."""
    return spec.model_name or f"{spec.lora_name}{BASE_SUFFIX}", spec.lora_name


def served_models(spec: ServeSpec) -> tuple[str, ...]:
    """Every name the server answers to: the merged model's, or the base model's and the adapter's."""
    return (spec.lora_name,) if spec.merged_model_path is not None else served_names(spec)


def server_args(spec: ServeSpec) -> list[str]:
    """Arguments of the Hugging Face runtime (its own flags, then vLLM's)."""
    if spec.merged_model_path is not None:  # one plain model, mounted at /mnt/models: no LoRA
        args = [
            f"--model_name={spec.lora_name}",
            "--backend=vllm",
            f"--model_dir={MODEL_MOUNT}",
            f"--dtype={spec.dtype}",
        ]
        return args + ([f"--max_model_len={spec.max_model_len}"] if spec.max_model_len else []) + list(spec.extra_args)
    _, adapter_dir, base_dir = storage_layout(spec)
    base_name, _ = served_names(spec)
    args = [f"--model_name={base_name}", "--backend=vllm"]
    if base_dir is None:
        args.append(f"--model_id={spec.base_model_id}")
        if spec.base_model_revision:
            args.append(f"--model_revision={spec.base_model_revision}")
    else:
        args.append(f"--model_dir={base_dir}")
    args += [
        f"--dtype={spec.dtype}",
        "--enable-lora",
        f"--max-lora-rank={spec.max_lora_rank}",
        "--lora-modules",
        f"{spec.lora_name}={adapter_dir}",
    ]
    if spec.max_model_len:
        args.append(f"--max_model_len={spec.max_model_len}")
    return args + list(spec.extra_args)


def _predictor_env(spec: ServeSpec) -> list:
    from kubernetes import client as k8s  # heavy: kubernetes

    if spec.base_model_path is not None or spec.merged_model_path is not None:  # everything is on the PVC
        return [k8s.V1EnvVar(name="HF_HUB_OFFLINE", value="1")]
    if spec.hf_token_secret is None:
        return []
    s = spec.hf_token_secret
    ref = k8s.V1SecretKeySelector(name=s.secret_name, key=s.key, optional=s.optional or None)
    return [k8s.V1EnvVar(name=s.env_name, value_from=k8s.V1EnvVarSource(secret_key_ref=ref))]


def build_inference_service(spec: ServeSpec):
    """The ``V1beta1InferenceService`` for ``spec``; raises ConfigError listing every problem."""
    import kserve  # heavy: kserve
    from kubernetes import client as k8s  # heavy: kubernetes

    errors = _serve_spec_errors(spec)
    if errors:
        raise ConfigError(f"InferenceService {spec.name!r}: " + "; ".join(errors))
    uri = storage_uri(spec)
    amounts = {"cpu": spec.cpu, "memory": spec.memory} | ({"nvidia.com/gpu": str(spec.gpus)} if spec.gpus else {})
    tolerations = spec.tolerations if spec.tolerations is not None else ((GPU_TOLERATION,) if spec.gpus else ())
    annotations = dict(spec.annotations)
    if spec.deployment_mode:
        annotations[MODE_ANNOTATION] = spec.deployment_mode
    model = kserve.V1beta1ModelSpec(
        name="kserve-container",
        model_format=kserve.V1beta1ModelFormat(name=images.SERVING_MODEL_FORMAT),
        runtime=spec.runtime,
        storage_uri=uri,
        args=server_args(spec),
        env=_predictor_env(spec) or None,
        resources=k8s.V1ResourceRequirements(requests=dict(amounts), limits=dict(amounts)),
    )
    predictor = kserve.V1beta1PredictorSpec(
        model=model,
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        node_selector=dict(spec.node_selector) or None,
        service_account_name=spec.service_account,
        tolerations=[
            k8s.V1Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect) for t in tolerations
        ]
        or None,
    )
    isvc = kserve.V1beta1InferenceService(
        api_version=f"{GROUP}/{VERSION}",
        kind=KIND,
        metadata=k8s.V1ObjectMeta(
            name=spec.name,
            namespace=spec.namespace,
            annotations=annotations or None,
            labels={"app.kubernetes.io/part-of": "kfp-llm-finetune", FORM_LABEL: served_form(spec), **spec.labels},
        ),
        spec=kserve.V1beta1InferenceServiceSpec(predictor=predictor),
    )
    problems = inference_service_errors(isvc_to_dict(isvc))
    if problems:
        raise ConfigError(f"InferenceService {spec.name!r}: " + "; ".join(problems))
    return isvc


def isvc_to_dict(isvc) -> dict:
    """The InferenceService as the API server sees it (camelCase keys, no None values)."""
    from kserve.api_client import ApiClient  # heavy: kserve

    return ApiClient().sanitize_for_serialization(isvc)


def inference_service_errors(isvc: dict) -> list[str]:
    """Rules the CRD schema does not express but serving depends on (KServe's webhook name
    format, and the vLLM/LoRA wiring of the Hugging Face runtime). Empty list = fine."""
    errors = []
    name = (isvc.get("metadata") or {}).get("name", "")
    if not is_k8s_name(name, kind="dns1035"):
        errors.append(f"metadata.name {name!r}: must be a DNS-1035 label of at most 63 characters")
    model = ((isvc.get("spec") or {}).get("predictor") or {}).get("model") or {}
    if not (model.get("modelFormat") or {}).get("name"):
        errors.append("spec.predictor.model.modelFormat.name: required")
    args = model.get("args") or []
    errors += _form_errors(((isvc.get("metadata") or {}).get("labels") or {}).get(FORM_LABEL), args)
    if any(a.startswith(LORA_FLAGS) for a in args):
        if "--backend=vllm" not in args:
            errors.append("spec.predictor.model.args: LoRA flags need --backend=vllm (the HF backend ignores them)")
        if "--enable-lora" not in args or "--lora-modules" not in args:
            errors.append("spec.predictor.model.args: --enable-lora and --lora-modules go together")
    if "--lora-modules" in args:
        modules = args[args.index("--lora-modules") + 1 :]
        module = modules[0] if modules else ""
        if "=" not in module or not module.split("=", 1)[1].startswith(MODEL_MOUNT):
            errors.append(f"spec.predictor.model.args: --lora-modules {module!r} must be name={MODEL_MOUNT}/...")
        base = next((a.split("=", 1)[1] for a in args if a.startswith("--model_name=")), None)
        if base is not None and base == module.split("=", 1)[0]:
            errors.append(
                f"spec.predictor.model.args: the base model and the adapter are both served as {base!r}: requests "
                "for that name reach only one of them (give --model_name another name)"
            )
    resources = model.get("resources") or {}
    gpu_req = (resources.get("requests") or {}).get("nvidia.com/gpu")
    if gpu_req != (resources.get("limits") or {}).get("nvidia.com/gpu"):
        errors.append("spec.predictor.model.resources: nvidia.com/gpu requests and limits must be equal")
    return errors


def _form_errors(form: str | None, args: list[str]) -> list[str]:
    """The label ``llmft/served-form`` agrees with the arguments: a merged model carries no LoRA flag and
    comes from the PVC; the LoRA form names its adapter."""
    lora_flags = sorted({a.split("=", 1)[0] for a in args if a.startswith(LORA_FLAGS)})
    if form == "merged":
        errors = []
        if lora_flags:
            errors.append(
                f"spec.predictor.model.args: {FORM_LABEL}=merged is one plain model served without LoRA; remove "
                f"{lora_flags}"
            )
        if any(a.startswith("--model_id") for a in args) or f"--model_dir={MODEL_MOUNT}" not in args:
            errors.append(f"spec.predictor.model.args: a merged model is the mounted volume: --model_dir={MODEL_MOUNT}")
        return errors
    if form == "lora" and "--lora-modules" not in args:
        return [f"spec.predictor.model.args: {FORM_LABEL}=lora needs --enable-lora and --lora-modules"]
    return []


def _urllib_post(url: str, payload: dict, timeout_s: float) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - http(s) only
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, text


def _urllib_get(url: str, timeout_s: float) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http(s) only
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _with_retries(call: Callable[[], tuple[int, Any]], attempts: int, retry_wait_s: float) -> tuple[int, Any]:
    """``call()`` until it answers 200 or a 4xx, at most ``attempts`` times (the route may still settle)."""
    status, body = 0, None
    for attempt in range(1, attempts + 1):
        try:
            status, body = call()
        except OSError as exc:  # connection refused / reset while the route settles
            status, body = 0, str(exc)
        if status == 200 or 400 <= status < 500:
            break
        if attempt < attempts:
            time.sleep(retry_wait_s)
    return status, body


KSERVE_FIRST_LORA_NAMES = "v0.15.1"
"""First KServe release whose Hugging Face runtime registers the ``--lora-modules`` names with its model server
(kserve#4345, commit c89bde6ad: ``python/huggingfaceserver/huggingfaceserver/__main__.py`` 314-317 at v0.15.1;
v0.15.0 has no such loop): before it, a request for the adapter's name is answered HTTP 404
``Model with name <name> does not exist.`` (``kserve/protocol/dataplane.py`` ``get_model``, ``errors.py``
``ModelNotFound``)."""

MESH_DENIAL = "RBAC: access denied"
"""The body of Istio's 403 when no AuthorizationPolicy allows the caller (the Envoy RBAC filter)."""


def mesh_denial_message(url: str) -> str:
    """Why a Kubeflow mesh refuses the deploy step's smoke test, and what to do (docs/cluster-guide.md)."""
    return (
        f"smoke test GET {url} -> HTTP 403 {MESH_DENIAL!r} from the Istio mesh: the InferenceService is deployed and "
        "Ready, but the mesh refuses this pod. KFP starts pipeline pods without an Istio sidecar "
        "(sidecar.istio.io/inject=false), so they carry no mesh identity, and Kubeflow's mesh denies by default "
        "(istio-system global-deny-all; a profile namespace allows its own identities). Allow the smoke test "
        "(docs/cluster-guide.md, 'Smoke test behind Istio'). Serving in a namespace without sidecar injection "
        "(serving_namespace) needs the data PVC and a RoleBinding for this pipeline's service account there "
        "(docs/cluster-guide.md, 'Serving in another namespace')"
    )


def smoke_test(
    url: str,
    model_name: str,
    prompt: str,
    *,
    base_name: str | None,
    max_tokens: int = 16,
    timeout_s: float = 60.0,
    attempts: int = 3,
    retry_wait_s: float = 5.0,
    http_post: Callable[[str, dict, float], tuple[int, Any]] | None = None,
    http_get: Callable[[str, float], tuple[int, Any]] | None = None,
    api_root: str = OPENAI_ROOT,
    chat: bool = False,
) -> dict:
    """Check the server as a client sees it: ``GET <url>/openai/v1/models`` lists the base model
    (``base_name``); one greedy completion (temperature 0, with token logprobs) of ``prompt`` from the
    adapter (``model_name``) and one from the base; the adapter's must not be the base model's (the same
    text AND the same logprobs: the request did not reach the adapter, or it changes nothing), and each
    answer must carry the name it was asked under.
    The listing cannot prove the adapter: KServe's Hugging Face runtime registers each ``--lora-modules``
    name onto the base model's object (kserve v0.20.0 ``python/huggingfaceserver/huggingfaceserver/__main__.py``
    332-336, ``ModelServer.register_model`` -> ``ModelRepository.update(model, name)``,
    ``python/kserve/kserve/model_repository.py`` 57-72), and its listing gives ``id = model.name`` for every
    entry (``python/kserve/kserve/protocol/rest/openai/endpoints.py`` 229-249): the base name once per
    name, never the adapter's. vLLM's own ``/v1/models`` lists both; either way the completion is the proof.
    An adapter request reaches vLLM unchanged (kserve ``openai/dataplane.py`` 44-73, huggingfaceserver
    ``vllm/vllm_model.py`` 248-271), and vLLM answers it under the LoRA name
    (``vllm/entrypoints/openai/completion/serving.py`` ``self.models.model_name(lora_request)``).
    ``base_name=None`` (the merged form: one model, no base served beside it): the listing names
    ``model_name``, and one completion of it, answered under that name.
    Returns ``{"endpoint", "models", "model", "text", "base_text"}``. ``http_post(url, payload,
    timeout_s)`` and ``http_get(url, timeout_s)`` -> ``(status, parsed JSON)`` are injectable.
    ``api_root``: ``/openai/v1`` on the Hugging Face runtime, ``/v1`` on vLLM's own server; ``chat``: ask
    ``/chat/completions`` with ``prompt`` as the user's message (the model's chat template) instead."""
    post, get = http_post or _urllib_post, http_get or _urllib_get
    root = url.rstrip("/") + api_root
    status, listing = _with_retries(lambda: get(f"{root}/models", timeout_s), attempts, retry_wait_s)
    if status == 403 and MESH_DENIAL in str(listing):
        raise RuntimeError(mesh_denial_message(f"{root}/models"))
    if status != 200 or not isinstance(listing, dict):
        raise RuntimeError(f"smoke test GET {root}/models -> HTTP {status}: {listing}")
    served = sorted({str(m.get("id")) for m in listing.get("data") or [] if isinstance(m, dict)})
    listed = model_name if base_name is None else base_name
    if listed not in served:
        raise RuntimeError(f"smoke test GET {root}/models: {listed!r} not served (the server lists {served})")
    names = [model_name] if base_name is None else [model_name, base_name]
    answers = {}
    endpoint = f"{root}/chat/completions" if chat else f"{root}/completions"
    for name in names:
        payload: dict[str, Any] = {"model": name, "max_tokens": max_tokens, "temperature": 0}
        if chat:
            payload |= {"messages": [{"role": "user", "content": prompt}], "logprobs": True}
        else:
            payload |= {"prompt": prompt, "logprobs": 1}
        status, body = _with_retries(functools.partial(post, endpoint, payload, timeout_s), attempts, retry_wait_s)
        if status == 404 and name == model_name and base_name is not None:
            raise RuntimeError(unknown_adapter_message(endpoint, model_name, base_name, body))
        answers[name] = _completion(endpoint, name, status, body)
    adapter, base = answers[model_name], (answers[base_name] if base_name is not None else None)
    if adapter == base:
        raise RuntimeError(
            f"smoke test POST {endpoint}: model {model_name!r} answered exactly like the base model "
            f"{base_name!r} (text {adapter[0]!r}, same token logprobs): the adapter is not applied"
        )
    return {
        "endpoint": endpoint,
        "models": served,
        "model": model_name,
        "text": adapter[0],
        "base_text": base[0] if base else None,
    }


def unknown_adapter_message(endpoint: str, adapter: str, base: str, body: Any) -> str:
    """Why the server answers 404 for the adapter's name while it lists the base model, and what to do."""
    return (
        f"smoke test POST {endpoint} (model {adapter!r}) -> HTTP 404: {body}. The server lists the base model "
        f"{base!r} but does not know the adapter's name: KServe's Hugging Face runtime registers --lora-modules "
        f"names from {KSERVE_FIRST_LORA_NAMES} on (kserve#4345); upgrade the ServingRuntime image to "
        f"{KSERVE_FIRST_LORA_NAMES} or later (docs/cluster-guide.md, 'KServe versions'), or serve the merged form "
        "(serving_mode=merged)"
    )


def _completion(endpoint: str, name: str, status: int, body: Any) -> tuple[str, tuple]:
    """(text, token logprobs) of one completion answer; RuntimeError for anything else."""
    if status != 200:
        raise RuntimeError(f"smoke test POST {endpoint} (model {name!r}) -> HTTP {status}: {body}")
    choices = body.get("choices") if isinstance(body, dict) else None
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    if not isinstance(text, str):
        raise RuntimeError(f"smoke test POST {endpoint}: no completion text in the answer: {body}")
    answered = body.get("model")
    if answered is not None and answered != name:
        raise RuntimeError(f"smoke test POST {endpoint}: asked for model {name!r}, answered by {answered!r}")
    logprobs = choice.get("logprobs") or {}  # completions: token_logprobs; chat: content[].logprob
    values = logprobs.get("token_logprobs") or [t.get("logprob") for t in logprobs.get("content") or []]
    return text, tuple(values)
