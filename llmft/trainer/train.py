"""One training run, read top to bottom: build -> train -> close.

``python -m llmft.trainer`` (llmft/trainer/__main__.py) parses and validates the config, then every
rank runs one :class:`Trainer`:

- :meth:`Trainer.build`: join the process group; rank 0 plans the run and claims ``output_dir``
  (llmft/trainer/rundir.py: data, ownership, resume decision, restart budget) and every rank gets the
  same plan; the loader; tokenizer and model with the method applied; optimizer, schedule and the
  DDP/DeepSpeed engine; the checkpoint restored; the observer opened.
- :meth:`Trainer.train`: per step, every micro batch's forward and backward, one optimizer step
  (skipped on the device when the loss or gradient norm is non-finite on any rank), then logging,
  evaluation, checkpointing and the stop check; then ``final/`` and the summary. Host syncs
  happen only at log, eval and save steps; the per-step stop check is a CPU-only collective.
- :meth:`Trainer.close`: loader, sinks, process group, this start's outcome (restart budget).

What differs between LoRA / QLoRA / DoRA and full fine-tuning is a small :class:`Method`:
autocast (full weights stay float32 with bf16 autocast on CUDA under DDP; an adapter trains in
float32 beside the frozen base, without autocast), what is saved and resumed (the adapter or the
full weights) and the FLOP formula (4N + adapters, or 6N).

SIGTERM (preemption) and SIGINT (Ctrl-C) finish the step in flight, commit a checkpoint and exit
143 or 130; a second Ctrl-C stops at once, without a checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from llmft.trainer import checkpoint as ckpt
from llmft.trainer import model as model_lib
from llmft.trainer import rundir
from llmft.trainer.config import TrainConfig, every_steps
from llmft.trainer.config_load import config_to_dict
from llmft.trainer.data.loader import PackedLoader, StepBatch, resolve_global_sequences
from llmft.trainer.distributed import (
    DistInfo,
    Engine,
    all_reduce_sum,
    barrier,
    close_distributed,
    deepspeed_config,
    init_distributed,
    max_over_ranks,
)
from llmft.trainer.errors import ConfigError, TransientError
from llmft.trainer.evaluate import evaluate_model
from llmft.trainer.fastpath.resolve import describe as describe_fast_path
from llmft.trainer.fastpath.settings import micro_sequences_for
from llmft.trainer.flops import mfu
from llmft.trainer.hf_files import hub_fault_message, hub_unreachable, quiet_hub_retries
from llmft.trainer.io import TRAINING_MANIFEST, atomic_write_json
from llmft.trainer.loss import loss_fn
from llmft.trainer.model import (
    autocast,
    base_model_identity,
    check_method_supported,
    parameter_counts,
    resolve_dtype,
    save_tokenizer_and_generation,
)
from llmft.trainer.moe_aux import router_aux_metrics
from llmft.trainer.observe import (
    Observer,
    SpeedMeter,
    device_peak_flops,
    memory_metrics,
    step_flops_counter,
    summary_screen,
)
from llmft.trainer.optim import build_optimizer, build_scheduler
from llmft.trainer.steps import (
    STOP,
    StepCounters,
    Stopped,
    collect_garbage,
    loss_scale,
    scheduled_gc,
    seed_all,
    step_actions,
)
from llmft.trainer.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from llmft.trainer.fastpath.resolve import FastPath


@dataclass(frozen=True)
class Method:
    """What differs between fine-tuning methods."""

    name: str  # the FLOP formula's name: lora, qlora, dora or full
    adapter: bool  # checkpoints and final/ hold the PEFT adapter (else the full weights)
    autocast: Callable[[], contextlib.AbstractContextManager]  # around every forward pass


def choose_method(cfg: TrainConfig, device: torch.device) -> Method:
    check_method_supported(cfg, device)  # QLoRA without CUDA fails here, before anything loads
    if cfg.method == "full":
        compute = resolve_dtype(cfg.model.dtype, device)
        return Method("full", False, functools.partial(autocast, device, compute, cfg.distributed.backend == "ddp"))
    return Method("dora" if cfg.lora.use_dora else cfg.method, True, contextlib.nullcontext)


class Trainer:
    """One run on this rank."""

    # Set by build(); None before, which close() allows for (a build that failed part-way).
    info: DistInfo
    plan: rundir.StartPlan
    loader: PackedLoader
    engine: Engine
    fast_path: FastPath  # what trainer.model.load_model switched on for speed, why anything is off
    observer: Observer

    def __init__(self, cfg: TrainConfig, warnings: list[str] | None = None):
        self.cfg, self.warnings = cfg, list(warnings or [])
        self.config_dict = config_to_dict(cfg)
        self.info = self.plan = self.loader = self.engine = self.observer = None  # type: ignore[assignment]
        self._handlers: dict = {}
        # progress; restored from the checkpoint on resume
        self.start_step = self.tokens_seen = self.skipped_steps = 0
        self.wall_time_before = 0.0
        self.best: dict = {}
        self.eval_history: list = []
        self.last_eval: dict = {}
        self.last_train_loss = self.last_tokens_per_s = float("nan")
        self.speed_report: dict = {}

    # ------------------------------------------------------------------ build

    def build(self) -> None:
        cfg = self.cfg
        self._handlers = STOP.install()
        self.info = init_distributed(
            cfg.distributed.comm_backend, cfg.distributed.timeout_s, group_of_one=cfg.distributed.backend == "deepspeed"
        )
        self.speed = SpeedMeter(
            self.info.device, device_peak_flops(self.info.device, cfg.observe.peak_tflops), self.world
        )
        self.method = choose_method(cfg, self.info.device)
        self.plan = rundir.decide(self.cfg, self.config_dict, self.info)
        self.total_steps = self.plan.total_steps
        self.eval_steps = every_steps(cfg.eval_every, self.total_steps)  # a fraction of the run, or N steps
        self.save_steps = every_steps(cfg.save_every, self.total_steps)
        self.loader = self._loader()
        seed_all(cfg.seed)  # identical initialisation on every rank
        self.tokenizer = self._load_tokenizer()
        model, self.fast_path = self._load_model()
        seed_all(cfg.seed + 7919 * (self.info.rank + 1))  # per-rank dropout stream
        self.engine = self._engine(model)
        self.loss_fn = self._loss_fn()
        self.count_flops = step_flops_counter(model, self.method.name, cfg.lora.r)
        mlflow_run_id = self._resume(self.plan.resume_path) if self.plan.resume_path else None
        self.observer = Observer(
            cfg,
            self.config_dict,
            is_main=self.info.is_main,
            total_steps=self.total_steps,
            start_step=self.start_step,
            mlflow_run_id=mlflow_run_id,
            run_id=self.plan.run_id,
            elapsed_before_s=self.wall_time_before,
        )
        self._announce(model)

    @property
    def world(self) -> int:
        return self.info.world_size

    def _loader(self) -> PackedLoader:
        cfg = self.cfg
        sequences = resolve_global_sequences(
            cfg.batch.global_sequences, cfg.batch.global_tokens, int(self.plan.dataset["max_length"])
        )
        return PackedLoader(
            cfg.data,
            "train",
            global_sequences=sequences,
            micro_sequences=micro_sequences_for(cfg, self.info),  # auto: what fits (trainer.fastpath.settings)
            rank=self.info.rank,
            world_size=self.world,
            seed=cfg.seed,
        )

    def _load_tokenizer(self):
        """The base model's tokenizer at ``model.revision``, carrying the chat template the data was tokenized
        with (what serving must use). A missing directory or unknown hub id is one ConfigError."""

        model = self.cfg.model
        return load_tokenizer(
            model.name_or_path,
            model.revision,
            chat_template=self.plan.dataset.get("chat_template"),
            trust_remote_code=model.trust_remote_code,
        )

    def _load_model(self) -> tuple[Any, FastPath]:
        """The model with the method applied, and its fast-path decision (trainer.model.load_model).
        Called through the module: the benchmark harness wraps model.load_model."""

        cfg = self.cfg
        self.ds_config = None
        if cfg.distributed.backend == "deepspeed":
            self.ds_config = deepspeed_config(
                cfg.distributed.zero_stage,
                accum_steps=self.loader.accum_steps,
                world_size=self.world,
                max_grad_norm=cfg.optim.max_grad_norm,
                bf16=model_lib.resolve_dtype(cfg.model.dtype, self.info.device) == torch.bfloat16,
            )
        try:
            with quiet_hub_retries():
                return model_lib.load_model(cfg, self.info.device, ds_config=self.ds_config)
        except OSError as exc:
            unreachable = hub_unreachable(exc)
            if unreachable:
                raise TransientError(
                    hub_fault_message("model.name_or_path", cfg.model.name_or_path, unreachable)
                ) from None
            raise ConfigError(
                f"model.name_or_path={cfg.model.name_or_path!r}: cannot load ({_first_line(exc)})"
            ) from None

    def _engine(self, model) -> Engine:
        cfg = self.cfg
        optimizer = build_optimizer(model, cfg.optim, self.info.device)
        return Engine(
            model,
            optimizer,
            lambda opt: build_scheduler(opt, cfg.schedule, self.total_steps),
            info=self.info,
            backend=cfg.distributed.backend,
            max_grad_norm=cfg.optim.max_grad_norm,
            fused_skip=bool(optimizer.defaults.get("fused")),
            ds_config=self.ds_config,
            bucket_cap_mb=cfg.distributed.bucket_cap_mb,
            grad_reduce_dtype=cfg.distributed.grad_reduce_dtype,
        )

    def _loss_fn(self):
        return loss_fn(self.fast_path.fused_loss.on, self.fast_path.attention)  # what trainer.model resolved

    def _resume(self, path: Path) -> str | None:
        """Restore the planned checkpoint (weights, optimizer, scheduler, RNG, counters); returns
        the MLflow run id to continue."""
        state, warnings = ckpt.load_checkpoint(path, engine=self.engine, info=self.info, lora=self.method.adapter)
        for warning in warnings:  # every rank: the missing RNG file is this rank's
            print(f"[llmft] warning: {warning}", flush=True)
        self.start_step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.best = state.get("best") or {}
        self.eval_history = state.get("eval_history") or []
        self.last_eval = state.get("eval") or (self.eval_history[-1] if self.eval_history else {})
        self.last_train_loss = state.get("train_loss", float("nan"))
        self.wall_time_before = float(state.get("wall_time_s", 0.0))
        return state.get("mlflow_run_id")

    def _announce(self, model) -> None:
        obs, cfg, plan = self.observer, self.cfg, self.plan
        for warning in [*self.warnings, *([plan.eval_note] if plan.eval_note else []), *rundir.set_aside_notes(plan)]:
            obs.info(f"warning: {warning}")
        if plan.restarts:
            obs.info(
                f"restart {plan.restarts} of at most {cfg.max_restarts_without_progress} without a new checkpoint "
                f"({Path(cfg.output_dir) / rundir.RESTARTS_FILE})"
            )
        counts = parameter_counts(model)
        obs.info(
            f"{cfg.method}: {counts['trainable']:,} trainable of {counts['total']:,} parameters; "
            f"{self.world} rank(s) on {self.info.device.type}; {self.total_steps} steps of "
            f"{self.loader.global_sequences} sequences ({self.loader.accum_steps} micro step(s) per rank)"
        )

        obs.info(describe_fast_path(self.fast_path))
        obs.event("fast_path", self.start_step, {"fast_path": self.fast_path.as_dict()})
        if plan.resume_diffs:
            obs.info("force_resume=true: resuming although these differ:\n  " + "\n  ".join(plan.resume_diffs))
        if plan.resume_path:
            obs.info(f"resuming from {plan.resume_path} at step {self.start_step}")

    # ------------------------------------------------------------------ train

    def train(self) -> dict:
        self.speed.loaded()
        self.observer.training_started()
        if self.start_step >= self.total_steps:
            self.observer.info(f"step {self.start_step} is this run's last step: nothing to train, writing final/")
        with scheduled_gc(self.cfg.gc_every):
            self._train_steps()
        self.speed_report = self.speed.report()
        final_dir = self._write_final()
        return self._finish(final_dir)

    def _train_steps(self) -> None:
        cfg, engine = self.cfg, self.engine
        counters = StepCounters(self.info.device, skipped=self.skipped_steps)
        window = self._new_window()
        t_start = time.perf_counter()
        engine.train()
        for batch in self.loader.iter_steps(self.start_step + 1, self.total_steps):
            step = batch.step
            window["lr"] = engine.optimizer.param_groups[0]["lr"]  # the LR this step uses
            local_sum, local_bad = self.forward_backward(batch)
            global_loss = all_reduce_sum(local_sum.clone()) / max(batch.global_targets, 1)
            grad_norm, bad = engine.step(global_loss)
            counters.update(step, global_loss, grad_norm, bad, local_bad, cfg.max_bad_steps)
            self._count(batch, window)
            if step == cfg.debug.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            stop = max_over_ranks(STOP.signum)
            actions = step_actions(
                step,
                self.total_steps,
                log_every=cfg.log_every,
                eval_every=self.eval_steps,
                save_every=self.save_steps,
                stop_signal=stop,
            )
            if actions.log:
                self._log_step(step, counters, window)
                counters.check_bad_streak(self.info, cfg.max_bad_steps)
            evaluated = actions.evaluate and self._maybe_evaluate(step)
            if actions.save:
                self._save(step, time.perf_counter() - t_start, evaluated)
            self.observer.progress(step, loss=self.last_train_loss, tokens_per_s=self.last_tokens_per_s)
            collect_garbage(step, cfg.gc_every)
            if actions.stop:
                self.observer.notice(
                    f"{signal.Signals(stop).name}: checkpoint step-{step} committed; exiting {128 + stop}"
                )
                raise Stopped(stop, step)
        self.wall_time_before += time.perf_counter() - t_start

    def forward_backward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """All micro batches of this rank: loss = token-NLL sum / global target count (x world size,
        since the engines average gradients over ranks). Returns (local NLL sum, local non-finite)."""
        info, engine, debug = self.info, self.engine, self.cfg.debug
        scale = loss_scale(self.world, batch.global_targets)
        poison = batch.step in debug.nan_steps and debug.nan_rank in (-1, info.rank)
        local = torch.zeros((), dtype=torch.float32, device=info.device)
        last = len(batch.micro_batches) - 1
        for i, micro in enumerate(batch.micro_batches):
            tensors = micro.to_torch(info.device, pin=info.device.type == "cuda")
            with engine.accumulating(last=i == last):
                with self.method.autocast():
                    nll = self.loss_fn(engine.wrapped, tensors)
                if poison:
                    nll = nll * float("nan")
                if batch.step == debug.sigterm_at_step and i == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                engine.backward(nll * scale)
            local += nll.detach().float()
        return local, ~torch.isfinite(local)

    def _new_window(self) -> dict:
        """Counters of one logging interval; eval and checkpoint time is taken out of it."""
        return {"t": time.perf_counter(), "paused": self.speed.paused, "tokens": 0, "flops": 0.0, "lr": 0.0}

    def _count(self, batch: StepBatch, window: dict) -> None:
        flops = self.count_flops(batch.global_doc_lengths) if self.count_flops else None
        self.tokens_seen += batch.global_tokens
        window["tokens"] += batch.global_tokens
        window["flops"] = None if flops is None else window["flops"] + flops
        self.speed.step(batch.global_tokens, flops)

    def _log_step(self, step: int, counters: StepCounters, window: dict) -> None:
        """The only per-interval host sync: read the device counters."""
        good = counters.good_steps.item()
        self.last_train_loss = counters.loss_sum.item() / good if good else float("nan")
        self.skipped_steps = int(counters.skipped.item())
        dt = max(time.perf_counter() - window["t"] - (self.speed.paused - window["paused"]), 1e-9)
        metrics = {
            "loss": self.last_train_loss,
            "lr": window["lr"],
            "grad_norm": counters.grad_norm.item(),
            "tokens_per_s": window["tokens"] / dt,
            "tokens_per_s_per_device": window["tokens"] / dt / self.world,
            "skipped_steps": self.skipped_steps,
            "tokens_seen": self.tokens_seen,
        }
        if self.speed.peak and window["flops"] is not None:
            metrics["mfu"] = mfu(window["flops"], dt, self.speed.peak * self.world)
        metrics.update(memory_metrics(self.info.device))
        metrics.update(router_aux_metrics(self.engine.module, reduce=all_reduce_sum))  # MoE configs that ask for it
        self.last_tokens_per_s = metrics["tokens_per_s"]
        counters.loss_sum.zero_()
        counters.good_steps.zero_()
        window.update(self._new_window())
        self.observer.log_train(step, metrics)

    def _maybe_evaluate(self, step: int) -> bool:
        cfg = self.cfg
        if self.plan.eval_note is not None:  # no validation split
            return False
        with self.speed.pause():
            metrics = evaluate_model(
                self.engine.module if self.engine.backend == "ddp" else self.engine.wrapped,
                cfg.data,
                split=cfg.eval.split,
                micro_sequences=cfg.eval.micro_sequences,
                max_sequences=cfg.eval.max_sequences,
                info=self.info,
                loss_fn=self.loss_fn,
                autocast_ctx=self.method.autocast,
            )
        self.engine.train()
        self.last_eval = {**metrics, "step": step}
        self.eval_history.append(self.last_eval)
        if not self.best or metrics["eval_loss"] < self.best["eval_loss"]:
            self.best = dict(self.last_eval)
        self.observer.log_eval(step, metrics)
        return True

    # ------------------------------------------------------------------ checkpoints and final/

    def _state(self, step: int, wall: float, evaluated: bool) -> dict:
        epoch, in_epoch = self.loader.position(step)
        return {
            "run_id": self.plan.run_id,
            "step": step,
            "total_steps": self.total_steps,
            "epoch": epoch,
            "data_position": {
                "epoch": epoch,
                "step_in_epoch": in_epoch,
                "steps_per_epoch": self.loader.steps_per_epoch,
                "sequences_consumed": step * self.loader.global_sequences,
            },
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "train_loss": self.last_train_loss,
            "eval": self.last_eval if evaluated else None,
            "best": self.best,
            "eval_history": self.eval_history,
            "world_size": self.world,
            "dataset_cache_key": self.plan.dataset["cache_key"],
            "wall_time_s": self.wall_time_before + wall,
            "mlflow_run_id": self.observer.mlflow_run_id,
        }

    def _save(self, step: int, wall: float, evaluated: bool) -> None:
        out = self.cfg.output_dir
        with self.speed.pause():
            ckpt.save_checkpoint(
                out,
                step,
                engine=self.engine,
                info=self.info,
                lora=self.method.adapter,
                state=self._state(step, wall, evaluated),
                config=self.config_dict,
            )
            if self.info.is_main:
                best = ckpt.best_checkpoint_step(out, self.plan.run_id)
                ckpt.prune_checkpoints(out, self.cfg.keep_last, best, self.plan.run_id)
                self.observer.checkpoint_saved(step)
            barrier()

    def _write_final(self) -> Path:
        """output_dir/final/: weights, tokenizer + chat template, generation config, training_manifest.json."""

        def extras(staging: Path) -> None:
            save_tokenizer_and_generation(self.engine.module, self.tokenizer, staging)
            atomic_write_json(staging / TRAINING_MANIFEST, self._manifest())

        return ckpt.write_final(
            self.cfg.output_dir, engine=self.engine, info=self.info, lora=self.method.adapter, extras=extras
        )

    def _record(self) -> dict:
        """What training_manifest.json and the summary share."""
        return {
            "method": self.cfg.method,
            "steps": self.total_steps,
            "skipped_steps": self.skipped_steps,
            "tokens_seen": self.tokens_seen,
            "wall_time_s": self.wall_time_before,
            "speed": self.speed_report,
            "best": self.best,
            "config": self.config_dict,
        }

    def _manifest(self) -> dict:
        # heavy: peft
        import peft

        final_metrics = {k: self.last_eval.get(k) for k in ("eval_loss", "perplexity", "tokens")}
        return {
            **self._record(),
            "run_id": self.plan.run_id,
            "base_model": base_model_identity(self.cfg.model, self.engine.module),
            "base_format": self.fast_path.base.as_dict() if self.fast_path.base else None,  # how the base was loaded
            "dataset": {"path": str(self.cfg.data), "cache_key": self.plan.dataset["cache_key"]},
            "final_metrics": {"train_loss": self.last_train_loss, **final_metrics},
            "evaluation": self.plan.eval_note or "on",
            "eval_history": self.eval_history,
            "fast_path": self.fast_path.as_dict(),
            "world_size": self.world,
            "mlflow_run_id": self.observer.mlflow_run_id,
            "versions": {module.__name__: module.__version__ for module in (torch, transformers, peft)},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def _finish(self, final_dir: Path) -> dict:
        """Summary screen, the final metrics event, MLflow artifacts, Langfuse trace."""
        summary = {
            **self._record(),
            "status": "finished",
            "base_model": self.cfg.model.name_or_path,
            "tokens_per_s": self.speed_report["tokens_per_s"],
            "final_metrics": {"train_loss": self.last_train_loss, **self.last_eval},
            "final_dir": str(final_dir),
        }
        numbers = {k: v for k, v in {**summary, **self.speed_report}.items() if isinstance(v, int | float)}
        self.observer.event("final", self.total_steps, numbers)
        self.observer.finish(summary, final_dir)
        if self.info.is_main:
            print(summary_screen(summary), flush=True)
        return summary

    # ------------------------------------------------------------------ close

    def close(self, exit_code: int) -> None:
        """Close the loader and the sinks (a stopped or failed run's MLflow run stays resumable),
        record this start's outcome for the restart budget, then leave the process group."""
        if self.loader is not None:
            self.loader.close()
        if self.observer is not None:
            self.observer.close_interrupted(exit_code)
        if self.info is not None and self.info.is_main and self.plan is not None:
            rundir.record_outcome(self.cfg.output_dir, exit_code)
            if self.plan.lock is not None:
                self.plan.lock.release()  # the next run into output_dir may start
        close_distributed()
        STOP.restore(self._handlers)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
