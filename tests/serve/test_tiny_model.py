from __future__ import annotations

import json
from pathlib import Path

from rayscale.engines.tiny_model import CHAT_TEMPLATE, ensure_tiny_model


def test_tiny_model_files_are_written_once(tmp_path: Path) -> None:
    d = ensure_tiny_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 32
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert ensure_tiny_model(tmp_path / "m") == d
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes


def test_tokenizer_round_trips_and_renders_chat(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    d = ensure_tiny_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(d))
    cfg = json.loads((d / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"]
    text = "def hello(name): return 'hi, ' + name  # ünïcode too"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.chat_template == CHAT_TEMPLATE
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
