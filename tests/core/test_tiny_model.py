from transformers import AutoModelForCausalLM, AutoTokenizer

from llmft.trainer.tiny_model import num_parameters


def test_tiny_model_loads_with_auto_classes(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert 1_000_000 <= num_parameters(model) <= 5_000_000
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert not list(tiny_model_dir.glob("*.bin")), "weights must be safetensors only"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    ids = tok("What is two plus two?").input_ids
    assert tok.decode(ids) == "What is two plus two?"
    assert max(ids) < model.config.vocab_size


def test_tiny_model_is_deterministic(tmp_path):
    from llmft.trainer.tiny_model import build_tiny_model

    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_atomic_outputs_are_readable_by_other_users(tmp_path):
    """mkstemp/mkdtemp default to 0600/0700; artifacts on a shared PVC must not."""
    import os
    import stat

    from llmft.trainer.io import atomic_directory, atomic_write_text

    old = os.umask(0o022)
    try:
        f = atomic_write_text(tmp_path / "a.json", "{}")
        with atomic_directory(tmp_path / "d", kind="test") as d:
            (d / "x").write_text("1")
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755
