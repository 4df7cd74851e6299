"""Token-weighted evaluation loss and perplexity on a tokenized split.

``eval_loss`` is the mean next-token NLL over every supervised target of the
split (sum of NLL / number of targets, never a mean of per-batch means), and
``perplexity = exp(eval_loss)``. :func:`evaluate_model` runs inside training on
every rank (each takes sequences rank, rank+W, ...; sums are all-reduced);
:func:`evaluate_perplexity` loads a base model (plus an optional PEFT adapter)
from disk; :class:`PerplexityEvaluator` does the same over one load of the base for
many adapters (the pipeline's evaluate step: the base and every checkpoint).
"""

from __future__ import annotations

import contextlib
import datetime
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from llmft.trainer import fp8
from llmft.trainer.data.loader import MicroBatch, eval_micro_batches
from llmft.trainer.data.shards import IGNORE_INDEX, open_split
from llmft.trainer.distributed import DistInfo, all_reduce_sum
from llmft.trainer.errors import DataError
from llmft.trainer.loss import loss_fn, token_nll_sum
from llmft.trainer.model import register_attention, resolve_dtype
from llmft.trainer.model_dir import check_model_files


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 709.0 else float("inf")


def katib_lines(metrics: dict, now: datetime.datetime | None = None) -> str:
    """The stdout lines Katib's StdOut collector parses: ``<RFC 3339 time> name=value``, one per line.
    The collector takes a line's first word as its timestamp and records the zero time for a line
    without one (kubeflow/katib v0.19.0 pkg/metricscollector/v1beta1/file-metricscollector/
    file-metricscollector.go 89-99); medianstop takes a trial's first ``start_step`` metrics as
    "ordered by time" (pkg/earlystopping/v1beta1/medianstop/service.py 208-212)."""
    moment = now if now is not None else datetime.datetime.now(datetime.UTC)
    stamp = moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return f"{stamp} eval_loss={metrics['eval_loss']:.6f}\n{stamp} perplexity={metrics['perplexity']:.6f}"


def _dummy_batch() -> MicroBatch:
    one = np.zeros(1, dtype=np.int64)
    return MicroBatch(one, one, np.full(1, IGNORE_INDEX, dtype=np.int64), np.ones(1, dtype=np.int64))


@torch.no_grad()
def evaluate_model(
    model,
    dataset_dir: str | Path,
    *,
    split: str = "val",
    micro_sequences: int = 4,
    max_sequences: int = 0,
    info: DistInfo | None = None,
    loss_fn=token_nll_sum,
    autocast_ctx=contextlib.nullcontext,
    progress: bool = False,
) -> dict:
    """Mean NLL over all supervised targets of ``split``, over all ranks (``progress``: a bar on rank 0)."""
    rank, world = (info.rank, info.world_size) if info else (0, 1)
    device = info.device if info else next(model.parameters()).device
    count = len(open_split(dataset_dir, split))
    count = count if max_sequences <= 0 else min(count, max_sequences)
    # Every rank runs the same number of forwards (ZeRO-3 gathers weights collectively per forward).
    lockstep = math.ceil(math.ceil(count / world) / micro_sequences)
    batches = list(
        eval_micro_batches(
            dataset_dir,
            split,
            micro_sequences=micro_sequences,
            rank=rank,
            world_size=world,
            max_sequences=max_sequences,
        )
    )
    batches += [_dummy_batch()] * (lockstep - len(batches))
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [nll sum, targets]
    if progress and rank == 0:
        batches = tqdm(batches, desc=f"evaluate {split}", unit="batch", mininterval=1.0)
    for micro in batches:
        batch = micro.to_torch(device)
        with autocast_ctx():
            nll = loss_fn(model, batch)
        sums[0] += nll.double()
        sums[1] += (batch["targets"] != IGNORE_INDEX).sum()
    if world > 1:
        all_reduce_sum(sums)
    model.train(was_training)
    total_nll, targets = sums.tolist()
    if targets == 0:
        raise DataError(f"{Path(dataset_dir) / split}: no supervised tokens to evaluate on")
    loss = total_nll / targets
    return {"eval_loss": loss, "perplexity": perplexity(loss), "tokens": int(targets)}


