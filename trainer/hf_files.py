"""The files of a Hugging Face model folder that make up its tokenizer (and chat template).

Torch-free on purpose: the promote step runs on the pipeline image, which has no torch; export
(trainer/export.py) and promote (components/lib/promote.py) copy the same set."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
