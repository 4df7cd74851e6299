"""The local vLLM server without vLLM: the InferenceService's args as vLLM's, vLLM's reason in one line,
what is refused before vLLM starts, and the server's process group stopped in every case (a stand-in
server: a small Python script, so these run without the serving virtualenv)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest
from adapter_helpers import deploy_request
from adapter_variants import renamed_module_adapter, wider_adapter, without_weights

from llmft.cli import main
from llmft.components.lib.serving import vllm_local
from llmft.components.lib.serving.deployment import serve_spec
from llmft.components.lib.serving.inferenceservice import build_inference_service, isvc_to_dict
from llmft.components.lib.serving.vllm_local import VllmRefusedError, VllmServer, manifest_argv, vllm_argv, vllm_reason
from llmft.trainer.errors import ConfigError

VOLUME = Path("/data")


def _manifest(**change) -> tuple[dict, object]:
    req = deploy_request(VOLUME, "adapter", mode="vllm", **change)
    return isvc_to_dict(build_inference_service(serve_spec(req))), req


def test_lora_form_args_are_the_manifests_with_the_mount_mapped():
    isvc, req = _manifest()
    assert manifest_argv(isvc, req.pvc_name, "/local/vol") == [
        "--model",
        "/local/vol/base-models/tiny",
        "--served-model-name",
        "m-base",
        "--dtype=bfloat16",
        "--enable-lora",
        "--max-lora-rank=8",
        "--lora-modules",
        "m=/local/vol/models/m/adapter",
    ]


def test_merged_form_is_one_model_under_the_adapters_name():
    isvc, req = _manifest(form="merged", model_dir="/data/merged/m/run-1")
    assert manifest_argv(isvc, req.pvc_name, "/local/vol") == [
        "--model",
        "/local/vol/merged/m/run-1",
        "--served-model-name",
        "m",
        "--dtype=bfloat16",
    ]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model_name=m", "--backend=huggingface", "--model_dir=/mnt/models"], "only --backend=vllm runs vLLM"),
        (["--model_name=m", "--model_dir=/mnt/models"], "--backend=auto"),
        (["--model_name=m", "--backend=vllm", "--model_id=Qwen/Qwen3-8B"], "runs offline"),
    ],
)
def test_runtime_args_vllm_cannot_run_here_are_refused(args, match):
    with pytest.raises(VllmRefusedError, match=match):
        vllm_argv(args, "/x")


def test_passthrough_flags_keep_their_form_and_only_mount_paths_change():
    args = ["--backend=vllm", "--max_model_len=512", "--lora-modules", "a=/mnt/models/a", "--x=/mnt/modelsX"]
    assert vllm_argv(args, "/v") == [
        "--model",
        "/v",
        "--served-model-name",
        "model",
        "--max_model_len=512",
        "--lora-modules",
        "a=/v/a",
        "--x=/mnt/modelsX",
    ]


def test_vllms_reason_is_the_last_error_line_of_its_log():
    log = textwrap.dedent(
        """\
        (APIServer pid=7) INFO 11-26 23:33:21 [api_utils.py:347] version 0.32.0
        Traceback (most recent call last):
          File "/v/lib/python3.11/site-packages/vllm/lora/peft_helper.py", line 196, in validate_legal
        (APIServer pid=7) ERROR 11-26 23:35:29 [serving.py:99] ValueError: LoRA rank 16 is greater than max_lora_rank 8.
        (APIServer pid=7) INFO 11-26 23:35:30 [launcher.py:304] shutting down
        """
    )
    assert vllm_reason(log) == "ValueError: LoRA rank 16 is greater than max_lora_rank 8."
    assert vllm_reason("just a line\n\n") == "just a line"
    pydantic = textwrap.dedent(
        """\
        (APIServer pid=9) pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
          Value error, Invalid repository ID or local directory specified: '/m'.
        Please verify the following requirements:
        """
    )
    assert vllm_reason(pydantic) == (
        "ValidationError: 1 validation error for ModelConfig: Invalid repository ID or local directory specified: '/m'."
    )


def test_no_serving_venv_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_local.SERVING_VENV_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(VllmRefusedError, match="make serving-venv"):
        VllmServer(["--model", "x"]).start()


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = VllmServer(["--model", "x"], port=port, command=[sys.executable, "-c", "raise SystemExit(9)"])
        with pytest.raises(VllmRefusedError, match=f"port 127.0.0.1:{port} is not free") as refused:
            server.start()
    assert server.process is None and "\n" not in str(refused.value)


# --- llmft serve check: what is refused before vLLM starts (one line, exit 1, no server) ---


@pytest.fixture
def small_adapter(tmp_path) -> Path:
    """A LoRA r8 adapter on q_proj/v_proj of a 2-layer model (tensors written with numpy, no torch), and a
    base model directory it names."""
    import numpy as np
    from safetensors.numpy import save_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    tensors = {
        f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight": np.ones(shape, np.float32)
        for i in range(2)
        for m in ("q_proj", "v_proj")
        for ab, shape in (("A", (8, 16)), ("B", (16, 8)))
    }
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    return adapter


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        (lambda a, out: wider_adapter(a, out, rank=16), "r=16 exceeds max_lora_rank=8"),
        (renamed_module_adapter, "target_modules ['foo_proj'] are not LoRA-servable by vLLM"),
        (without_weights, "adapter_model.safetensors: missing"),
    ],
    ids=["rank-above-max", "unsupported-module", "missing-weights"],
)
def test_serve_check_refuses_what_vllm_would_before_starting_it(
    variant, reason, small_adapter, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(vllm_local.SERVING_VENV_ENV, str(tmp_path / "no-venv"))  # vLLM is never reached
    bad = variant(small_adapter, tmp_path / "bad")
    out = tmp_path / "out.json"
    code_args = ["--base", str(small_adapter.parent / "base"), "--max-lora-rank", "8"]
    code = main(
        ["serve", "check", "--adapter", str(bad), "--name", "m", "--prompt", "hi", "--json", str(out)] + code_args
    )
    err = capsys.readouterr().err
    assert code == 1
    assert reason in err and err.count("\n") == 1, err
    assert not out.exists()


def test_serve_check_never_replaces_a_file_it_did_not_write(small_adapter, tmp_path, capsys):
    out = tmp_path / "notes.json"
    out.write_text('{"mine": 1}')
    assert (
        main(["serve", "check", "--adapter", str(small_adapter), "--name", "m", "--prompt", "x", "--json", str(out)])
        == 1
    )
    assert "is not a `llmft serve check` result" in capsys.readouterr().err
    assert out.read_text() == '{"mine": 1}'


def test_serve_check_never_writes_its_log_over_a_users_file_or_through_a_link(tmp_path, capsys):
    notes = tmp_path / "notes.log"
    notes.write_text("mine\n")
    link = tmp_path / "link.log"
    link.symlink_to(notes)
    for log in (notes, link):  # refused before the adapter is even read
        args = [
            "serve",
            "check",
            "--adapter",
            str(tmp_path / "none"),
            "--name",
            "m",
            "--prompt",
            "x",
            "--log",
            str(log),
        ]
        assert main(args) == 1
        err = capsys.readouterr().err
        assert ("llmft did not write" in err or "symlink" in err) and err.count("\n") == 1, err
    assert notes.read_text() == "mine\n" and link.is_symlink()


def test_serve_check_without_a_local_base_says_so(small_adapter, capsys):
    config = json.loads((small_adapter / "adapter_config.json").read_text())
    (small_adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/m"}))
    assert main(["serve", "check", "--adapter", str(small_adapter), "--name", "m", "--prompt", "x"]) == 1
    assert "pass --base DIR" in capsys.readouterr().err


def test_deploy_mode_vllm_runs_only_under_kfp_local():
    from plan_helpers import CLUSTER, make_plan

    assert make_plan(serving_deploy_mode="vllm").on_cluster is False
    with pytest.raises(ConfigError, match="`serving_deploy_mode`=.vllm.*kfp.local.*use serving_deploy_mode=kserve"):
        make_plan(environ=CLUSTER, serving_deploy_mode="vllm")


# --- the server process: vLLM's reason when it does not start, stopped in every case (a stand-in server) ---

FAKE_SERVER = textwrap.dedent(
    """\
    import http.server, json, signal, sys
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if "--fail" in args:
        print("Traceback (most recent call last):", flush=True)
        print("ValueError: No supported config format found in /nowhere", file=sys.stderr, flush=True)
        sys.exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server that ignores SIGTERM: SIGKILL must follow
    if "--hang" in args:  # never ready
        import time
        time.sleep(600)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_server(tmp_path) -> list[str]:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    return [sys.executable, str(script)]


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_a_server_that_exits_while_starting_gives_vllms_reason_in_one_line(fake_server, tmp_path):
    with pytest.raises(VllmRefusedError) as refused:
        with VllmServer(["--fail"], command=fake_server, log_path=tmp_path / "log", print_fn=lambda _: None):
            pass
    message = str(refused.value)
    assert "vLLM did not start (exit 1): ValueError: No supported config format found in /nowhere" in message
    assert "\n" not in message and str(tmp_path / "log") in message


