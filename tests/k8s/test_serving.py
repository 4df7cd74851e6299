"""InferenceService: built objects pass the real CRD schema, the vLLM/LoRA wiring is right,
deploy waits for Ready through the cluster module, the smoke test checks the answer."""

from __future__ import annotations

import pytest

from llmft.components import images
from llmft.components.lib.contracts.pod_parts import Toleration
from llmft.components.lib.serving.inferenceservice import (
    FORM_LABEL,
    KSERVE_FIRST_LORA_NAMES,
    ServeSpec,
    build_inference_service,
    inference_service_errors,
    isvc_to_dict,
    served_models,
    server_args,
    smoke_test,
    storage_layout,
)
from llmft.components.lib.serving.isvc_apply import deploy_inference_service
from llmft.trainer.errors import ConfigError

NS = "team-a"
PVC_BASE = ServeSpec(
    name="demo-lora",
    pvc_name="llmft-data",
    adapter_path="runs/demo/promoted/adapter",
    lora_name="demo",
    base_model_path="runs/demo/base-model",
    max_lora_rank=32,
)
HUB_BASE = ServeSpec(
    name="qwen7b-sft",
    pvc_name="llmft-data",
    adapter_path="runs/r1/promoted/adapter",
    lora_name="sft-v3",
    base_model_id="Qwen/Qwen2.5-7B-Instruct",
    base_model_revision="a09a354",
    max_model_len=8192,
    gpus=2,
    memory="80Gi",
    deployment_mode="RawDeployment",
    node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    tolerations=(Toleration("nvidia.com/gpu"), Toleration("dedicated", "Equal", "serving")),
    extra_args=("--gpu-memory-utilization=0.85",),
)
MERGED = ServeSpec(
    name="demo-merged",
    pvc_name="llmft-data",
    adapter_path="models/demo/r1",
    lora_name="demo",
    merged_model_path="merged/demo/r1",
    max_model_len=4096,
)
"""The merged serving form: the adapter merged into its base (llmft export --merge), served alone."""
VARIANTS = {"pvc-base": PVC_BASE, "hub-base": HUB_BASE, "merged": MERGED}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_pass_crd_schema_and_serving_rules(name, isvc_crd_errors, validate_pod):
    isvc = isvc_to_dict(build_inference_service(VARIANTS[name]))
    assert isvc_crd_errors(isvc) == []
    assert inference_service_errors(isvc) == []
    predictor = isvc["spec"]["predictor"]
    model = predictor["model"]
    container = {k: model[k] for k in ("name", "args", "env", "resources") if k in model}
    pod_spec = {
        "containers": [{**container, "image": "kserve/huggingfaceserver:v0.20.0"}],
        **{k: predictor[k] for k in ("nodeSelector", "tolerations") if k in predictor},
    }
    validate_pod({"labels": isvc["metadata"]["labels"]}, pod_spec)


def test_pvc_base_model_shares_one_mount_with_the_adapter():
    uri, adapter_dir, base_dir = storage_layout(PVC_BASE)
    assert uri == "pvc://llmft-data/runs/demo"
    assert adapter_dir == "/mnt/models/promoted/adapter" and base_dir == "/mnt/models/base-model"
    isvc = isvc_to_dict(build_inference_service(PVC_BASE))
    model = isvc["spec"]["predictor"]["model"]
    assert model["storageUri"] == uri and model["modelFormat"] == {"name": "huggingface"}
    assert model["runtime"] == images.SERVING_RUNTIME
    assert model["args"] == [
        "--model_name=demo-base",  # never the adapter's name (item 4)
        "--backend=vllm",
        "--model_dir=/mnt/models/base-model",
        "--dtype=bfloat16",
        "--enable-lora",
        "--max-lora-rank=32",
        "--lora-modules",
        "demo=/mnt/models/promoted/adapter",
    ]
    assert model["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1" == model["resources"]["requests"]["nvidia.com/gpu"]


def test_hub_base_model_uses_model_id_and_hf_token_secret():
    uri, adapter_dir, base_dir = storage_layout(HUB_BASE)
    assert uri == "pvc://llmft-data/runs/r1/promoted/adapter" and adapter_dir == "/mnt/models" and base_dir is None
    args = server_args(HUB_BASE)
    assert "--model_id=Qwen/Qwen2.5-7B-Instruct" in args and "--model_revision=a09a354" in args
    assert not any(a.startswith("--model_dir") for a in args)
    assert args[args.index("--lora-modules") + 1] == "sft-v3=/mnt/models"
    assert "--max_model_len=8192" in args and args[-1] == "--gpu-memory-utilization=0.85"
    isvc = isvc_to_dict(build_inference_service(HUB_BASE))
    (env,) = isvc["spec"]["predictor"]["model"]["env"]
    assert env == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "llmft-hf-token", "key": "HF_TOKEN", "optional": True}},
    }
    assert isvc["metadata"]["annotations"] == {"serving.kserve.io/deploymentMode": "RawDeployment"}
    assert len(isvc["spec"]["predictor"]["tolerations"]) == 2


