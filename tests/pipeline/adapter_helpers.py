"""Real PEFT adapters over the project's tiny model, for the deploy and serving-form tests."""

from __future__ import annotations

from pathlib import Path


def peft_adapter(tiny_model_dir: Path, out: Path, *, dora: bool = False, trained: bool = True) -> Path:
    """A LoRA (or DoRA) adapter r8 on all linear layers, saved as safetensors; ``trained`` gives LoRA B
    non-zero values, as training does (a fresh adapter's B is zero: it changes nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_dora=dora))
    if trained:
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


def deploy_request(volume: Path, adapter: str, **change):
    """A DeployRequest for adapter ``models/m/<adapter>`` on the volume stand-in (base ``base-models/tiny``)."""
    from llmft.components.lib.serving.deployment import DeployRequest

    fields = dict(
        adapter_dir=str(volume / "models" / "m" / adapter),
        base_model=str(volume / "base-models" / "tiny"),
        adapter_name="m",
        version="3",
        deploy=True,
        mode="local",
        name="m-serve",
        namespace="team-a",
        gpus=1,
        max_lora_rank=8,
        pvc_name="llmft-data",
        data_root=str(volume),
        timeout_s=5,
        prompts=("What is the capital of France?",),
    )
    return DeployRequest(**{**fields, **change})
