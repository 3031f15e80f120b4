"""A byte-level tokenizer built locally with the ``tokenizers`` library (nothing downloaded).

Every UTF-8 byte is one token (256 ids) plus ``<s>`` and ``</s>``, so any text encodes and
decodes exactly, whatever the model's weights. Saved as ``tokenizer.json`` with a
``tokenizer_config.json`` (``PreTrainedTokenizerFast``, a plain chat template) that vLLM and
transformers load like any Hugging Face tokenizer. Used for the random-weight models of the
vLLM benchmarks and by the stand-in engine's models in tests.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS, EOS = "<s>", "</s>"
SIZE = 258  # 256 bytes + BOS + EOS: a model's vocab_size must be at least this
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_byte_tokenizer(directory: Path, max_length: int = 4096) -> Path:
    """Write the tokenizer files into ``directory``; the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[BOS], vocab[EOS] = len(vocab), len(vocab) + 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS})
    )
    return directory