def test_merged_model_is_one_plain_model_mounted_from_its_own_directory():
    """The huggingfaceserver passes --model_dir to vLLM as the model and serves it as --model_name
    (kserve python/huggingfaceserver/huggingfaceserver/__main__.py, load_model): no LoRA flag, no
    base model beside it, nothing from the hub."""
    isvc = isvc_to_dict(build_inference_service(MERGED))
    model = isvc["spec"]["predictor"]["model"]
    assert model["storageUri"] == "pvc://llmft-data/merged/demo/r1"
    assert model["args"] == [
        "--model_name=demo",
        "--backend=vllm",
        "--model_dir=/mnt/models",
        "--dtype=bfloat16",
        "--max_model_len=4096",
    ]
    assert model["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    assert isvc["metadata"]["labels"][FORM_LABEL] == "merged" and served_models(MERGED) == ("demo",)
    assert isvc_to_dict(build_inference_service(PVC_BASE))["metadata"]["labels"][FORM_LABEL] == "lora"
    assert served_models(PVC_BASE) == ("demo-base", "demo")


def test_disjoint_pvc_paths_mount_the_whole_claim():
    spec = ServeSpec(
        name="x", pvc_name="data", adapter_path="runs/a/adapter", lora_name="a", base_model_path="models/base"
    )
    assert storage_layout(spec) == ("pvc://data", "/mnt/models/runs/a/adapter", "/mnt/models/models/base")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"name": "Demo_LoRA"}, "DNS-1035"),
        ({"lora_name": "my lora"}, "lora_name"),
        ({"base_model_id": "Qwen/Qwen2.5-0.5B"}, "exactly one"),
        ({"base_model_path": None}, "exactly one"),
        ({"adapter_path": "/abs/adapter"}, "relative"),
        ({"adapter_path": "../escape"}, "relative"),
        ({"min_replicas": 3, "max_replicas": 1}, "replicas"),
    ],
)
def test_bad_serve_specs_are_refused(change, message):
    spec = ServeSpec(**{**PVC_BASE.__dict__, **change})
    with pytest.raises(ConfigError, match=message):
        build_inference_service(spec)


