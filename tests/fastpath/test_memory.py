"""The memory model (llmft/trainer/sizing/memory.py) on the benchmark's real shapes (transformers config
classes, no weights): it reproduces the GPU peaks measured in benchmarks/results, and the plan it
makes keeps every measured run inside the card with the margin it documents."""

from __future__ import annotations

import pytest

from llmft.trainer.flops import shape_from_config
from llmft.trainer.sizing import memory

GiB = memory.GiB
H100_FREE = 78.5 * GiB  # an 80 GB H100's free memory before a process allocates (79.1 GiB total)


def _setup(model: str, method: str = "lora", **kw) -> memory.Setup:
    from llmft.benchmarks.gpu.common import hf_config

    config = hf_config(model)
    return memory.Setup(
        shape=shape_from_config(config), method=method, tied_embeddings=config.tie_word_embeddings, **kw
    )


PLAIN = dict(varlen=False, fused_loss=False, fused_lora=False, compile=False, lora_dropout=0.05)

# (setup, largest micro batch in tokens, measured peak GiB): benchmarks/results/2026-11-26-{h100,h200}.json
MEASURED = [
    (_setup("qwen2.5-1.5b"), 18447, 46.3),
    (_setup("qwen2.5-1.5b", grouped_lora=False), 18447, 47.6),
    (_setup("qwen2.5-0.5b"), 18447, 23.2),
    (_setup("qwen2.5-0.5b", grouped_lora=False), 34103, 39.9),
    (_setup("llama-3-8b"), 5897, 52.9),
    (_setup("llama-3-8b", grouped_lora=False), 9880, 72.2),
    (_setup("qwen2.5-1.5b", "full"), 9880, 49.3),
    (_setup("qwen2.5-1.5b", "full", zero_stage=3, fused_loss=False, compile=False), 9880, 68.9),
    (_setup("qwen2.5-1.5b", lora_dropout=0.05), 18447, 46.5),  # tuned arm, label dropout-split (H100)
    (_setup("qwen2.5-1.5b", lora_dropout=0.05), 16384, 42.2),  # the shipped config (project-product, H100)
]


# The Qwen3-30B-A3B shape: 48 layers LoRA on one H200 and 4 layers on one H100 (benchmarks/results/
# 2026-11-26-{h200,h100-moe-smoke}.json, transformers' experts, micro batches of 32 / 64 samples); the shipped
# QLoRA config on one H200, training's own peak (2026-12-02-h200.json, issue 46: 4 x 4096 tokens a forward).
MEASURED_MOE = [
    (_setup("qwen3-30b-a3b"), 9880, 110.9),
    (_setup("qwen3-30b-a3b", "qlora", lora_dropout=0.05), 16384, 83.35),
    (_setup("qwen3-30b-a3b-4layers"), 18447, 17.5),
]


def test_the_moe_rows_before_issue_46_differ_by_what_that_code_kept():
    """The same config with the code before issue 46 peaked at 116.35 GiB: per routed row it also kept
    act(gate) and the [S, H] expert output, I_m + H bf16 values more (fastpath/moe_rows.py)."""
    setup = _setup("qwen3-30b-a3b", "qlora", lora_dropout=0.05)
    shape = setup.shape
    extra = shape.moe_layers * shape.experts_per_token * 2 * (shape.moe_intermediate + shape.hidden) * 16384
    estimate = (memory.estimate(setup, 16384).total + extra) / GiB
    assert -0.05 <= estimate / 116.35 - 1 <= 0.03, estimate


@pytest.mark.parametrize("setup, tokens, measured", MEASURED_MOE, ids=lambda v: getattr(v, "method", v))
def test_estimate_reproduces_the_measured_moe_peaks(setup, tokens, measured):
    estimate = memory.estimate(setup, tokens).total / GiB
    assert -0.05 <= estimate / measured - 1 <= 0.03, estimate  # module doc, item 7


def test_a_checkpointed_layer_recomputes_after_the_loss_is_gone():
    """The 4-layer Qwen3-30B-A3B LoRA run with `auto` checkpointing every layer (64 samples, H100): 9.9 GiB.
    Counting the recomputed layer on top of the loss predicted 11.7."""
    estimate = memory.estimate(_setup("qwen3-30b-a3b-4layers"), 18447, checkpointed=4).total / GiB
    assert -0.05 <= estimate / 9.9 - 1 <= 0.03, estimate


