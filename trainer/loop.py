"""Helpers shared by the method entry files (lora_finetune.py, full_finetune.py).

:func:`train_loop` is the training loop itself, top to bottom: per step, every
micro batch's forward and backward, one optimizer step (skipped on the device
when the loss or gradient norm is non-finite on any rank), then logging,
evaluation, checkpointing and the preemption check. Host syncs happen only at
log, eval and save steps; the per-step stop check is a CPU-only gloo collective.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from llmft.trainer import checkpoint as ckpt
from llmft.trainer.data.loader import PackedLoader, StepBatch
from llmft.trainer.distributed import (
    DistInfo,
    Engine,
    all_reduce_sum,
    any_rank,
    barrier,
    close_distributed,
    ranks_with_flag,
)
from llmft.trainer.errors import EXIT_PREEMPTED, LlmftError
from llmft.trainer.evaluate import evaluate_model
from llmft.trainer.io import atomic_write_json
from llmft.trainer.observe import Observer, peak_flops, summary_screen, train_flops


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint was committed. The process exits 143 (retryable)."""

    exit_code = EXIT_PREEMPTED


class TrainingAborted(LlmftError):
    """Too many consecutive non-finite steps (exit 1: permanent)."""


@dataclass
class RunState:
    cfg: object
    config_dict: dict
    info: DistInfo
    engine: Engine
    loader: PackedLoader
    observer: Observer
    loss_fn: object
    autocast_ctx: object
    lora: bool
    total_steps: int
    dataset_key: str
    flops: dict  # method, matmul_params, adapter_params, layers, attn_width
    start_step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    wall_time_before: float = 0.0
    best: dict = field(default_factory=dict)
    eval_history: list = field(default_factory=list)
    last_train_loss: float = float("nan")
    last_tokens_per_s: float = float("nan")
    last_eval: dict = field(default_factory=dict)


class _DeviceCounters:
    """Per-step bookkeeping kept on the device so that nothing syncs between log steps."""

    def __init__(self, device, skipped: int = 0):
        z = lambda v, dt=torch.float32: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
        self.streak, self.hit_step, self.hit_local = z(0, torch.int64), z(-1, torch.int64), z(False, torch.bool)
        self.skipped = z(skipped, torch.int64)
        self.loss_sum, self.good_steps, self.grad_norm = z(0.0), z(0.0), z(0.0)

    def update(self, step: int, global_loss, grad_norm, bad, local_bad, max_bad: int) -> None:
        self.streak = (self.streak + 1) * bad
        hit = (self.streak >= max_bad) & (self.hit_step < 0)
        self.hit_step = torch.where(hit, step, self.hit_step)
        self.hit_local = torch.where(hit, local_bad, self.hit_local)
        self.skipped += bad
        good = ~bad
        self.loss_sum += torch.where(good, global_loss.float(), 0.0)
        self.good_steps += good.float()
        self.grad_norm = grad_norm.float()


STOP = threading.Event()  # set by SIGTERM, read once per step


def install_sigterm_handler() -> None:
    """SIGTERM -> finish the current step, commit a checkpoint, exit 143 (even when it
    arrives while the model is still loading: the first step then stops)."""
    STOP.clear()
    signal.signal(signal.SIGTERM, lambda signum, frame: STOP.set())