@pytest.mark.slow
def test_the_server_is_killed_even_when_it_ignores_sigterm(fake_server):
    server = VllmServer([], command=fake_server, print_fn=lambda _: None, stop_grace_s=1)
    with server:
        pid, log = server.process.pid, server.log_path
        assert not _gone(pid) and log.is_file()
    assert _gone(pid)
    assert not log.exists()  # its temporary log goes with it when all went well


@pytest.mark.slow
def test_ctrl_c_while_waiting_stops_the_server(fake_server, tmp_path, monkeypatch):
    started, before, sleep = [], signal.getsignal(signal.SIGTERM), vllm_local.time.sleep

    def interrupted(seconds):  # Ctrl-C while llmft waits for the server to answer (once)
        if started or server.process is None:
            return sleep(seconds)
        started.append(server.process.pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(vllm_local.time, "sleep", interrupted)
    server = VllmServer(
        ["--hang"], command=fake_server, log_path=tmp_path / "log", print_fn=lambda _: None, stop_grace_s=1
    )
    with pytest.raises(KeyboardInterrupt):
        with server:
            pass
    assert started and _gone(started[0])
    assert server.process is None and signal.getsignal(signal.SIGTERM) is before


def test_the_run_summary_reads_vllm_samples_of_both_forms():
    """serving_deploy_mode=vllm's deployment.json in the run summary (llmft pipeline run-local): the LoRA form's base
    and adapter answers, and the merged form's one model."""
    from llmft.components.lib.summary import _deploy_lines

    lora = {"prompt": "q?", "answers": {"m": "A", "m-base": "B"}, "base": "B", "adapter": "A"}
    merged = {"prompt": "q?", "answers": {"m": "A"}, "base": None, "adapter": "A"}
    for sample, base in ((lora, "B"), (merged, "(none: merged form)")):
        deployment = {"status": "served-vllm", "mode": "vllm", "samples": [sample], "manifest": "m.yaml"}
        lines = _deploy_lines({"deployment": deployment})
        assert any(line.endswith(f"base:    {base}") for line in lines), lines
        assert any(line.endswith("adapter: A") for line in lines), lines


def test_deploy_mode_vllm_that_cannot_serve_returns_nothing_deployed(small_adapter, tmp_path, monkeypatch):
    """The deploy step writes deployment.json only from what deploy_promoted returns: a vLLM that cannot start
    raises (one line, exit 1) after the manifest, so nothing is marked deployed."""
    import shutil

    from llmft.components.lib.serving.deployment import deploy_promoted

    monkeypatch.setenv(vllm_local.SERVING_VENV_ENV, str(tmp_path / "no-venv"))
    volume = tmp_path / "vol"
    shutil.copytree(small_adapter, volume / "models" / "m" / "adapter")
    shutil.copytree(small_adapter.parent / "base", volume / "base-models" / "tiny")
    with pytest.raises(VllmRefusedError, match="make serving-venv") as refused:
        deploy_promoted(deploy_request(volume, "adapter", mode="vllm"), manifest_path=tmp_path / "isvc.yaml")
    assert refused.value.exit_code == 1 and "\n" not in str(refused.value)
    assert (tmp_path / "isvc.yaml").is_file()  # the manifest was written and validated first
