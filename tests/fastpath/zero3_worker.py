"""One rank of the ZeRO-3 fused-loss check (run by test_zero3_fused_loss.py through torchrun, CPU/gloo).

DeepSpeed ZeRO-3 with ``stage3_param_persistence_threshold=0`` partitions every weight, the
(tied) lm_head included. The same packed batch goes through the trainer's plain loss
(``trainer.loss.token_nll_sum``) and the fused one (``trainer.loss.fused_token_nll_sum``, which
gathers the head); rank 0 writes both losses, every trainable parameter's full gradient for
each, and whether the head really was a partition (empty on this rank) before the loss. LoRA
(frozen head) and full fine-tuning (trained, tied head) run one after the other.

python -m torch.distributed.run --nproc-per-node 2 tests/fastpath/zero3_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist


def _model(method: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="llmft_varlen",
    )
    if method == "full-untied":  # the Llama shape: its lm_head is a weight of its own
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False)).float()
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).float()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, lora)
    return model


def _batch(vocab: int) -> dict:
    from llmft.trainer.data.loader import MicroBatch, shift_targets
    from llmft.trainer.data.shards import position_ids_for

    lengths = np.array([7, 12, 5])
    rng = np.random.default_rng(dist.get_rank())  # each rank its own data, as in training
    ids = rng.integers(0, vocab, size=int(lengths.sum()))
    labels = ids.copy()
    labels[:3] = -100
    positions = position_ids_for(lengths)
    return MicroBatch(ids, positions, shift_targets(labels, positions), lengths).to_torch(torch.device("cpu"))


def _grads(engine, model) -> dict:
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad}


def check(method: str) -> dict:
    from llmft.trainer.distributed import import_deepspeed
    from llmft.trainer.loss import fused_token_nll_sum, token_nll_sum

    deepspeed = import_deepspeed()
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": dist.get_world_size(),
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    model = _model(method)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, dist_init_required=False)
    batch = _batch(97)
    head = model.get_output_embeddings()
    partitioned = head.weight.numel() == 0 and hasattr(head.weight, "ds_id")
    result = {"partitioned_head": partitioned, "head_trained": head.weight.requires_grad}
    for name, loss_fn in (("plain", token_nll_sum), ("fused", fused_token_nll_sum)):
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        result[name] = {"loss": float(loss), "grads": {k: v.tolist() for k, v in _grads(engine, model).items()}}
        engine.optimizer.zero_grad()
    result["head_partitioned_after"] = head.weight.numel() == 0
    return result


# the untied model first: DeepSpeed's first engine leaves torch.nn.functional.linear patched
# (zero3_linear_wrap, "This will persist unless manually reset"), which changes how later models'
# plain heads run; the trainer builds one model per process, under that patch from the start
METHODS = ("full-untied", "lora", "full")


def main(out: str) -> None:
    import llmft.trainer.fastpath  # noqa: F401 - registers llmft_varlen

    dist.init_process_group("gloo")
    results = {method: check(method) for method in METHODS}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
