"""``serving_deploy_mode=local`` (kfp.local only): the fine-tuned model against its base, with transformers on CPU.

:func:`local_generation_check` loads the base model as the trainer loads it (an FP8 base dequantized:
``llmft.trainer.fp8.load_base_model``) and the adapter on it, or, for the merged serving form, the
merged model beside it; both answer a few prompts greedily, and an adapter that moves no logit fails
the check (:class:`AdapterHasNoEffectError`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import NamedTuple, cast

from llmft.trainer.cpu_threads import decode_threads
from llmft.trainer.errors import ConfigError, LlmftError
from llmft.trainer.model_dir import check_model_files
from llmft.trainer.tokenizer import load_tokenizer


class AdapterHasNoEffectError(LlmftError):
    """Base model and base + adapter give the same logits: the adapter is empty or not applied."""


class GenerationSample(NamedTuple):
    """One prompt's greedy completion by the base model and by base + adapter."""

    prompt: str
    base_text: str
    adapter_text: str


def local_generation_check(
    base_model_path: str,
    adapter_path: str,
    prompts: Sequence[str],
    *,
    merged_path: str | None = None,
    max_new_tokens: int = 16,
    min_logit_diff: float = 1e-5,
) -> list[GenerationSample]:
    """Load base + adapter (or, with ``merged_path``, the merged model beside the base) with
    transformers/peft on CPU, generate greedily for each prompt (rendered with the chat template) with
    and without the adapter, and raise ``AdapterHasNoEffectError`` when the adapter moves no logit of
    the prompt by more than ``min_logit_diff``: texts alone can agree on a tiny model even when the
    adapter works. The base loads as the trainer loads it (an FP8 base dequantized:
    ``llmft.trainer.fp8.load_base_model``); beside a merged model its weights are first rounded to the
    merged model's dtype, so an adapter that changes nothing gives the very same logits."""
    import torch  # heavy: torch

    if not prompts:
        raise ConfigError("local_generation_check: give at least one prompt")
    tokenizer = _check_tokenizer(base_model_path, merged_path or adapter_path)
    base_model, tuned, as_base = _check_models(base_model_path, adapter_path, merged_path)
    samples, largest_diff = [], 0.0
    for prompt in prompts:
        text = prompt
        if tokenizer.chat_template:
            text = cast(
                str,  # tokenize=False: the rendered text
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                ),
            )
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad(), as_base():
            base_logits = base_model(**inputs).logits
            base_ids = _greedy(base_model, tokenizer, inputs, max_new_tokens)
        with torch.no_grad():
            adapter_logits = tuned(**inputs).logits
            adapter_ids = _greedy(tuned, tokenizer, inputs, max_new_tokens)
        largest_diff = max(largest_diff, (adapter_logits - base_logits).abs().max().item())
        samples.append(
            GenerationSample(
                prompt,
                cast(str, tokenizer.decode(base_ids, skip_special_tokens=True)),  # one sequence: one text
                cast(str, tokenizer.decode(adapter_ids, skip_special_tokens=True)),
            )
        )
    if largest_diff <= min_logit_diff:
        raise AdapterHasNoEffectError(
            f"adapter {adapter_path} changes nothing: the largest logit difference from base model "
            f"{base_model_path} over {len(prompts)} prompt(s) is {largest_diff:.3g} (<= {min_logit_diff}). "
            "Its LoRA B matrices are probably all zero: was it trained (max_steps > 0, a learning rate > 0)?"
        )
    return samples


def _check_tokenizer(base_model_path: str, tuned_path: str):
    """The tokenizer saved beside the adapter or the merged model (with the chat template it was trained
    on), else the base model's (read by the project's one loader, llmft/trainer/tokenizer.py)."""
    has_own_tokenizer = os.path.isfile(os.path.join(tuned_path, "tokenizer_config.json"))
    return load_tokenizer(tuned_path if has_own_tokenizer else base_model_path, field="model")


def _check_models(base_model_path: str, adapter_path: str, merged_path: str | None):
    """(model answering as the base, the fine-tuned model, context in which the first is the base), in float32.
    Damaged files are named in one line before anything loads (the trainer's one rule, model_dir.py)."""
    check_model_files(base_model_path, what="model")
    check_model_files(merged_path or adapter_path, what="model" if merged_path else "adapter")

    import torch  # heavy: torch

    from llmft.trainer.fp8 import load_base_model  # heavy: torch

    if merged_path is None:
        base = load_base_model(base_model_path, None, "lora", {"dtype": torch.float32})
        from peft import PeftModel  # heavy: peft

        model = PeftModel.from_pretrained(base, adapter_path).eval()
        return model, model, model.disable_adapter
    from transformers import AutoModelForCausalLM  # heavy: transformers

    from llmft.trainer.fp8_format import read_model_config  # heavy: torch

    stored = getattr(torch, str(read_model_config(merged_path).get("dtype") or "float32"))
    base = load_base_model(base_model_path, None, "lora", {"dtype": stored}).float().eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_path, dtype=torch.float32).eval()
    return base, merged, contextlib.nullcontext


def _greedy(model, tokenizer, inputs, max_new_tokens: int):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with decode_threads(inputs["input_ids"].device):  # llmft/trainer/cpu_threads.py
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return out[0, inputs["input_ids"].shape[1] :]