def test_moe_weights_count_every_expert_and_the_plan_fits_the_shipped_config():
    """30.5B parameters for the Qwen3-30B-A3B shape (transformers counted 30,545,491,968 with the q/k norms);
    the shipped 1xH100 QLoRA config (4096-token sequences, 32 per step) plans three sequences per forward
    without recomputation on an H100's free memory (four would not fit), six on an H200's (139.2 GiB free at
    the trainer's start, 2026-12-02)."""
    setup = _setup("qwen3-30b-a3b", "qlora", lora_dropout=0.05)
    _, total = memory.parameter_counts(setup.shape, tied=False)
    assert abs(total - 30_545_491_968) / 30_545_491_968 < 1e-3
    plan = memory.plan(setup, free_bytes=H100_FREE, max_length=4096, per_rank_sequences=32)
    assert (plan.micro_sequences, plan.checkpointed_layers) == (3, 0)
    assert memory.estimate(setup, 4 * 4096).total > memory.budget_bytes(H100_FREE)
    h200 = memory.plan(setup, free_bytes=139.2 * GiB, max_length=4096, per_rank_sequences=32)
    assert (h200.micro_sequences, h200.checkpointed_layers) == (6, 0)


@pytest.mark.parametrize("setup, tokens, measured", MEASURED, ids=lambda v: getattr(v, "method", v))
def test_estimate_reproduces_the_measured_peaks(setup, tokens, measured):
    estimate = memory.estimate(setup, tokens).total / GiB
    assert -0.05 <= estimate / measured - 1 <= 0.02, estimate  # the error the module doc states
    # what plan() allows for an estimate still fits the card: estimate <= budget => measured <= free
    assert measured <= (estimate + memory.MARGIN_BYTES / GiB) / (1 - memory.MARGIN_FRACTION)


def test_old_defaults_run_out_at_64_samples_and_fit_at_16():
    """The old defaults on an H100: sdpa, PEFT LoRA with dropout 0.05, plain loss: > 78 GiB at 64 samples, ran at 16."""
    budget = memory.budget_bytes(H100_FREE)
    plain = _setup("qwen2.5-1.5b", **PLAIN)
    assert memory.estimate(plain, 18447).total > H100_FREE
    assert memory.estimate(plain, 5897).total < budget
    fast = _setup("qwen2.5-1.5b", lora_dropout=0.05)
    assert memory.estimate(fast, 18447).total < budget  # the fast path fits 64 samples, dropout and all


def test_activations_are_the_derived_per_token_count():
    """Fast path: b (8H + 3I) per token and layer (Qwen2.5-1.5B: 78,336 bytes); LoRA dropout adds nothing
    (Philox masks, two seed words per linear); the 4-bit path's native dropout adds one mask byte per
    adapted input element (6H + I) uncompiled, nothing compiled (measured); PEFT eager keeps fp32 copies:
    40H + 10I."""
    shape = _setup("qwen2.5-1.5b").shape
    h, i = shape.hidden, shape.intermediate
    assert memory.activation_bytes_per_token(_setup("qwen2.5-1.5b"), 1000) == 2 * (8 * h + 3 * i) == 78336
    assert memory.activation_bytes_per_token(_setup("qwen2.5-1.5b", lora_dropout=0.1), 1000) == 78336
    uncompiled = _setup("qwen2.5-1.5b", compile=False)
    dropout = _setup("qwen2.5-1.5b", compile=False, lora_dropout=0.1)
    assert memory.activation_bytes_per_token(dropout, 1000) == memory.activation_bytes_per_token(uncompiled, 1000)
    uncompiled = _setup("qwen2.5-1.5b", "qlora", compile=False)
    dropout = _setup("qwen2.5-1.5b", "qlora", compile=False, lora_dropout=0.1)
    extra = memory.activation_bytes_per_token(dropout, 1000) - memory.activation_bytes_per_token(uncompiled, 1000)
    assert extra == 6 * h + i
    eager = _setup("qwen2.5-1.5b", **{**PLAIN, "lora_dropout": 0.0})
    assert memory.activation_bytes_per_token(eager, 1000) == 40 * h + 10 * i + 2 * 1000  # + sdpa's T x T bias