@pytest.mark.parametrize(
    "change, message",
    [({"base_model_path": "runs/demo/base-model"}, "served alone"), ({"merged_model_path": "../m"}, "relative")],
)
def test_bad_merged_specs_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        build_inference_service(ServeSpec(**{**MERGED.__dict__, **change}))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m["args"].remove("--backend=vllm"), "--backend=vllm"),
        (lambda m: m["args"].remove("--enable-lora"), "go together"),
        (
            lambda m: m["args"].__setitem__(m["args"].index("--lora-modules") + 1, "demo=/data/adapter"),
            "name=/mnt/models",
        ),
        (lambda m: m["resources"]["limits"].update({"nvidia.com/gpu": "2"}), "requests and limits"),
        (lambda m: m.pop("modelFormat"), "modelFormat.name"),
        (lambda m: m["args"].__setitem__(0, "--model_name=demo"), "both served as 'demo'"),
    ],
)
def test_serving_rules_catch_broken_wiring(mutate, message):
    isvc = isvc_to_dict(build_inference_service(PVC_BASE))
    mutate(isvc["spec"]["predictor"]["model"])
    assert any(message in e for e in inference_service_errors(isvc))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m["args"].append("--enable-lora"), "served without LoRA; remove ['--enable-lora']"),
        (lambda m: m["args"].extend(["--lora-modules", "demo=/mnt/models"]), "remove ['--lora-modules']"),
        (lambda m: m["args"].append("--max-lora-rank=64"), "remove ['--max-lora-rank']"),
        (lambda m: m["args"].__setitem__(2, "--model_id=Qwen/Qwen2.5-7B-Instruct"), "--model_dir=/mnt/models"),
    ],
)
def test_a_merged_model_must_carry_no_lora_flags(mutate, message):
    """The rule the CRD schema cannot express: the label says merged, so any LoRA flag (which would make
    vLLM expect an adapter) or a hub model is a broken manifest."""
    isvc = isvc_to_dict(build_inference_service(MERGED))
    assert inference_service_errors(isvc) == []
    mutate(isvc["spec"]["predictor"]["model"])
    assert any(message in e for e in inference_service_errors(isvc)), inference_service_errors(isvc)
    lora = isvc_to_dict(build_inference_service(PVC_BASE))
    lora["metadata"]["labels"][FORM_LABEL] = "merged"  # LoRA wiring under the merged label
    assert any("served without LoRA" in e for e in inference_service_errors(lora))


def _ready_after(count_needed: int, url: str = "http://demo-lora.team-a.example.com"):
    def on_get(obj: dict, count: int) -> None:
        status = obj.setdefault("status", {})
        status["observedGeneration"] = obj["metadata"]["generation"]
        if count < count_needed:
            status["conditions"] = [{"type": "Ready", "status": "False", "reason": "RevisionMissing"}]
        else:
            status["conditions"] = [{"type": "PredictorReady", "status": "True"}, {"type": "Ready", "status": "True"}]
            status["url"] = url
            status["address"] = {"url": "http://demo-lora-predictor.team-a.svc.cluster.local"}

    return on_get


def test_deploy_creates_and_waits_until_ready(fake_cluster, fake_custom_api, isvc_crd_errors):
    fake_custom_api.on_get = _ready_after(3)
    result = deploy_inference_service(
        fake_cluster, build_inference_service(PVC_BASE), timeout_s=5, poll_s=0.001, print_fn=lambda _: None
    )
    assert result == {
        "name": "demo-lora",
        "namespace": NS,
        "url": "http://demo-lora.team-a.example.com",
        "internal_url": "http://demo-lora-predictor.team-a.svc.cluster.local",
        "generation": 1,
        "deployment_mode": "Knative",  # no mode annotation: the cluster's default (tests/k8s/test_kserve_modes.py)
    }
    (sent,) = fake_custom_api.created("inferenceservices")
    assert isvc_crd_errors(sent) == [] and sent["metadata"]["namespace"] == NS
    assert sum(1 for c in fake_custom_api.calls if c[0] == "get") == 3


def test_redeploy_replaces_and_waits_for_the_new_generation(fake_cluster, fake_custom_api):
    fake_custom_api.on_get = _ready_after(1)
    deploy_inference_service(
        fake_cluster, build_inference_service(PVC_BASE), timeout_s=5, poll_s=0.001, print_fn=lambda _: None
    )
    key = ("serving.kserve.io", "v1beta1", NS, "inferenceservices", "demo-lora")
    old_version = fake_custom_api.objects[key]["metadata"]["resourceVersion"]
    fake_custom_api.gets.clear()
    stale = {"n": 0}

    def stale_then_ready(obj: dict, count: int) -> None:  # the controller lags one poll behind the new spec
        stale["n"] += 1
        obj["status"]["observedGeneration"] = obj["metadata"]["generation"] - (1 if count < 3 else 0)

    fake_custom_api.on_get = stale_then_ready
    newer = ServeSpec(**{**PVC_BASE.__dict__, "max_lora_rank": 64})
    result = deploy_inference_service(
        fake_cluster, build_inference_service(newer), timeout_s=5, poll_s=0.001, print_fn=lambda _: None
    )
    replace = next(c for c in fake_custom_api.calls if c[0] == "replace")
    assert replace[-1]["metadata"]["resourceVersion"] == old_version
    assert "--max-lora-rank=64" in fake_custom_api.objects[key]["spec"]["predictor"]["model"]["args"]
    assert result["generation"] == 2 and stale["n"] == 3, "a Ready status of the old generation is not Ready"


