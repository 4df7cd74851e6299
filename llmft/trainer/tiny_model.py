"""Build a tiny, offline, Hugging Face-format causal LM for tests and the demo.

``llmft dev tiny-model --output DIR`` trains a byte-level BPE tokenizer with the
``tokenizers`` library on text generated from word lists shipped here, gives it
a ChatML chat template (the Qwen2.5 family's format), and saves a random-init
Qwen2 model (~2 M parameters) as safetensors. Everything that loads a model in
this project (``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``) then
works unchanged on a hub id, a downloaded snapshot, or this directory.
"""

from __future__ import annotations

import random
from pathlib import Path

from llmft.trainer.io import atomic_directory, check_output_target

TINY_MODEL_KIND = "tiny-model"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_SUBJECTS = (
    "the model|a student|the cluster|our team|the pipeline|a user|the operator|the scheduler|this adapter|the dataset"
).split("|")
_VERBS = "trains|reads|writes|checks|explains|summarizes|answers|packs|evaluates|deploys|tokenizes|improves".split("|")
_OBJECTS = (
    "the question|a short story|every checkpoint|the validation split|a poem about rivers|the loss curve|"
    "three numbers|the recipe|a list of colors|the weather report|an email to a friend|the GPU memory"
).split("|")
_TAILS = (
    "quickly.|with care.|before lunch.|in two steps.|on eight GPUs.|without padding.|again and again.|"
    "for the first time.|in plain English.|as fast as it can."
).split("|")
_QUESTIONS = (
    "What is the capital of France?|How do I sort a list in Python?|Name three primary colors.|"
    "Why is the sky blue?|Give me a synonym for happy.|Translate hello to Spanish.|What is two plus two?|"
    "Write a haiku about autumn.|Explain gradient descent briefly.|What does a GPU do?"
).split("|")
_ANSWERS = (
    "Paris is the capital of France.|Use the sorted function or list.sort().|Red, blue and yellow.|"
    "Sunlight scatters off air molecules, and blue light scatters most.|Joyful.|Hola.|Four.|"
    "Red leaves drift and fall, the cold wind hums a soft song, the year turns to rest.|"
    "It moves the weights a small step against the gradient of the loss.|It runs many arithmetic operations in "
    "parallel."
).split("|")


def corpus_lines(n: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic English-like text used to train the tiny tokenizer."""
    rng = random.Random(seed)
    lines = [f"{q} {a}" for q, a in zip(_QUESTIONS, _ANSWERS, strict=True)]
    for _ in range(n):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_TAILS)]
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + f" {rng.randint(0, 999)}")
    return lines


def build_tokenizer(vocab_size: int = 4096):
    """A byte-level BPE fast tokenizer with ChatML special tokens and chat template."""
    # heavy: tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # heavy: transformers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, *, hidden_size: int = 128, layers: int = 4, seed: int = 0):
    """A random-init Qwen2 causal LM sized for CPU tests (about 1.5-2 M parameters)."""
    # heavy: torch
    import torch

    # heavy: transformers
    from transformers import AutoModelForCausalLM, Qwen2Config

    vocab = ((len(tokenizer) + 63) // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def build_tiny_model(output: str | Path, *, seed: int = 0, force: bool = False) -> Path:
    """Build tokenizer + model and save both atomically to ``output``.

    ``output`` may be absent, empty or an earlier tiny model; anything else is refused unless
    ``force`` (:func:`llmft.trainer.io.check_output_target`), before any work is done."""
    output = Path(output)
    check_output_target(output, kind=TINY_MODEL_KIND, force=force)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed)
    with atomic_directory(output, kind=TINY_MODEL_KIND, force=force) as tmp:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
    return output


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
