"""What a person sees of a run: progress (a tqdm bar on a terminal, plain progress lines elsewhere, MLflow
metrics, Kubeflow Trainer's TrainJob status), step logs, eval lines, TensorBoard, metrics.jsonl, MLflow and
Langfuse, and the summary screen at the end.

Only rank 0 writes. MLflow is used when MLFLOW_TRACKING_URI is set (a child run
of LLMFT_MLFLOW_PARENT_RUN_ID when that is set); a tracking server that does not
answer is known in seconds (llmft/trainer/mlflow_settings.py) and skipped. MLflow gets each metric twice: under
our ``<event>/<name>`` (``train/loss``, ``eval/perplexity``) and under the name Hugging Face's Trainer logs
(``loss``, ``learning_rate``, ``grad_norm``, ``eval_loss``: :data:`HF_METRIC_NAMES`), plus
``progress_percent`` and ``eta_seconds`` (llmft/trainer/progress.py). Langfuse is
used when LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY are set: one live trace per
run (llmft/trainer/langfuse_sink.py), an observation per log step, evaluation and
checkpoint. Both are imported lazily inside functions (llmft/trainer/ never imports them
at module level). Unconfigured, each prints one info line and does nothing; a
failing server logs a warning and is switched off rather than stopping the training.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from llmft.trainer import flops, langfuse_sink
from llmft.trainer.config_load import flatten_dict
from llmft.trainer.io import atomic_write_text
from llmft.trainer.mlflow_settings import PARENT_RUN_ENV, prepare_mlflow, tracking_uri_without_credentials
from llmft.trainer.progress import ProgressClock
from llmft.trainer.trainer_status import StatusReporter

if TYPE_CHECKING:
    from llmft.trainer.langfuse_sink import RunTrace

log = logging.getLogger("trainer")

HF_METRIC_NAMES = {
    "train": {
        "loss": "loss",
        "lr": "learning_rate",
        "grad_norm": "grad_norm",
        "progress_percent": "progress_percent",
        "eta_seconds": "eta_seconds",
    },
    "eval": {"eval_loss": "eval_loss", "perplexity": "eval_perplexity"},
}
"""event kind -> our metric name -> the unprefixed MLflow name logged beside ``<kind>/<name>`` (Hugging Face
Trainer's names: ``loss``, ``learning_rate``, ``grad_norm``, ``eval_<metric>``)."""


def device_peak_flops(device, override_tflops: float = 0.0) -> float | None:
    """Dense bf16 peak FLOP/s of one torch ``device`` (observe.peak_tflops wins), or None when unknown (CPU).
    The table of peaks by device name is llmft/trainer/flops.py's ``peak_flops``."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    # heavy: torch
    import torch

    return flops.peak_flops(torch.cuda.get_device_name(device))  # the one table of peaks


def step_flops_counter(model, method: str, lora_rank: int):
    """``doc_lengths -> model FLOPs of one step``, by llmft/trainer/flops.py (the formula the
    benchmark uses), or None when the model's shape or adapted modules are not ones it knows."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    targets = sorted(
        {name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if ".lora_A." in name}
    )
    try:
        shape = flops.shape_from_config(base.config)
        flops.dense_flops_per_token(shape, method, lora_rank, targets)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        log.warning("MFU not reported: %s", exc)
        return None
    return lambda doc_lengths: flops.step_flops(shape, method, doc_lengths, lora_rank, targets)