def forward_backward(run: RunState, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """All micro batches of this rank: loss = token-NLL sum / global target count (x world size,
    since the engines average gradients over ranks). Returns (local NLL sum, local non-finite)."""
    info, engine, cfg = run.info, run.engine, run.cfg
    scale = info.world_size / max(batch.global_targets, 1)
    poison = batch.step in cfg.debug.nan_steps and cfg.debug.nan_rank in (-1, info.rank)
    local = torch.zeros((), dtype=torch.float32, device=info.device)
    last = len(batch.micro_batches) - 1
    for i, micro in enumerate(batch.micro_batches):
        tensors = micro.to_torch(info.device, pin=info.device.type == "cuda")
        with engine.accumulating(last=i == last):
            with run.autocast_ctx():
                nll = run.loss_fn(engine.wrapped, tensors)
            if poison:
                nll = nll * float("nan")
            if batch.step == cfg.debug.sigterm_at_step and i == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            engine.backward(nll * scale)
        local += nll.detach().float()
    return local, ~torch.isfinite(local)


@contextlib.contextmanager
def scheduled_gc(every: int):
    """Python's automatic garbage collector off during training (a collection of the many
    objects compile and the model leave behind may stall one step: the single slow steps of
    benchmarks/NOTES.md entry 15 did not recur with this on, entry 21); :func:`collect_garbage`
    collects young objects every ``every`` steps instead. ``every`` 0 leaves it automatic."""
    if every <= 0:
        yield
        return
    gc.collect()
    gc.freeze()  # what exists now (model, compiled code) is never scanned again
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def collect_garbage(step: int, every: int) -> None:
    if every > 0 and step % every == 0:
        gc.collect(1)


def train_loop(run: RunState) -> None:
    with scheduled_gc(run.cfg.gc_every):
        _train_steps(run)


def _train_steps(run: RunState) -> None:
    cfg, info, engine = run.cfg, run.info, run.engine
    counters = _DeviceCounters(info.device, skipped=run.skipped_steps)
    window = {"t": time.perf_counter(), "tokens": 0, "flops": 0.0, "steps": 0, "lr": 0.0}
    peak = peak_flops(info.device, cfg.observe.peak_tflops)
    t_start = time.perf_counter()
    engine.train()
    for batch in run.loader.iter_steps(run.start_step + 1, run.total_steps):
        step = batch.step
        window["lr"] = engine.optimizer.param_groups[0]["lr"]  # the LR this step uses
        local_sum, local_bad = forward_backward(run, batch)
        global_loss = all_reduce_sum(local_sum.clone()) / max(batch.global_targets, 1)
        grad_norm, bad = engine.step(global_loss)
        counters.update(step, global_loss, grad_norm, bad, local_bad, cfg.max_bad_steps)
        run.tokens_seen += batch.global_tokens
        window["tokens"] += batch.global_tokens
        window["steps"] += 1
        window["flops"] += train_flops(tokens=batch.global_tokens, attn_sq=batch.global_attn_sq, **run.flops)
        if step == cfg.debug.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        stop = any_rank(STOP.is_set())
        final = step == run.total_steps
        if step % cfg.log_every == 0 or final or stop:
            _log_step(run, step, counters, window, peak, engine)
            _check_bad_streak(run, counters)
        evaluated = (cfg.eval_every and step % cfg.eval_every == 0) or final
        if evaluated:
            _evaluate(run, step)
        if (cfg.save_every and step % cfg.save_every == 0) or final or stop:
            _save(run, step, time.perf_counter() - t_start, evaluated)
        run.observer.progress(1, loss=run.last_train_loss, tokens_per_s=run.last_tokens_per_s)
        collect_garbage(step, cfg.gc_every)
        if stop and not final:
            run.observer.info(f"SIGTERM: checkpoint step-{step} committed; exiting {EXIT_PREEMPTED}")
            raise Preempted(step)
    run.wall_time_before += time.perf_counter() - t_start


def _log_step(run: RunState, step: int, counters: _DeviceCounters, window: dict, peak, engine) -> None:
    """The only per-interval host sync: read the device counters."""
    good = counters.good_steps.item()
    run.last_train_loss = counters.loss_sum.item() / good if good else float("nan")
    run.skipped_steps = int(counters.skipped.item())
    dt = max(time.perf_counter() - window["t"], 1e-9)
    metrics = {
        "loss": run.last_train_loss,
        "lr": window["lr"],
        "grad_norm": counters.grad_norm.item(),
        "tokens_per_s": window["tokens"] / dt,
        "tokens_per_s_per_device": window["tokens"] / dt / run.info.world_size,
        "skipped_steps": run.skipped_steps,
        "tokens_seen": run.tokens_seen,
    }
    if peak:
        metrics["mfu"] = window["flops"] / (dt * peak * run.info.world_size)
    metrics.update(_memory_metrics(run.info.device))
    run.last_tokens_per_s = metrics["tokens_per_s"]
    counters.loss_sum.zero_()
    counters.good_steps.zero_()
    window.update(t=time.perf_counter(), tokens=0, flops=0.0, steps=0)
    run.observer.log_train(step, metrics)


def _memory_metrics(device) -> dict:
    if device.type == "cuda":
        return {
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    import resource

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _check_bad_streak(run: RunState, counters: _DeviceCounters) -> None:
    hit_step = int(counters.hit_step.item())
    if hit_step < 0:
        return
    ranks = ranks_with_flag(counters.hit_local, run.info)
    where = f"on rank(s) {ranks}" if ranks else "in the gradients (all-reduced over every rank)"
    raise TrainingAborted(
        f"step {hit_step}: {run.cfg.max_bad_steps} consecutive steps with a non-finite loss or gradient norm "
        f"(non-finite loss {where}); updates were skipped, stopping. Lower optim.lr, check the data, "
        "or raise max_bad_steps."
    )


def _evaluate(run: RunState, step: int) -> None:
    cfg = run.cfg
    metrics = evaluate_model(
        run.engine.module if run.engine.backend == "ddp" else run.engine.wrapped,
        cfg.data,
        split=cfg.eval.split,
        micro_sequences=cfg.eval.micro_sequences,
        max_sequences=cfg.eval.max_sequences,
        info=run.info,
        loss_fn=run.loss_fn,
        autocast_ctx=run.autocast_ctx,
    )
    run.engine.train()
    run.last_eval = {**metrics, "step": step}
    run.eval_history.append(run.last_eval)
    if not run.best or metrics["eval_loss"] < run.best["eval_loss"]:
        run.best = dict(run.last_eval)
    run.observer.log_eval(step, metrics)


def _state(run: RunState, step: int, wall: float, evaluated: bool) -> dict:
    epoch, pos = divmod(step, run.loader.steps_per_epoch)
    return {
        "step": step,
        "total_steps": run.total_steps,
        "epoch": epoch,
        "data_position": {
            "epoch": epoch,
            "step_in_epoch": pos,
            "sequences_consumed": step * run.loader.global_sequences,
        },
        "tokens_seen": run.tokens_seen,
        "skipped_steps": run.skipped_steps,
        "train_loss": run.last_train_loss,
        "eval": run.last_eval if evaluated else None,
        "best": run.best,
        "eval_history": run.eval_history,
        "world_size": run.info.world_size,
        "dataset_cache_key": run.dataset_key,
        "wall_time_s": run.wall_time_before + wall,
        "mlflow_run_id": run.observer.mlflow_run_id,
    }


def _save(run: RunState, step: int, wall: float, evaluated: bool) -> None:
    ckpt.save_checkpoint(
        run.cfg.output_dir,
        step,
        engine=run.engine,
        info=run.info,
        lora=run.lora,
        state=_state(run, step, wall, evaluated),
        config=run.config_dict,
    )
    if run.info.is_main:
        ckpt.prune_checkpoints(run.cfg.output_dir, run.cfg.keep_last, _best_checkpoint_step(run))
    barrier()


def _best_checkpoint_step(run: RunState) -> int | None:
    """The checkpoint with the lowest eval loss measured at its own step."""
    scored = []
    for step, path in ckpt.complete_checkpoints(run.cfg.output_dir):
        evaluation = ckpt.read_state(path).get("eval")
        if evaluation:
            scored.append((evaluation["eval_loss"], step))
    return min(scored)[1] if scored else None


def resume(run: RunState, path: Path) -> str | None:
    """Restore a checkpoint into ``run`` (weights, optimizer, scheduler, RNG, counters);
    returns the MLflow run id to continue."""
    state = ckpt.load_checkpoint(path, engine=run.engine, info=run.info, lora=run.lora)
    run.start_step = int(state["step"])
    run.tokens_seen = int(state.get("tokens_seen", 0))
    run.skipped_steps = int(state.get("skipped_steps", 0))
    run.best = state.get("best") or {}
    run.eval_history = state.get("eval_history") or []
    run.last_eval = state.get("eval") or (run.eval_history[-1] if run.eval_history else {})
    run.last_train_loss = state.get("train_loss", float("nan"))
    run.wall_time_before = float(state.get("wall_time_s", 0.0))
    return state.get("mlflow_run_id")


def save_now(run: RunState, step: int) -> None:
    """Checkpoint the current state as step-<step> (all ranks)."""
    _save(run, step, 0.0, evaluated=False)


def write_final(run: RunState, tokenizer, base_identity: dict) -> Path:
    """output_dir/final/: weights, tokenizer + chat template, generation config, training_manifest.json."""
    from llmft.trainer.model import save_tokenizer_and_generation

    final = Path(run.cfg.output_dir) / "final"
    staging = final.with_name(".final.partial")
    if run.info.is_main:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    ckpt.save_weights(run.engine, staging, lora=run.lora, info=run.info)
    if run.info.is_main:
        save_tokenizer_and_generation(run.engine.module, tokenizer, staging)
        atomic_write_json(staging / "training_manifest.json", manifest(run, base_identity))
        ckpt.commit_directory(staging, final)
    barrier()
    return final


def manifest(run: RunState, base_identity: dict) -> dict:
    import peft
    import transformers

    final_metrics = {
        "train_loss": run.last_train_loss,
        **{k: run.last_eval.get(k) for k in ("eval_loss", "perplexity", "tokens")},
    }
    return {
        "base_model": base_identity,
        "method": run.cfg.method,
        "dataset": {"path": str(run.cfg.data), "cache_key": run.dataset_key},
        "config": run.config_dict,
        "final_metrics": final_metrics,
        "best": run.best,
        "eval_history": run.eval_history,
        "steps": run.total_steps,
        "skipped_steps": run.skipped_steps,
        "tokens_seen": run.tokens_seen,
        "wall_time_s": run.wall_time_before,
        "world_size": run.info.world_size,
        "mlflow_run_id": run.observer.mlflow_run_id,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def finish(run: RunState, final_dir: Path, base_identity: dict) -> dict:
    """Summary screen, MLflow artifacts, Langfuse trace."""
    summary = {
        "status": "finished",
        "method": run.cfg.method,
        "base_model": base_identity.get("name_or_path"),
        "steps": run.total_steps,
        "skipped_steps": run.skipped_steps,
        "tokens_seen": run.tokens_seen,
        "wall_time_s": run.wall_time_before,
        "tokens_per_s": run.tokens_seen / max(run.wall_time_before, 1e-9),
        "final_metrics": {"train_loss": run.last_train_loss, **run.last_eval},
        "best": run.best,
        "final_dir": str(final_dir),
        "config": run.config_dict,
    }
    run.observer.event("final", run.total_steps, {k: v for k, v in summary.items() if isinstance(v, int | float)})
    run.observer.finish(summary, final_dir)
    if run.info.is_main:
        print(summary_screen(summary), flush=True)
    return summary


# ----------------------------------------------------------------------------- set-up helpers


def close_run(run: RunState | None) -> None:
    """Close the loader and the sinks, then the process group. A preempted or failed run's
    MLflow run is left open so the resumed run continues it."""
    if run is not None:
        run.loader.close()
        if run.observer is not None:
            run.observer.close_interrupted()
    close_distributed()


def seed_all(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_data(cfg, info: DistInfo) -> tuple[dict, PackedLoader, int]:
    """(dataset manifest, this rank's loader, total steps); DataError when the data is unusable."""
    from llmft.trainer.data.loader import dataset_info, resolve_global_sequences
    from llmft.trainer.errors import DataError

    manifest = dataset_info(cfg.data)
    for split in ("train", cfg.eval.split):
        if not (Path(cfg.data) / split / "input_ids.npy").is_file():
            raise DataError(
                f"{Path(cfg.data) / split}: split missing from the tokenized dataset "
                f"(re-run `llmft data tokenize`, or set eval.split)"
            )
    sequences = resolve_global_sequences(
        cfg.batch.global_sequences, cfg.batch.global_tokens, int(manifest["max_length"])
    )
    loader = PackedLoader(
        cfg.data,
        "train",
        global_sequences=sequences,
        micro_sequences=cfg.batch.micro_sequences,
        rank=info.rank,
        world_size=info.world_size,
        seed=cfg.seed,
    )
    return manifest, loader, loader.total_steps(cfg.max_steps, cfg.epochs)


def choose_resume(cfg, info: DistInfo, config_dict: dict, dataset_key: str) -> Path | None:
    """Rank 0 picks the checkpoint and checks it matches; every rank gets the same answer."""
    from llmft.trainer.distributed import broadcast_object
    from llmft.trainer.errors import ConfigError

    path = error = None
    diffs: list[str] = []
    if info.is_main:
        try:
            path = ckpt.find_resume_checkpoint(cfg.resume, cfg.output_dir)
            if path is not None:
                diffs = ckpt.check_compatible(path, config_dict, dataset_key, cfg.force_resume)
        except LlmftError as exc:
            error = str(exc)
    path, error, diffs = broadcast_object((path, error, diffs))
    if error:
        raise ConfigError(error)
    if diffs and info.is_main:
        print("[llmft] force_resume=true: resuming although these differ:\n  " + "\n  ".join(diffs), flush=True)
    return path


def align_chat_template(tokenizer, manifest: dict) -> None:
    """Ship the chat template the data was tokenized with (it is what serving must use)."""
    template = manifest.get("chat_template")
    if template and getattr(tokenizer, "chat_template", None) != template:
        tokenizer.chat_template = template


def build_run(cfg, info: DistInfo, *, lora: bool, autocast_ctx) -> tuple[RunState, object, dict, dict, Path | None]:
    """Data, resume decision, tokenizer, model, optimizer, schedule, engine and observer, in that
    order. Returns (run, tokenizer, base identity, parameter counts, resume path)."""
    from llmft.trainer.config import config_to_dict
    from llmft.trainer.distributed import deepspeed_config
    from llmft.trainer.loss import loss_fn
    from llmft.trainer.model import (
        attention_width,
        base_model_identity,
        load_model,
        load_tokenizer,
        parameter_counts,
        resolve_dtype,
    )
    from llmft.trainer.optim import build_optimizer, build_scheduler

    config_dict = config_to_dict(cfg)
    manifest, loader, total_steps = prepare_data(cfg, info)
    resume_path = choose_resume(cfg, info, config_dict, manifest["cache_key"])
    seed_all(cfg.seed)  # identical initialisation on every rank
    tokenizer = load_tokenizer(cfg.model)
    align_chat_template(tokenizer, manifest)
    ds_config = None
    if cfg.distributed.backend == "deepspeed":
        ds_config = deepspeed_config(
            cfg.distributed.zero_stage,
            accum_steps=loader.accum_steps,
            world_size=info.world_size,
            max_grad_norm=cfg.optim.max_grad_norm,
            bf16=resolve_dtype(cfg.model.dtype, info.device) == torch.bfloat16,
        )
    model = load_model(cfg, info.device, ds_config=ds_config)
    seed_all(cfg.seed + 7919 * (info.rank + 1))  # per-rank dropout stream
    optimizer = build_optimizer(model, cfg.optim, info.device)
    engine = Engine(
        model,
        optimizer,
        lambda opt: build_scheduler(opt, cfg.schedule, total_steps),
        info=info,
        backend=cfg.distributed.backend,
        max_grad_norm=cfg.optim.max_grad_norm,
        fused_skip=bool(optimizer.defaults.get("fused")),
        ds_config=ds_config,
        bucket_cap_mb=cfg.distributed.bucket_cap_mb,
        grad_reduce_dtype=cfg.distributed.grad_reduce_dtype,
    )
    counts = parameter_counts(model)
    layers, width = attention_width(model)
    run = RunState(
        cfg=cfg,
        config_dict=config_dict,
        info=info,
        engine=engine,
        loader=loader,
        observer=None,
        loss_fn=loss_fn(cfg.kernels.fused_loss, cfg.model.attn_implementation),
        autocast_ctx=autocast_ctx,
        lora=lora,
        total_steps=total_steps,
        dataset_key=manifest["cache_key"],
        flops={
            "method": cfg.method,
            "matmul_params": counts["matmul"],
            "adapter_params": counts["adapter"],
            "layers": layers,
            "attn_width": width,
        },
    )
    mlflow_run_id = resume(run, resume_path) if resume_path else None
    run.observer = Observer(
        cfg,
        config_dict,
        is_main=info.is_main,
        total_steps=total_steps,
        start_step=run.start_step,
        mlflow_run_id=mlflow_run_id,
    )
    return run, tokenizer, base_model_identity(cfg.model, model), counts, resume_path


def announce(run: RunState, counts: dict, resume_path: Path | None, warnings: list[str]) -> None:
    for warning in warnings:
        run.observer.info(f"warning: {warning}")
    run.observer.info(
        f"{run.cfg.method}: {counts['trainable']:,} trainable of {counts['total']:,} parameters; "
        f"{run.info.world_size} rank(s) on {run.info.device.type}; {run.total_steps} steps of "
        f"{run.loader.global_sequences} sequences ({run.loader.accum_steps} micro step(s) per rank)"
    )
    fastpath = getattr(run.engine.module, "llmft_fastpath", None)
    if fastpath:
        run.observer.info("fast path: " + ", ".join(f"{k} {v}" for k, v in fastpath.items() if v != {}))
    if resume_path:
        run.observer.info(f"resuming from {resume_path} at step {run.start_step}")