def test_failed_model_load_fails_fast_with_the_reason(fake_cluster, fake_custom_api):
    def failing(obj: dict, count: int) -> None:
        obj["status"] = {
            "modelStatus": {
                "transitionStatus": "BlockedByFailedLoad",
                "lastFailureInfo": {
                    "reason": "ModelLoadFailed",
                    "message": "vLLM only supports modules_to_save being None.",
                },
            }
        }

    fake_custom_api.on_get = failing
    with pytest.raises(RuntimeError, match="modules_to_save being None"):
        deploy_inference_service(
            fake_cluster, build_inference_service(PVC_BASE), timeout_s=5, poll_s=0.001, print_fn=lambda _: None
        )


def test_never_ready_times_out_with_the_last_reason(fake_cluster, fake_custom_api):
    fake_custom_api.on_get = _ready_after(10**9)
    with pytest.raises(TimeoutError, match="not Ready after.*RevisionMissing"):
        deploy_inference_service(
            fake_cluster, build_inference_service(PVC_BASE), timeout_s=0.05, poll_s=0.001, print_fn=lambda _: None
        )


def _server(answers: dict, models=("demo-base", "demo-base")):
    """http_get / http_post of an OpenAI server listing ``models`` and answering ``answers[model]``. The
    default listing is KServe's for the LoRA form (the base name once per registered name: see
    tests/serving/test_kserve_openai.py, which runs KServe's own code)."""
    seen = []

    def http_get(url, timeout_s):
        seen.append(("GET", url, None))
        return 200, {"object": "list", "data": [{"id": m} for m in models]}

    def http_post(url, payload, timeout_s):
        seen.append(("POST", url, payload))
        text, logprobs = answers[payload["model"]]
        return 200, {"model": payload["model"], "choices": [{"text": text, "logprobs": {"token_logprobs": logprobs}}]}

    return http_get, http_post, seen


def test_smoke_test_lists_the_base_and_compares_adapter_with_base():
    """Issue 33 item 3: KServe's /openai/v1/models lists the base name only (the adapter's name is registered
    onto the base model's object); the adapter is proven by a greedy completion of a fixed prompt, asked
    under its name, that is not the base model's."""
    http_get, http_post, seen = _server({"demo": (" Paris.", [-0.1, -0.2]), "demo-base": (" Lyon", [-1.0, -0.5])})
    out = smoke_test(
        "http://demo-lora.team-a.example.com/", "demo", "Capital of France?", base_name="demo-base",
        http_get=http_get, http_post=http_post,
    )  # fmt: skip
    assert out == {
        "endpoint": "http://demo-lora.team-a.example.com/openai/v1/completions",
        "models": ["demo-base"],
        "model": "demo",
        "text": " Paris.",
        "base_text": " Lyon",
    }
    assert seen[0] == ("GET", "http://demo-lora.team-a.example.com/openai/v1/models", None)
    payload = {"prompt": "Capital of France?", "max_tokens": 16, "temperature": 0, "logprobs": 1}
    assert [s[2] for s in seen[1:]] == [{"model": "demo", **payload}, {"model": "demo-base", **payload}]
    vllm_listing = _server({"demo": (" Paris.", [-0.1]), "demo-base": (" Lyon", [-1.0])}, models=("demo-base", "demo"))
    assert smoke_test("http://h", "demo", "hi", base_name="demo-base", http_get=vllm_listing[0],
                      http_post=vllm_listing[1])["models"] == ["demo", "demo-base"]  # fmt: skip


