"""Process group set-up and the data-parallel engine (DDP or DeepSpeed ZeRO).

Rendezvous comes from the environment torchrun or the Training Operator sets:
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, or the PET_*
variables (one process per node) when those are absent.

:class:`Engine` hides the difference between DDP and DeepSpeed behind the calls
the trainer makes: ``accumulating(last)``, ``backward(loss)`` and
``step() -> (grad_norm, skipped)``. The loss each rank back-propagates is its
token-sum divided by the global target count, times the world size (both
engines average gradients over ranks), so the update equals the single-process
one within floating-point tolerance.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmft.trainer.errors import ConfigError
from llmft.trainer.optim import clip_grad_norm


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return default


def read_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's or the Training Operator's variables."""
    rank = _env_int("RANK", "PET_NODE_RANK", default=0)
    world = _env_int("WORLD_SIZE", "PET_NNODES", default=1)
    local = _env_int("LOCAL_RANK", default=0)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name) and os.environ.get("PET_" + name):
            os.environ[name] = os.environ["PET_" + name]
    return rank, world, local


_STOP_GROUP = None  # a gloo group for host-side agreement (stop flag) without a device sync


def init_distributed(comm_backend: str = "auto", timeout_s: int = 1800, *, group_of_one: bool = False) -> DistInfo:
    """Join the process group (when WORLD_SIZE > 1) and pick this rank's device.

    ``group_of_one``: a single process (no torchrun) still gets a process group of one rank, over an
    in-process store (no port, no MASTER_ADDR): DeepSpeed only runs inside one
    (``deepspeed.initialize(dist_init_required=False)`` asserts ``dist.is_initialized()``)."""
    global _STOP_GROUP
    rank, world, local = read_env()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if (world > 1 or group_of_one) and not dist.is_initialized():
        backend = ("nccl" if cuda else "gloo") if comm_backend == "auto" else comm_backend
        if backend == "nccl" and not cuda:
            raise ConfigError("distributed.comm_backend=nccl needs CUDA GPUs; use auto or gloo on CPU")
        kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        if world == 1:
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
            for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # what DeepSpeed reads (torchrun sets them)
                os.environ.setdefault(name, "1" if name == "WORLD_SIZE" else "0")
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        _STOP_GROUP = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return DistInfo(rank, world, local, device)