def test_plan_fills_the_card_without_recomputation():
    setup = _setup("qwen2.5-1.5b", lora_dropout=0.05)
    plan = memory.plan(setup, free_bytes=H100_FREE, max_length=2048, per_rank_sequences=8)
    assert plan.micro_sequences == 8 and plan.checkpointed_layers == 0
    assert "fit" in plan.micro_why and plan.estimate_gib <= plan.budget_gib
    big = memory.plan(setup, free_bytes=H100_FREE, max_length=2048, per_rank_sequences=64)
    assert 8 < big.micro_sequences < 64 and big.checkpointed_layers == 0
    steps = -(-64 // big.micro_sequences)
    fewer_steps = memory.estimate(setup, -(-64 // (steps - 1)) * 2048).total
    assert fewer_steps > memory.budget_bytes(H100_FREE)  # one micro step less would not have fit
    eight_b = memory.plan(_setup("llama-3-8b"), free_bytes=H100_FREE, max_length=4096, per_rank_sequences=32)
    assert eight_b.micro_sequences >= 1 and eight_b.checkpointed_layers == 0


def test_checkpointing_only_when_one_sequence_does_not_fit_and_on_as_few_layers_as_needed():
    setup = _setup("llama-3-8b")
    plan = memory.plan(setup, free_bytes=H100_FREE, max_length=32768, per_rank_sequences=4)
    assert plan.micro_sequences == 1 and 0 < plan.checkpointed_layers < setup.shape.n_layers
    budget = memory.budget_bytes(H100_FREE)
    assert memory.estimate(setup, 32768, plan.checkpointed_layers).total <= budget
    assert memory.estimate(setup, 32768, plan.checkpointed_layers - 1).total > budget
    assert "fewest" in plan.checkpointing_why


def test_explicit_settings_are_kept():
    setup = _setup("qwen2.5-1.5b")
    plan = memory.plan(setup, free_bytes=H100_FREE, max_length=2048, per_rank_sequences=8, micro=2, checkpointing=True)
    assert plan.micro_sequences == 2 and plan.checkpointed_layers == 28
    assert plan.micro_why == "set by batch.micro_sequences" and plan.checkpointing_why == "set true: every layer"
    forced = memory.plan(setup, free_bytes=H100_FREE, max_length=2048, per_rank_sequences=64, checkpointing=True)
    free = memory.plan(setup, free_bytes=H100_FREE, max_length=2048, per_rank_sequences=64)
    assert forced.micro_sequences > free.micro_sequences  # recomputing every layer leaves room for more tokens
    tight = memory.plan(setup, free_bytes=20 * GiB, max_length=2048, per_rank_sequences=64, checkpointing=False)
    assert tight.checkpointed_layers == 0 and tight.micro_sequences >= 1


def test_micro_batches_stay_even():
    """10 sequences and room for 6 per forward: 2 micro steps of 5 (not 6 + 4)."""
    setup = _setup("qwen2.5-0.5b")
    per_token = memory.estimate(setup, 2 * 1024).total - memory.estimate(setup, 1024).total
    fixed = memory.estimate(setup, 1024).total - per_token
    free_for = lambda n: (fixed + per_token * n + memory.MARGIN_BYTES + 1) / (1 - memory.MARGIN_FRACTION)  # noqa: E731
    plan = memory.plan(setup, free_bytes=free_for(6), max_length=1024, per_rank_sequences=10)
    assert plan.micro_sequences == 5


def test_cpu_plan_is_todays_behaviour():
    assert memory.cpu_plan("auto", "auto", 4).micro_sequences == 1
    assert memory.cpu_plan("auto", "auto", 4).checkpointed_layers == 0
    assert memory.cpu_plan(3, True, 4).micro_sequences == 3 and memory.cpu_plan(3, True, 4).checkpointed_layers == 4


# Full fine-tuning of the Llama-3-8B shape under ZeRO-3 on 4 / 2 H100s (benchmarks/results/
# 2026-11-27-4xh100-scaleout.json): micro batches of 8 samples, the mean micro batch in tokens.
MEASURED_ZERO3 = [
    (dict(world_size=4), 32, 1868, 39.3),  # every layer checkpointed
    (dict(world_size=2), 32, 1917, 69.2),
    (dict(world_size=4), 0, 1868, 61.7),  # no checkpointing: + the gathered bf16 weights (module doc, item 8)
]


@pytest.mark.parametrize("kw, checkpointed, tokens, measured", MEASURED_ZERO3)
def test_estimate_reproduces_the_measured_zero3_full_peaks(kw, checkpointed, tokens, measured):
    setup = _setup("llama-3-8b", "full", zero_stage=3, compile=False, **kw)
    estimate = memory.estimate(setup, tokens, checkpointed).total / GiB
    assert -0.05 <= estimate / measured - 1 <= 0.03, estimate


def test_full_fine_tuning_margin_leaves_the_exact_state_out():
    """8% of the whole card would leave no micro batch beside 67 GiB of ZeRO-3 state on 2 GPUs; the margin
    is taken of what is left beside the state. LoRA's budget is unchanged."""
    full = _setup("llama-3-8b", "full", zero_stage=3, compile=False, world_size=2)
    state = memory.weight_bytes(full)
    assert memory.exact_bytes(full) == state and memory.exact_bytes(_setup("llama-3-8b")) == 0
    budget = memory.budget_bytes(H100_FREE, state)
    assert budget == pytest.approx(state + (H100_FREE - state) * (1 - memory.MARGIN_FRACTION) - memory.MARGIN_BYTES)
    assert memory.budget_bytes(H100_FREE) == H100_FREE * (1 - memory.MARGIN_FRACTION) - memory.MARGIN_BYTES
    assert memory.estimate(full, 4096, 32).total > memory.budget_bytes(H100_FREE)  # the old budget: no room


def test_zero3_full_fine_tuning_takes_a_larger_micro_batch_on_recomputed_layers():
    """Issue 37: the shipped 8B ZeRO-3 config (32 x 4096 tokens a step) on 2 and on 4 H100s. Without
    recomputation not even one sequence fits; the old plan took one sequence on the fewest recomputed layers
    (8 micro steps on 4 GPUs, each gathering every weight twice). The plan takes the micro batch with the
    lowest step cost."""
    two = _setup("llama-3-8b", "full", zero_stage=3, compile=False, world_size=2)
    plan2 = memory.plan(two, free_bytes=H100_FREE, max_length=4096, per_rank_sequences=16)
    assert plan2.micro_sequences > 1 and plan2.checkpointed_layers == 32 and "fastest" in plan2.micro_why
    assert plan2.estimate_gib <= plan2.budget_gib
    four = _setup("llama-3-8b", "full", zero_stage=3, compile=False, world_size=4)
    plan4 = memory.plan(four, free_bytes=H100_FREE, max_length=4096, per_rank_sequences=8)
    assert plan4.micro_sequences == 8 and 0 < plan4.checkpointed_layers < 32
    assert memory.estimate(four, 4096, 0).total > memory.budget_bytes(H100_FREE, memory.exact_bytes(four))
    fewest = memory.plan(four, free_bytes=H100_FREE, max_length=4096, per_rank_sequences=8, micro=1)
    cost = lambda n, k: memory.step_cost(four, n, k, 8, 4096)  # noqa: E731
    assert fewest.checkpointed_layers < plan4.checkpointed_layers  # one sequence would recompute fewer layers,
    assert cost(8, plan4.checkpointed_layers) < cost(1, fewest.checkpointed_layers)  # but 8 micro steps' gathers


def test_ddp_keeps_the_old_plan_one_sequence_on_the_fewest_layers():
    """DDP reduces once a step (no fixed cost per micro step): when nothing fits without recomputation the
    plan is one sequence on the fewest checkpointed layers, never a larger micro batch recomputing more."""
    setup = _setup("llama-3-8b")
    assert memory.step_cost(setup, 1, 0, 4, 32768) == 4 * 32768
    plan = memory.plan(setup, free_bytes=H100_FREE, max_length=32768, per_rank_sequences=4)
    assert plan.micro_sequences == 1 and "does not fit without recomputation" in plan.micro_why
    zero3 = _setup("llama-3-8b", zero_stage=3, world_size=2)
    assert memory.step_cost(zero3, 1, 0, 4, 32768) - memory.step_cost(zero3, 4, 0, 4, 32768) == pytest.approx(
        3 * memory.ZERO3_MICRO_STEP_TOKENS
    )
