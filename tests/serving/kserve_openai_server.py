"""KServe's own OpenAI server, run in the serving venv for tests/serving/test_kserve_openai.py.

Real: the installed ``kserve`` package (0.21.0, tools/kserve-openai-requirements.txt): ``ModelServer``,
its ``ModelRepository``, the REST server and the OpenAI routes and dataplane
(``kserve/protocol/rest/openai/endpoints.py``, ``dataplane.py``, ``config.py``), on loopback through
uvicorn. The model is registered the way KServe's Hugging Face runtime registers it (kserve v0.20.0
``python/huggingfaceserver/huggingfaceserver/__main__.py`` 330-337)::

    model_server = kserve.ModelServer()
    model = load_model()
    if is_vllm_backend_enabled(args, model_id_or_path):
        if args.lora_modules:
            for lora_module in args.lora_modules:
                model_server.register_model(model, lora_module.name)
    model_server.start([model])

(``--lora-modules`` parsed by vLLM's own ``LoRAParserAction`` as the runtime parses it;
``registers_lora_names: false`` drops that loop, as v0.15.0 had none: kserve#4345).

Stand-in: :class:`StandInEngine` takes the place of the runtime's ``VLLMModel``
(``python/huggingfaceserver/huggingfaceserver/vllm/vllm_model.py`` v0.20.0): it is an
``OpenAIGenerativeModel`` named ``--model_name`` (``__main__.py`` ``load_model``) whose completion is
what vLLM's ``OpenAIServingCompletion`` answers: ``model`` = the LoRA name for a request of a LoRA name,
else the first base name (``vllm/entrypoints/openai/completion/serving.py`` 218 with
``models/serving.py`` 144-147, vLLM 0.32), text and token logprobs fixed per model instead of generated.

Adjustments, none in the routing: kserve 0.21.0 is written against vLLM 0.24, where ``DeltaMessage``,
``UsageInfo``, ``ModelCard`` and ``ModelList`` live in ``vllm.entrypoints.openai.engine.protocol``; vLLM 0.32
moved them (``vllm.entrypoints.serve.engine.protocol``, ``vllm.entrypoints.generate.base.protocol``):
:func:`alias_moved_vllm_protocol` puts that one module path back over the same classes. KServe's REST server
binds 0.0.0.0 (``protocol/rest/server.py`` 125-138); here uvicorn's host is set to 127.0.0.1.

Usage: ``python kserve_openai_server.py '<json>'`` with ``{"port", "args": [runtime args],
"registers_lora_names": bool}``.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import types

MOVED_IN_VLLM_0_32 = {
    "vllm.entrypoints.chat_utils": "vllm.renderers.chat_utils",
}
"""Module paths kserve 0.21.0 imports (vLLM 0.24) -> the module that holds the same names in the serving venv's
vLLM 0.32."""


def alias_moved_vllm_protocol() -> None:
    """The vLLM 0.24 module paths kserve 0.21.0 imports, over the same classes' homes in the installed vLLM."""
    for old, new in MOVED_IN_VLLM_0_32.items():
        try:
            importlib.import_module(old)
        except ModuleNotFoundError:
            sys.modules[old] = importlib.import_module(new)
    name = "vllm.entrypoints.openai.engine.protocol"  # split in two in 0.32
    try:
        importlib.import_module(name)
        return
    except ModuleNotFoundError:
        pass
    serve = importlib.import_module("vllm.entrypoints.serve.engine.protocol")
    generate = importlib.import_module("vllm.entrypoints.generate.base.protocol")
    package = types.ModuleType("vllm.entrypoints.openai.engine")
    package.__path__ = []
    module = types.ModuleType(name)
    for attr in ("UsageInfo", "ModelCard", "ModelList"):
        setattr(module, attr, getattr(serve, attr))
    module.DeltaMessage = generate.DeltaMessage
    package.protocol = module
    sys.modules[package.__name__], sys.modules[name] = package, module


def runtime_args(argv: list[str]):
    """The runtime's ``--model_name`` and ``--lora-modules``, the latter parsed by vLLM's own action."""
    import argparse

    from vllm.entrypoints.launchers.cli_args import LoRAParserAction  # vLLM 0.24: vllm.entrypoints.openai.cli_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="model")
    parser.add_argument("--lora-modules", nargs="+", action=LoRAParserAction, default=None)
    return parser.parse_known_args(argv)[0]


ANSWERS = {"base": (" Lyon", [-1.0, -0.5]), "adapter": (" Paris.", [-0.1, -0.2])}
UNCHANGED = "An adapter that changes nothing:"
"""A prompt starting with this is answered by the adapter exactly as by the base (an adapter that changes
nothing), so one server holds both cases."""


def main(config: dict) -> None:
    alias_moved_vllm_protocol()
    import kserve
    from kserve.protocol.rest import server as rest_server
    from kserve.protocol.rest.openai import OpenAIGenerativeModel
    from kserve.protocol.rest.openai.types import Completion, CompletionChoice, CompletionLogProbs, UsageInfo

    args = runtime_args(config["args"])
    lora_names = [m.name for m in args.lora_modules or []]

    class StandInEngine(OpenAIGenerativeModel):
        """vLLM's engine behind the runtime's VLLMModel: the answer's ``model`` as vLLM sets it."""

        async def create_completion(self, request, raw_request=None, context=None):
            lora = request.model in lora_names and request.model != self.name  # base names first (0.8.5/0.9.2)
            kind = "adapter" if lora and not str(request.prompt).startswith(UNCHANGED) else "base"
            text, logprobs = ANSWERS[kind]
            return Completion(
                id=f"cmpl-{int(time.time() * 1000)}",
                created=int(time.time()),
                model=request.model if lora else self.name,
                choices=[
                    CompletionChoice(
                        index=0,
                        text=text,
                        logprobs=CompletionLogProbs(token_logprobs=logprobs),
                        finish_reason="length",
                    )
                ],
                usage=UsageInfo(prompt_tokens=3, completion_tokens=len(logprobs), total_tokens=3 + len(logprobs)),
            )

        async def create_chat_completion(self, request, raw_request=None, context=None):
            raise NotImplementedError("the smoke test on KServe asks /completions")

    init = rest_server.RESTServer.__init__

    def on_loopback(self, *a, **kw):
        init(self, *a, **kw)
        self.config.host = "127.0.0.1"

    rest_server.RESTServer.__init__ = on_loopback
    model_server = kserve.ModelServer(http_port=config["port"], enable_grpc=False, workers=1)
    model = StandInEngine(args.model_name)
    if config.get("registers_lora_names", True) and args.lora_modules:  # huggingfaceserver __main__.py 332-336
        for lora_module in args.lora_modules:
            model_server.register_model(model, lora_module.name)
    model_server.start([model])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