def memory_metrics(device) -> dict:
    # heavy: torch
    import torch

    if device.type == "cuda":
        return {
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def restart_peak_memory(device) -> float | None:
    """The peak GiB allocated while the model was built (a 4-bit base is loaded in bf16 and quantized: its
    load peak can exceed training's), then a fresh peak, so the train records' ``peak_mem_gib`` is
    training's own (issue 37). None off CUDA."""
    if device is None or device.type != "cuda":
        return None
    # heavy: torch
    import torch

    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process (dynamo's ``unique_graphs``
    counter: one more for every compilation and recompilation); 0 where nothing compiled."""

    if "torch._dynamo" not in sys.modules:
        return 0
    # heavy: torch
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


class SpeedMeter:
    """Where this process's wall time went, so that tokens/s and MFU describe training alone.

    ``load``: from the start of the build to the model, optimizer and resumed state being ready.
    ``warm-up``: the first ``WARMUP_STEPS`` steps (the allocator grows, the first compilation) and
    every later step during which torch.compile compiled a graph (a recompilation for a new packed
    shape can take longer than hundreds of steps). ``steady``: every other step. Time spent
    evaluating and checkpointing (:meth:`pause`) belongs to neither. Each step is timed on the
    host, from the end of the previous step (or pause) to its own end, with no device sync: a
    compilation blocks the host, so it lands in the step that triggered it, and the device queue's
    lag (at most a step or two) evens out over the steady steps. :meth:`loaded` and :meth:`report`
    synchronise the device once each."""

    WARMUP_STEPS = 2

    def __init__(self, device, peak: float | None, world_size: int, clock=time.perf_counter, compiled=compiled_graphs):
        self.device, self.peak, self.world_size, self.clock, self.compiled = device, peak, world_size, clock, compiled
        self.t_start = self.t_last = clock()
        self.load_s, self.paused = 0.0, 0.0
        self.load_peak_gib: float | None = None
        self.steps, self.compile_steps = 0, 0
        self.graphs = 0
        self.seconds = {"warmup": 0.0, "steady": 0.0}
        self.tokens = {"warmup": 0, "steady": 0}
        self.flops: dict = {"warmup": 0.0, "steady": 0.0}
        self.step_counts = {"warmup": 0, "steady": 0}

    def _now(self) -> float:
        if self.device is not None and self.device.type == "cuda":
            # heavy: torch
            import torch

            torch.cuda.synchronize(self.device)
        return self.clock()

    def loaded(self) -> None:
        self.t_last = self._now()
        self.load_s = self.t_last - self.t_start
        self.graphs = self.compiled()
        self.load_peak_gib = restart_peak_memory(self.device)

    def step(self, tokens: int, flops: float | None) -> None:
        now, graphs = self.clock(), self.compiled()
        self.steps += 1
        recompiled = graphs != self.graphs and self.steps > self.WARMUP_STEPS
        self.compile_steps += recompiled
        phase = "warmup" if self.steps <= self.WARMUP_STEPS or recompiled else "steady"
        self.seconds[phase] += now - self.t_last
        self.tokens[phase] += tokens
        self.step_counts[phase] += 1
        self.flops[phase] = None if flops is None or self.flops[phase] is None else self.flops[phase] + flops
        self.t_last, self.graphs = now, graphs

    @contextlib.contextmanager
    def pause(self):
        """Time inside is evaluation or checkpointing: not training."""
        start = self._now()
        try:
            yield
        finally:
            self.t_last = self._now()
            self.paused += self.t_last - start

    def report(self) -> dict:
        """The speed section of the summary, training_manifest.json and the final metrics event."""
        self._now()  # the queued kernels of the last steps finish inside the phase that launched them
        steady = self.step_counts["steady"] > 0
        phase = "steady" if steady else "warmup"  # too few steps for a steady state: every step
        seconds = max(self.seconds[phase], 1e-9)
        work = self.flops[phase]
        return {
            "load_s": self.load_s,
            "load_peak_gib": self.load_peak_gib,
            "warmup_s": self.seconds["warmup"],
            "warmup_steps": self.step_counts["warmup"],
            "recompile_steps": self.compile_steps,
            "steady_steps": self.step_counts["steady"],
            "steady_s": self.seconds["steady"],
            "eval_and_save_s": self.paused,
            "tokens_per_s": self.tokens[phase] / seconds,
            "tokens_per_s_per_device": self.tokens[phase] / seconds / self.world_size,
            "mfu": flops.mfu(work, seconds, self.peak and self.peak * self.world_size) if work is not None else None,
            "steady_state": steady,
        }


class Observer:
    """All outputs of a run. Every method is a no-op on ranks other than 0."""

    def __init__(
        self,
        cfg,
        config_dict: dict,
        *,
        is_main: bool,
        total_steps: int,
        start_step: int,
        mlflow_run_id: str | None = None,
        run_id: str = "",
        elapsed_before_s: float = 0.0,
    ):
        self.cfg, self.active = cfg, is_main
        self.output_dir = Path(cfg.output_dir)
        self.run_name = cfg.observe.run_name or self.output_dir.resolve().name
        self.mlflow_run_id = None
        self.langfuse: RunTrace | None = None  # when Langfuse is configured
        self._tb = self._bar = None
        self.clock = ProgressClock(total_steps, start_step, elapsed_before_s)
        self.status: StatusReporter | None = None  # Kubeflow Trainer's progress API, when its variables are set
        self._status_metrics: dict[str, float] = {}
        self._mlflow_ok = False
        self._closed = not is_main
        if not is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        _truncate_events_after(self.metrics_path, start_step)
        if cfg.observe.tensorboard:
            # heavy: torch
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                str(self.output_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
            )
        self._start_mlflow(config_dict, mlflow_run_id)
        self._start_langfuse(config_dict, run_id or self.run_name, start_step, total_steps)
        self.status = StatusReporter.from_env()
        if self.status is not None:
            self.info(f"progress: reporting to the TrainJob's status ({self.status.url})")
        if cfg.observe.progress_bar and _isatty(sys.stderr):  # elsewhere tqdm's redraws pile up: plain lines
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=1.0,
            )

    # ------------------------------------------------------------------ events

    def event(self, kind: str, step: int, metrics: dict) -> None:
        """Append one JSON line, and mirror the numbers to TensorBoard and MLflow."""
        if not self.active:
            return
        record = {"event": kind, "step": step, "time": time.time(), **metrics}
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()
        self._mlflow(lambda m: m.log_metrics(mlflow_metrics(kind, numbers), step=step))

    def training_started(self) -> None:
        """The model is loaded and the first step starts now: elapsed time and the ETA count from here."""
        if self.active:
            self.clock = ProgressClock(self.clock.total, self.clock.start_step, self.clock.elapsed_before_s)

    def log_train(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        progress = self.clock.at(step, tokens_per_s=metrics.get("tokens_per_s"), loss=metrics.get("loss"))
        self.event("train", step, {**metrics, **progress.metrics()})
        if self.langfuse is not None:
            self.langfuse.log_step(step, metrics)
        parts = [f"step={step}"] + [f"{k}={_fmt(v)}" for k, v in metrics.items() if isinstance(v, int | float)]
        self.write_line(" ".join(parts))
        if self.status is not None:
            names = {"loss": "loss", "lr": "learning_rate", "grad_norm": "grad_norm", "tokens_per_s": "tokens_per_s"}
            self._status_metrics.update({names[k]: v for k, v in metrics.items() if k in names})
            self.status.report(progress, self._status_metrics)

    def log_eval(self, step: int, metrics: dict) -> None:
        """Eval lines for Katib's StdOut collector, exactly `eval_loss=<v>` and `perplexity=<v>`."""
        if not self.active:
            return
        # heavy: torch
        from llmft.trainer.evaluate import katib_lines

        self.event("eval", step, metrics)
        if self.langfuse is not None:
            self.langfuse.evaluated(step, metrics)
        self.write_line(katib_lines(metrics))
        self._status_metrics.update({k: v for k, v in metrics.items() if k in ("eval_loss", "perplexity")})

    def checkpoint_saved(self, step: int) -> None:
        """A checkpoint of ``step`` was committed (its COMPLETE marker written)."""
        if self.active and self.langfuse is not None:
            self.langfuse.checkpoint(step, str(self.output_dir / "checkpoints" / f"step-{step}"))

    def progress(self, step: int, *, loss: float, tokens_per_s: float) -> None:
        """After every step: advance the bar (a terminal), or print a plain progress line when one is due
        (llmft/trainer/progress.py). ``loss`` and ``tokens_per_s`` are host numbers from the last log step."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            shown = {k: _fmt(v) for k, v in {"loss": loss, "tokens_per_s": tokens_per_s}.items() if v == v}
            if shown:
                self._bar.set_postfix(shown, refresh=False)
        elif self.clock.plain_due(step):
            self.write_line(self.clock.at(step, tokens_per_s=tokens_per_s, loss=loss).line())

    def write_line(self, text: str, *, stream=None) -> None:
        if self._bar is not None:
            self._bar.clear()
        print(text, flush=True, file=stream)
        if self._bar is not None:
            self._bar.refresh()

    def info(self, text: str) -> None:
        if self.active:
            self.write_line(f"[llmft] {text}")

    def notice(self, text: str) -> None:
        """A line about how the run ends (a stop signal): stderr, where a stop's reason belongs."""
        if self.active:
            self.write_line(f"[llmft] {text}", stream=sys.stderr)

    # ------------------------------------------------------------------ MLflow

    def _start_mlflow(self, config_dict: dict, resume_run_id: str | None) -> None:
        uri = tracking_uri_without_credentials()  # a password in the URI moves to MLFLOW_TRACKING_PASSWORD
        if not uri:
            self.info("mlflow: MLFLOW_TRACKING_URI not set, not logging to MLflow")
            return

        if reason := prepare_mlflow(uri, required=False):
            self.info(f"mlflow: {reason}; not logging to MLflow")
            return
        try:
            # heavy: mlflow
            import mlflow

            mlflow.set_tracking_uri(uri)
            experiment = self.cfg.observe.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "llmft"
            mlflow.set_experiment(experiment)
            parent = os.environ.get(PARENT_RUN_ENV) or None
            if resume_run_id:
                run = mlflow.start_run(run_id=resume_run_id)
            else:
                run = mlflow.start_run(
                    run_name=self.run_name,
                    parent_run_id=parent,
                    tags={"llmft.output_dir": str(self.output_dir.resolve())},
                )
                mlflow.log_params(flatten_dict(config_dict))
            self.mlflow_run_id = run.info.run_id
            self._mlflow_ok = True
            self.info(f"mlflow: logging to run {self.mlflow_run_id} in experiment {experiment!r}")
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            log.warning("mlflow disabled: %s", exc)

    def _mlflow(self, fn) -> None:
        if not self._mlflow_ok:
            return
        try:
            # heavy: mlflow
            import mlflow

            fn(mlflow)
        except Exception as exc:  # noqa: BLE001
            log.warning("mlflow disabled after an error: %s", exc)
            self._mlflow_ok = False

    # ------------------------------------------------------------------ Langfuse

    def _start_langfuse(self, config_dict: dict, run_id: str, start_step: int, total_steps: int) -> None:
        if not langfuse_sink.configured():
            self.info("langfuse: LANGFUSE_PUBLIC_KEY/LANGFUSE_SECRET_KEY not set, no trace")
            return
        links = {"output_dir": str(self.output_dir.resolve()), "mlflow_run_id": self.mlflow_run_id}
        self.langfuse = langfuse_sink.RunTrace.open(
            self.output_dir,
            run_id=run_id,
            run_name=self.run_name,
            start_step=start_step,
            total_steps=total_steps,
            config=config_dict,
            links={k: v for k, v in links.items() if v},
        )
        if self.langfuse is not None:
            trace_id = self.langfuse.trace_id
            self._mlflow(lambda m: m.set_tag("llmft.langfuse_trace_id", trace_id))
            self.info(f"langfuse: trace {trace_id} on {langfuse_sink.host()}")

    # ------------------------------------------------------------------ end of run

    def _close_sinks(self) -> bool:
        """Close the progress bar and TensorBoard once; False when already closed."""
        if self._closed:
            return False
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self.status is not None:
            self.status.close()
        return True

    def finish(self, summary: dict, final_dir: Path | None, status: str = "FINISHED") -> None:
        if self.active and self.status is not None:
            self.status.report(self.clock.at(self.clock.total), self._status_metrics)  # 100%, ETA 0
        if not self._close_sinks():
            return
        if final_dir is not None and final_dir.is_dir():
            self._mlflow(lambda m: m.log_artifacts(str(final_dir), artifact_path="final"))
        self._mlflow(lambda m: m.end_run(status=status))
        if self.langfuse is not None and status == "FINISHED":
            self.langfuse.finish(summary)
        elif self.langfuse is not None:
            self.langfuse.stopped(None)

    def close_interrupted(self, exit_code: int | None = None) -> None:
        """Preempted or failed: close sinks but leave the MLflow run resumable; the Langfuse trace
        records why this process stopped (a resume continues the same trace)."""
        if not self._close_sinks():
            return
        self._mlflow(lambda m: m.end_run(status="KILLED"))
        if self.langfuse is not None:
            self.langfuse.stopped(exit_code)


def mlflow_metrics(kind: str, numbers: dict[str, float]) -> dict[str, float]:
    """What one event logs to MLflow: ``<kind>/<name>`` for every number, and the Hugging Face name
    (:data:`HF_METRIC_NAMES`) beside ours where there is one."""
    logged = {f"{kind}/{k}": v for k, v in numbers.items()}
    aliases = HF_METRIC_NAMES.get(kind, {})
    logged.update({aliases[k]: v for k, v in numbers.items() if k in aliases})
    return logged


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _truncate_events_after(path: Path, step: int) -> None:
    """On resume, drop events a killed run logged after the checkpoint it resumes from."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def summary_screen(summary: dict) -> str:
    """The one-screen summary printed at the end of training (no name=value pairs,
    so Katib's collector reads only the eval lines)."""
    final, best, speed = summary.get("final_metrics") or {}, summary.get("best") or {}, summary.get("speed") or {}
    rows = [
        ("status", summary.get("status", "")),
        ("method", summary.get("method", "")),
        ("base model", summary.get("base_model", "")),
        ("steps", f"{summary.get('steps', 0)} ({summary.get('skipped_steps', 0)} skipped)"),
        ("tokens seen", f"{summary.get('tokens_seen', 0):,}"),
        ("wall time", f"{summary.get('wall_time_s', 0.0):.1f} s"),
        *_speed_rows(speed),
        ("final train loss", _fmt(final.get("train_loss", float("nan")))),
        ("final eval loss", _fmt(final.get("eval_loss", float("nan")))),
        ("final perplexity", _fmt(final.get("perplexity", float("nan")))),
        ("best step", f"{best.get('step', '-')} (eval loss {_fmt(best.get('eval_loss', float('nan')))})"),
        ("output", summary.get("final_dir", "")),
    ]
    width = max(len(k) for k, _ in rows)
    line = "=" * 64
    body = "\n".join(f"  {k.ljust(width)} : {v}" for k, v in rows)
    return f"{line}\n  llmft train: summary\n{line}\n{body}\n{line}"


def _speed_rows(speed: dict) -> list[tuple[str, str]]:
    """Model load and warm-up on their own lines; tokens/s and MFU of the steady state."""
    if not speed:
        return []
    if speed.get("steady_state"):
        scope = f"steady state: {speed['steady_steps']} steps, without warm-up, compilation, eval and checkpoints"
    else:
        scope = f"all {speed.get('warmup_steps', 0)} steps: too few for a steady state"
    mfu = speed.get("mfu")
    recompiled = speed.get("recompile_steps", 0)
    warmup = f"first {speed.get('warmup_steps', 0) - recompiled} steps" + (
        f" + {recompiled} step(s) that recompiled" if recompiled else ""
    )
    return [
        ("model load", f"{speed.get('load_s', 0.0):.1f} s"),
        ("warm-up", f"{speed.get('warmup_s', 0.0):.1f} s ({warmup})"),
        ("eval + checkpoints", f"{speed.get('eval_and_save_s', 0.0):.1f} s"),
        ("tokens/s", f"{speed.get('tokens_per_s', 0.0):,.0f} ({scope})"),
        ("MFU", f"{mfu:.1%}" if mfu is not None else "n/a (peak FLOP/s of this device unknown: observe.peak_tflops)"),
    ]