def test_smoke_test_fails_when_the_adapter_answers_like_the_base_or_the_base_is_missing():
    same = _server({"demo": (" Paris.", [-0.1]), "demo-base": (" Paris.", [-0.1])})
    with pytest.raises(RuntimeError, match="answered exactly like the base model"):
        smoke_test("http://h", "demo", "hi", base_name="demo-base", http_get=same[0], http_post=same[1])
    same_text = _server({"demo": (" Paris.", [-0.1]), "demo-base": (" Paris.", [-0.3])})  # logprobs differ: applied
    assert smoke_test("http://h", "demo", "hi", base_name="demo-base", http_get=same_text[0], http_post=same_text[1])
    shared = _server({"demo": ("x", [])}, models=("demo", "demo"))  # the old shared --model_name
    with pytest.raises(RuntimeError, match=r"'demo-base' not served \(the server lists \['demo'\]\)"):
        smoke_test("http://h", "demo", "hi", base_name="demo-base", http_get=shared[0], http_post=shared[1])


def test_an_adapter_name_the_server_does_not_know_names_the_kserve_version():
    """KServe v0.15.0 registers no --lora-modules name (kserve#4345): the base is listed and answers, the
    adapter's name is answered 404 by KServe's dataplane; the error names the first version that registers it."""
    http_get, _, _ = _server({})

    def http_post(url, payload, timeout_s):
        if payload["model"] == "demo":
            return 404, {"error": "Model with name demo does not exist."}
        return 200, {"model": "demo-base", "choices": [{"text": "x"}]}

    with pytest.raises(RuntimeError, match=r"HTTP 404.*does not know the adapter's name.*v0\.15\.1.*kserve#4345"):
        smoke_test("http://h", "demo", "hi", base_name="demo-base", http_get=http_get, http_post=http_post)
    assert KSERVE_FIRST_LORA_NAMES == "v0.15.1"


def test_smoke_test_of_a_merged_model_asks_its_one_name():
    """Merged form: no base model is served beside it, so the smoke test lists and asks the one name."""
    http_get, http_post, seen = _server({"demo": (" Paris.", [-0.1])}, models=("demo",))
    out = smoke_test("http://h", "demo", "Capital of France?", base_name=None, http_get=http_get, http_post=http_post)
    assert out["models"] == ["demo"] and out["text"] == " Paris." and out["base_text"] is None
    assert [s[2]["model"] for s in seen[1:]] == ["demo"]
    missing = _server({"demo": ("x", [])}, models=("demo-base",))
    with pytest.raises(RuntimeError, match=r"'demo' not served"):
        smoke_test("http://h", "demo", "hi", base_name=None, http_get=missing[0], http_post=missing[1])


def test_smoke_test_retries_while_the_route_settles_then_reports_errors():
    answers = [
        OSError("connection refused"),
        (503, "upstream connect error"),
        (200, {"model": "demo", "choices": [{"text": "ok"}]}),
        (200, {"model": "demo-base", "choices": [{"text": "base"}]}),
    ]

    def flaky(url, payload, timeout_s):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    listing = _server({})[0]
    assert smoke_test("http://h", "demo", "hi", base_name="demo-base", http_get=listing, http_post=flaky,
                      retry_wait_s=0)["text"] == "ok"  # fmt: skip
    with pytest.raises(RuntimeError, match="HTTP 404.*does not exist"):
        smoke_test(
            "http://h",
            "demo",
            "hi",
            base_name="demo-base",
            retry_wait_s=0,
            http_get=listing,
            http_post=lambda *a: (404, {"message": "The model `demo` does not exist."}),
        )
    with pytest.raises(RuntimeError, match="answered by 'base'"):
        smoke_test("http://h", "demo", "hi", base_name="demo-base", http_get=listing,
                   http_post=lambda *a: (200, {"model": "base", "choices": [{"text": "x"}]}))  # fmt: skip
    with pytest.raises(RuntimeError, match="no completion text"):
        smoke_test("http://h", "demo", "hi", base_name="demo-base", http_get=listing,
                   http_post=lambda *a: (200, {"choices": []}))  # fmt: skip