def evaluate_perplexity(
    model_path: str,
    dataset_dir: str,
    *,
    adapter_path: str | None = None,
    split: str = "val",
    micro_sequences: int = 4,
    max_sequences: int = 0,
    **load_options,
) -> dict:
    """Load ``model_path`` (+ the PEFT adapter at ``adapter_path``) and evaluate ``split``.
    Returns {"eval_loss", "perplexity", "tokens"} (tokens = supervised targets scored).
    ``load_options``: those of :class:`PerplexityEvaluator`."""
    evaluator = PerplexityEvaluator(**load_options)
    return evaluator(
        model_path,
        dataset_dir,
        adapter_path=adapter_path,
        split=split,
        micro_sequences=micro_sequences,
        max_sequences=max_sequences,
    )


class PerplexityEvaluator:
    """:func:`evaluate_perplexity` that keeps the last base model it loaded: the evaluate step scores
    the base and every checkpoint's adapter over ONE load of the base (an 8B base is ~16 GB read from
    the volume per load). Each adapter is applied for its evaluation, then removed (PEFT ``unload``,
    no merge), so every score is over the base's own weights plus that adapter only.

    The model loads as the trainer loads its base (``llmft.trainer.fp8.load_base_model``): an FP8
    checkpoint is dequantized on load, so the adapter is evaluated over the weights it was trained
    over (transformers' default keeps FP8 weights on a GPU, whose forward needs the ``kernels`` package)."""

    def __init__(
        self,
        *,
        device: str = "auto",
        dtype: str = "auto",
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        revision: str | None = None,
    ) -> None:
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        self.dtype, self.attn_implementation = dtype, attn_implementation
        self.trust_remote_code, self.revision = trust_remote_code, revision
        self._path: str | None = None
        self._model = None

    def __call__(
        self,
        model_path: str,
        dataset_dir: str,
        *,
        adapter_path: str | None = None,
        split: str = "val",
        micro_sequences: int = 4,
        max_sequences: int = 0,
    ) -> dict:
        with self.applied(model_path, adapter_path) as model:
            return self.score(
                model, dataset_dir, split=split, micro_sequences=micro_sequences, max_sequences=max_sequences
            )

    def score(self, model, dataset_dir: str, *, split: str = "val", micro_sequences: int = 4, max_sequences: int = 0):
        """:func:`evaluate_model` of a model from :meth:`applied`, on this evaluator's device."""

        return evaluate_model(
            model,
            dataset_dir,
            split=split,
            micro_sequences=micro_sequences,
            max_sequences=max_sequences,
            info=DistInfo(0, 1, 0, self.device),
            loss_fn=loss_fn(False, self.attn_implementation),
            progress=True,
        )

    @contextlib.contextmanager
    def applied(self, model_path: str, adapter_path: str | None = None):
        """The model at ``model_path`` (loaded only when it is not the one kept) with the adapter at
        ``adapter_path`` applied, in eval mode; the adapter is removed on exit."""
        if adapter_path:
            check_model_files(adapter_path, what="adapter")  # a damaged adapter is named before anything loads
        model = self._base(model_path)
        if adapter_path:
            # heavy: peft
            from peft import PeftModel

            try:
                model = PeftModel.from_pretrained(model, adapter_path)
            except BaseException:
                self._path = self._model = None  # a half-injected base is never used again
                raise
        try:
            yield model.eval()
        finally:
            if adapter_path:
                self._model = _without_adapter(model)

    def _base(self, model_path: str):
        if self._path != model_path:
            self._model = None  # the previous model's memory is free before the next one loads
            register_attention(self.attn_implementation)
            kwargs = {
                "dtype": resolve_dtype(self.dtype, self.device),
                "attn_implementation": self.attn_implementation,
                "trust_remote_code": self.trust_remote_code,
                "revision": self.revision,
                "use_safetensors": True,
            }
            # a damaged base is named before it loads (model_dir.check_model_files, in fp8.load_base)
            self._model = fp8.load_base_model(model_path, self.revision, "lora", kwargs).to(self.device)
            self._path = model_path
        return self._model


def _without_adapter(peft_model):
    """The base model back from a PeftModel: LoRA layers replaced by their base layers, nothing merged."""
    base = peft_model.unload()
    if "peft_config" in vars(base):  # PEFT copies its config onto the model it wraps; unload leaves it
        del base.peft_config
    return base
