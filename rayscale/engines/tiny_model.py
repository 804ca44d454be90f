"""A tiny Qwen2-architecture model that vLLM's CPU build can serve on two cores.

Nothing is downloaded: the config is written here, the tokenizer is trained here on a built-in
corpus with the `tokenizers` library, and vLLM fills the weights with `load_format="dummy"`.
The output text is gibberish, but every token goes through real batched inference.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

# Bumped whenever the files below change, so a stale cache directory is rewritten.
TINY_MODEL_VERSION = 1
DEFAULT_NAME = "tiny-qwen2"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen2 uses; vLLM's chat endpoint renders it with jinja2.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough English and code to give the BPE merges something to learn; deterministic by construction.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A tiny model serves requests on two cores.
Ray Serve routes requests to replicas; vLLM batches tokens and streams them back to the client.
Time to first token and time per output token are what users feel; tokens per second is what they pay for.
def hello(name: str) -> str:
    return f"hello, {name}!"
for i in range(10):
    print(i * i)
class Server:
    def __init__(self, port: int) -> None:
        self.port = port
import json, os, sys
The autoscaler watches load, plans replicas per model and flavor, and makes the cluster match.
Accelerators: A10G, L4, L40S, A100, H100, Inferentia2, Trainium. Prices per hour, spot and on-demand.
user assistant system message content role hello world please answer the question briefly.
What is the capital of France? Paris is the capital of France. Count to ten: one two three four five
six seven eight nine ten. 0 1 2 3 4 5 6 7 8 9 10 100 1000 { } [ ] ( ) < > = + - * / , . ; : ! ?
"""


def default_model_dir(name: str = DEFAULT_NAME) -> Path:
    base = Path(os.environ.get("RAYSCALE_CACHE_DIR", Path.home() / ".cache" / "rayscale"))
    return base / "models" / name


def model_config(vocab_size: int, eos_id: int) -> dict[str, Any]:
    """Qwen2 config small enough for two cores; head_dim 32 is one the CPU attention backend accepts."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _fingerprint(vocab_size: int) -> str:
    blob = json.dumps([TINY_MODEL_VERSION, vocab_size, _CORPUS, CHAT_TEMPLATE, SPECIAL_TOKENS])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_tiny_model(model_dir: str | Path | None = None, vocab_size: int = 512) -> Path:
    """Write config, tokenizer and chat template into ``model_dir`` unless already there; return it.

    Idempotent and safe against concurrent callers (several Ray replicas may call it at once):
    every file is written atomically and a stamp file, written last, marks a complete directory.
    """
    path = Path(model_dir) if model_dir is not None else default_model_dir()
    path.mkdir(parents=True, exist_ok=True)
    stamp = path / ".rayscale-tiny-model"
    fingerprint = _fingerprint(vocab_size)
    if stamp.exists() and stamp.read_text().strip() == fingerprint:
        return path

    tok = _train_tokenizer(vocab_size)
    eos_id = tok.token_to_id("<|endoftext|>")
    # The model's vocabulary is exactly the tokenizer's, so every sampled id decodes to text.
    actual_vocab = tok.get_vocab_size()
    tok_json = tok.to_str()
    _atomic_write(path / "tokenizer.json", tok_json)
    _atomic_write(path / "config.json", json.dumps(model_config(actual_vocab, eos_id), indent=2))
    _atomic_write(
        path / "tokenizer_config.json",
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        ),
    )
    _atomic_write(
        path / "generation_config.json",
        json.dumps({"eos_token_id": [eos_id, tok.token_to_id("<|im_end|>")], "do_sample": True}, indent=2),
    )
    _atomic_write(stamp, fingerprint + "\n")
    return path


def main() -> None:  # pragma: no cover - convenience for `python -m rayscale.engines.tiny_model`
    import sys

    print(ensure_tiny_model(sys.argv[1] if len(sys.argv) > 1 else None))


if __name__ == "__main__":
    main()
