"""`python -m llmft.trainer [--config FILE] [key=value ...]`: what every rank runs.

parse -> build -> run -> close. Exit codes follow the Training Operator's
ExitCode restart policy: 0 done; 1 bad config or data, or too many non-finite
steps (permanent); 143 preempted by SIGTERM after committing a checkpoint
(retryable: the restarted pod resumes from it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

EPILOG = """examples:
  python -m llmft.trainer --config trainer/configs/tiny-cpu.yaml data=/data/tok output_dir=/runs/a
  torchrun --nproc-per-node 8 -m llmft.trainer --config trainer/configs/qwen2.5-7b-lora-1xh100.yaml optim.lr=1e-4
exit codes: 0 ok, 1 config/data error or non-finite training, 143 preempted (checkpoint committed)"""


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


def _rank_prefix() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""


def main(argv: list[str] | None = None) -> int:
    from llmft.trainer.errors import EXIT_USER_ERROR, LlmftError

    args = build_parser().parse_args(argv)
    use_expandable_segments()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except LlmftError as exc:
        print(f"{_rank_prefix()}error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


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
    from llmft.trainer.config import config_to_dict, load_config, validate

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    warnings = validate(cfg)
    from llmft.trainer.loop import Preempted

    if cfg.method == "full":
        from llmft.trainer.full_finetune import FullFinetuneRecipe as Recipe
    else:
        from llmft.trainer.lora_finetune import LoRAFinetuneRecipe as Recipe
    recipe = Recipe(cfg, warnings)
    try:
        recipe.setup()
        recipe.train()
    except Preempted as exc:
        return exc.exit_code
    finally:
        recipe.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