def close_distributed() -> None:
    global _STOP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _STOP_GROUP = None


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of all ranks, on every rank (CPU/gloo: no device sync). The trainer
    agrees on its stop signal with it once per step."""
    if not dist.is_initialized() or dist.get_world_size() == 1:  # one rank (DeepSpeed may init nccl alone)
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_STOP_GROUP)
    return int(t.item())


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def ranks_with_flag(flag: torch.Tensor, info: DistInfo) -> list[int]:
    """The ranks on which the boolean device tensor ``flag`` is true."""
    vec = torch.zeros(info.world_size, dtype=torch.float32, device=info.device)
    vec[info.rank] = flag.float()
    return [i for i, v in enumerate(all_reduce_sum(vec).tolist()) if v > 0]


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ----------------------------------------------------------------------------- engines


def deepspeed_config(zero_stage: int, *, accum_steps: int, world_size: int, max_grad_norm: float, bf16: bool) -> dict:
    """DeepSpeed config for the trainer: one flattened row per micro step, client optimizer,
    our own schedule; bf16 overflow check skips a non-finite step."""
    zero: dict = {"stage": zero_stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8}
    if zero_stage == 3:
        zero.update(
            {
                "stage3_gather_16bit_weights_on_model_save": True,
                "stage3_prefetch_bucket_size": 5e8,
                "stage3_param_persistence_threshold": 1e6,
            }
        )
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accum_steps,
        "train_batch_size": accum_steps * world_size,
        "gradient_clipping": max_grad_norm,
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class Engine:
    """DDP or DeepSpeed behind the same calls. ``module`` is the unwrapped model."""

    def __init__(
        self,
        model,
        optimizer,
        scheduler_factory,
        *,
        info: DistInfo,
        backend: str,
        max_grad_norm: float,
        fused_skip: bool,
        ds_config: dict | None = None,
        bucket_cap_mb: int = 100,
        grad_reduce_dtype: str = "fp32",
    ):
        self.module, self.info, self.backend = model, info, backend
        self.max_grad_norm, self.fused_skip = max_grad_norm, fused_skip
        self.params = [p for p in model.parameters() if p.requires_grad]
        if backend == "deepspeed":
            self.wrapped = _init_deepspeed(model, optimizer, ds_config)
            self._ds_skipped = 0
            # ZeRO regroups the client optimizer's parameters: schedule the optimizer it really steps.
            optimizer = getattr(self.wrapped.optimizer, "optimizer", optimizer)
        elif info.world_size > 1:
            self.wrapped = _wrap_ddp(model, info, bucket_cap_mb, grad_reduce_dtype)
        else:
            self.wrapped = model
        # DDP's gradients are views into its buckets: zeroing keeps them there (no re-allocation and
        # no copy into the buckets each step); one process frees them instead.
        self._grads_to_none = not isinstance(self.wrapped, torch.nn.parallel.DistributedDataParallel)
        self.optimizer = optimizer
        self.scheduler = scheduler_factory(optimizer)

    def accumulating(self, last: bool):
        """Context for one micro step: DDP skips the gradient all-reduce until ``last``."""
        if self.backend == "ddp" and self.info.world_size > 1 and not last:
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.backend == "deepspeed":
            self.wrapped.backward(loss, scale_wrt_gas=False)
            self.wrapped.step()  # DeepSpeed updates only at its accumulation boundary
        else:
            loss.backward()

    def step(self, global_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and update unless the loss or grad norm is non-finite on any rank.
        Returns device tensors (grad_norm, skipped)."""
        if self.backend == "deepspeed":
            return self._deepspeed_result(global_loss)
        norm = clip_grad_norm(self.params, self.max_grad_norm)
        bad = ~(torch.isfinite(norm) & torch.isfinite(global_loss))
        if self.fused_skip:  # fused AdamW skips on device when found_inf is 1
            self.optimizer.found_inf = bad.float()
            self.optimizer.step()
        elif not bool(bad.item()):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self._grads_to_none)
        self.scheduler.step()
        return norm.detach(), bad

    def _deepspeed_result(self, global_loss):
        """DeepSpeed already stepped (or skipped a non-finite step) inside backward()."""
        self.scheduler.step()
        norm = self.wrapped.get_global_grad_norm()
        norm = torch.tensor(float("nan") if norm is None else float(norm), device=self.info.device)
        skipped = self.wrapped.skipped_steps > self._ds_skipped
        self._ds_skipped = self.wrapped.skipped_steps
        return norm, torch.tensor(skipped, device=self.info.device) | ~torch.isfinite(global_loss)

    def train(self) -> None:
        self.wrapped.train()

    def eval(self) -> None:
        self.wrapped.eval()


def _wrap_ddp(model, info: DistInfo, bucket_cap_mb: int, grad_reduce_dtype: str):
    """DDP with gradients as bucket views (one copy of them) and, optionally, bf16 all-reduce."""
    ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=ids, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True
    )
    if grad_reduce_dtype == "bf16":
        ddp.register_comm_hook(None, bf16_all_reduce_hook)
    return ddp


def bf16_all_reduce_hook(group, bucket):
    """DDP comm hook: average the bucket in bf16 (half the bytes of fp32), write it back in place.
    Like torch's bf16_compress_hook, which refuses CPU/gloo; this one runs on both."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def import_deepspeed():
    """Import DeepSpeed and attach it to our process group (once); a clear error when missing."""

    try:
        # heavy: deepspeed
        import deepspeed

        # import_module returns the submodule itself; `import deepspeed.comm.torch as m` would bind
        # the `torch` attribute that deepspeed.comm re-exports (the real torch package).
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        raise ConfigError(
            "distributed.backend=deepspeed needs the deepspeed package: pip install 'kfp-llm-finetune[deepspeed]'"
        ) from None
    if not torch.cuda.is_available():
        # On CPU DeepSpeed falls back to gloo; skip JIT-building its shared-memory all-reduce op
        # (an inference optimisation that costs ~50 s of C++ compilation on first use).
        ds_torch_comm.build_shm_op = lambda: None
    if dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    return deepspeed


def _init_deepspeed(model, optimizer, ds_config: dict | None):
    deepspeed = import_deepspeed()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, dist_init_required=False)
    return engine
