"""`python -m llmft.trainer [--config FILE] [key=value ...]`: what every rank runs.

parse -> build -> train -> close (the run itself is llmft/trainer/train.py). Users and pods run it
through `llmft train` (one process) or `llmft train --nproc N` (torchrun, one process per rank).
Exit codes follow the Training Operator's ExitCode restart policy: 0 done; 1 bad config or data,
too many non-finite steps, or the restart budget spent (permanent); 3 an internal error (a bug,
permanent); 130 Ctrl-C and 143 SIGTERM after committing a checkpoint (143 is retried and the
restarted pod resumes from it); 200 a transient I/O fault (retried).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from llmft.trainer.config_load import config_to_yaml, load_config_checked
from llmft.trainer.errors import EXIT_OK, SignalStop
from llmft.trainer.failures import Teller, describe_failure
from llmft.trainer.quiet import quiet_known_noise
from llmft.trainer.rank_exits import write_rank_exit

EPILOG = """examples:
  llmft train --config trainer/configs/tiny-cpu.yaml data=/data/tok output_dir=/runs/a
  llmft train --nproc 8 --config trainer/configs/qwen2.5-7b-lora-1xh100.yaml optim.lr=1e-4
exit codes: 0 ok, 1 config/data error or non-finite training, 3 internal error, 130 Ctrl-C and
143 SIGTERM (checkpoint committed), 200 transient I/O fault"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmft.trainer",
        description="LLM fine-tuning trainer (one rank).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file mapping 1:1 onto trainer.config.TrainConfig")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, nested with dots: lora.r=16")
    return parser


def say_line(text: str) -> None:
    """``text`` and its newline on stderr in one write: print() writes them apart (under PYTHONUNBUFFERED, which the
    Training Operator sets), so two ranks' lines could merge into one ("[rank 0] error: x[rank 1] error: y")."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _rank_prefix() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()  # the libraries' known noise (llmft/trainer/quiet.py), in every rank
    args = build_parser().parse_intermixed_args(argv)  # key=value words before and after the options
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop_while_starting) if main_thread else None  # build() sets its own
    use_expandable_segments()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = run(args)
    except BaseException as exc:
        if isinstance(exc, SystemExit) or os.environ.get("LLMFT_DEBUG", "") not in ("", "0"):
            raise
        code, message = describe_failure(exc, TRAINER)
        say_line(f"{_rank_prefix()}error: {message}")
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    write_rank_exit(code)
    return code


STARTUP_INTERRUPT = (
    "interrupted by Ctrl-C while the trainer was starting (before the model was loaded): stopped at once; "
    "no training step had run, so there is nothing to checkpoint"
)


COMMITTED: dict[str, str] = {}
"""Set (``{"output": ...}``) once the run's output is committed: a stop signal after that stops nothing."""
AFTER_COMMIT = "{name} arrived after the run's output was committed ({output}): nothing to stop or resume; exit 0"


def _stop_while_starting(signum, _frame) -> None:
    """SIGTERM before the trainer's own handlers (imports, config, planning): nothing to checkpoint yet,
    so stop at once with one line and exit 143 (a retried pod simply starts again). After the output was
    committed (the handlers are this one again): a line on stderr, and the run still exits 0."""

    if COMMITTED:
        print(f"[llmft] {AFTER_COMMIT.format(name=signal.Signals(signum).name, **COMMITTED)}", file=sys.stderr)
        return
    raise SignalStop(
        signum,
        "stopped by SIGTERM while the trainer was starting: no training step had run, "
        "so there is nothing to checkpoint; exit 143 (a retried pod starts again)",
    )


TRAINER = Teller(
    command="the trainer",
    output="the run's output (a checkpoint, final/ or a log)",
    resume="the run resumes from its newest complete checkpoint",
    interrupted=STARTUP_INTERRUPT,
    extras=("trainer",),
)
"""How a rank tells what ended it (llmft/trainer/failures.py, the one mapping)."""


def use_expandable_segments() -> None:
    """Default PyTorch's CUDA allocator to expandable segments (before CUDA starts).

    Packed batches change their token count every step; with fixed-size cached blocks the
    reserved memory grows far past the allocated peak (69 GiB reserved for 48 GiB allocated
    on the 1.5B LoRA benchmark; 47.9 GiB with expandable segments), and a full card makes the
    allocator free its cache and retry. A value the user set (even empty) is kept.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def run(args: argparse.Namespace) -> int:
    """Parse, then one :class:`~llmft.trainer.train.Trainer`: build -> train -> close."""
    cfg, warnings = load_config_checked(args.config, args.overrides)  # validated once
    if args.print_config:
        print(config_to_yaml(cfg), end="")
        return 0
    # heavy: torch
    from llmft.trainer.steps import STOP

    # heavy: torch
    from llmft.trainer.train import Stopped, Trainer

    trainer = Trainer(cfg, warnings)
    code = EXIT_OK
    COMMITTED.clear()
    try:
        trainer.build()
        trainer.train()
        COMMITTED["output"] = f"{cfg.output_dir}/final"
        if STOP.signum:  # it came during the last step or the final save: the run is complete, say so
            print(f"[llmft] {AFTER_COMMIT.format(name=signal.Signals(STOP.signum).name, **COMMITTED)}", file=sys.stderr)
    except Stopped as exc:
        code = exc.exit_code
    except BaseException as exc:
        code = describe_failure(exc, TRAINER)[0]
        raise
    finally:
        trainer.close(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
