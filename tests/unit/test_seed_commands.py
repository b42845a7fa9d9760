"""The reference guides' dataset command lines, run through ``kvtier dataset`` as they are printed.

Each ``SEED_*`` line below is a command line of the guides (comments and
line continuations removed, script name replaced by ``kvtier dataset ...``);
inputs and outputs are relative paths in a temporary working directory, so
even the paths are the printed ones, except the tokenizer's.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.cli import parser, synth_plan
from kvtier.tools.dataset import SynthLayout, synth_paths
from kvtier.tools.model import build_model

# The long-document QA test: 50 % repeats, second pass reversed, QA pairs.
SEED_QA = ("--input multi_news.jsonl --output multi_news_convert.jsonl --top-n 128 --min-length 0 "
           "--max-length 8192 --repeat 2 --source-fields context --count-mode valid-only "
           "--alternate-order True --output-format qa --rounds 4")
# The multi-turn test: one pass, conversations of four human turns.
SEED_MULTI_TURN = ("--input multi_news.jsonl --output multi_news_convert.json --top-n 32 --min-length 1024 "
                   "--max-length 4096 --repeat 1 --source-fields context --count-mode valid-only "
                   "--alternate-order True --output-format multi-turn --rounds 4")
# The converter's example invocation (a JSON array written to a .jsonl name, as the guide does).
SEED_APPENDIX = ("--input multi_news.jsonl --output multi_news_convert.jsonl --top-n 128 --min-length 1024 "
                 "--max-length 8192 --repeat 1 --source-fields context --count-mode valid-only "
                 "--alternate-order True --output-format multi-turn --rounds 4")
# The synthetic long-context generator: 200 prompts of 64,000 tokens, 90 % prefix, 100 prefixes.
SEED_SYNTH = ("--tokenizer-dir {tok} --group_size 1 --num_groups 200 --tokens 64000 --num_diff_prefix 100 "
              "--fraction 90")

# Raw records with lengths 0, 200, .., 9800: 41 in 0..8192, 15 in 1024..4096 (i = 6..20), 35 in 1024..8192.
LENGTHS = [200 * i for i in range(50)]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    rows = [json.dumps({"context": f"doc{i}", "length": n, "_id": i}) for i, n in enumerate(LENGTHS)]
    (tmp_path / "multi_news.jsonl").write_text("\n".join(rows) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def convert(line: str) -> int:
    return cli_main(["dataset", "convert", *shlex.split(line)])


def docs(lo: int, hi: int) -> list[str]:
    return [f"doc{i}" for i, n in enumerate(LENGTHS) if lo <= n <= hi]


def test_seed_qa_line(workdir: Path) -> None:
    assert convert(SEED_QA) == 0
    rows = [json.loads(x) for x in (workdir / "multi_news_convert.jsonl").read_text().splitlines()]
    assert all(r == {"question": r["question"], "answer": ""} for r in rows)
    first = docs(0, 8192)
    assert len(first) == 41
    assert [r["question"] for r in rows] == first + first[::-1]


def conversations(path: Path) -> list[dict]:
    convs = json.loads(path.read_text())
    for k, c in enumerate(convs, 1):
        assert set(c) == {"id", "conversations"} and c["id"] == f"id{k}"
        assert [m["from"] for m in c["conversations"]] == ["human", "gpt"] * 4
        assert all(m["value"] == " " for m in c["conversations"][1::2])
    return convs


def humans(convs: list[dict]) -> list[str]:
    return [m["value"] for c in convs for m in c["conversations"][::2]]


def test_seed_multi_turn_line(workdir: Path) -> None:
    assert convert(SEED_MULTI_TURN) == 0
    convs = conversations(workdir / "multi_news_convert.json")
    # 15 records pass; three conversations of four, three records left over.
    assert humans(convs) == docs(1024, 4096)[:12] and len(convs) == 3


def test_seed_appendix_line(workdir: Path) -> None:
    assert convert(SEED_APPENDIX) == 0
    convs = conversations(workdir / "multi_news_convert.jsonl")
    assert humans(convs) == docs(1024, 8192)[:32] and len(convs) == 8


def test_converter_defaults_are_the_seeds(workdir: Path) -> None:
    # multi_news.jsonl in, test_py_multi_news.jsonl out, top 64 of 1024..4096,
    # two passes (the second reversed), multi-turn, four rounds.
    assert convert("") == 0
    convs = conversations(workdir / "test_py_multi_news.jsonl")
    passed = docs(1024, 4096)
    assert humans(convs) == (passed + passed[::-1])[:28] and len(convs) == 7


@pytest.mark.parametrize("flag,reversed_second", [
    ("--alternate-order True", True), ("--alternate-order true", True), ("--alternate-order", True),
    ("--alternate-order False", False), ("--no-alternate-order", False), ("", True)])
def test_alternate_order_spellings(workdir: Path, flag: str, reversed_second: bool) -> None:
    assert convert(f"--output o.jsonl --output-format qa --min-length 0 --max-length 1000 {flag}") == 0
    got = [json.loads(x)["question"] for x in (workdir / "o.jsonl").read_text().splitlines()]
    first = docs(0, 1000)
    assert got == first + (first[::-1] if reversed_second else first)


def test_alternate_order_refuses_other_words(workdir: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        convert("--alternate-order maybe")
    assert exc.value.code == 2
    assert "--alternate-order" in capsys.readouterr().err
    assert not (workdir / "test_py_multi_news.jsonl").exists()


def test_converter_default_input_missing_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert convert("") == 2
    assert "--input" in (err := capsys.readouterr().err) and "multi_news.jsonl" in err


# --- synth --------------------------------------------------------------------------


def test_seed_synth_line_plans_the_seeds_folder_and_files() -> None:
    # The full line makes 200 prompts of 64k tokens (minutes); its plan is checked here,
    # and the same spellings at a small size run below.
    args = parser().parse_args(["dataset", "synth", *shlex.split(SEED_SYNTH.format(tok="/models/x"))])
    spec, layout, out_dir = synth_plan(args)
    assert args.tokenizer == "/models/x" and layout is SynthLayout.SEED and out_dir == "."
    got = (spec.tokens, spec.fraction, spec.num_diff_prefix, spec.group_size, spec.num_groups, spec.seed)
    assert got == (64000, 90, 100, 1, 200, 202508167)
    folder = "./64000_202508167_ds_p100_gs1_ng200"
    assert synth_paths(spec, out_dir, layout) == (f"{folder}/64000_202508167_full_200_90.jsonl",
                                                  f"{folder}/64000_202508167_pre_90.jsonl")


def test_seed_synth_spellings_write_the_seeds_layout(model_cache_dir: Path, workdir: Path) -> None:
    from transformers import AutoTokenizer

    model = str(build_model("tiny", cache_dir=model_cache_dir))
    # SEED_SYNTH's spellings and order, at a size a unit test can make.
    line = (f"--tokenizer-dir {model} --group_size 2 --num_groups 6 --tokens 300 --num_diff_prefix 3 "
            "--fraction 90")
    assert cli_main(["dataset", "synth", *shlex.split(line)]) == 0
    folder = workdir / "300_202508167_ds_p3_gs2_ng6"
    assert sorted(p.name for p in folder.iterdir()) == ["300_202508167_full_12_90.jsonl",
                                                        "300_202508167_pre_90.jsonl"]
    prompts = [json.loads(x) for x in (folder / "300_202508167_full_12_90.jsonl").read_text().splitlines()]
    prefixes = [json.loads(x) for x in (folder / "300_202508167_pre_90.jsonl").read_text().splitlines()]
    assert len(prompts) == 12 and len(prefixes) == 3
    assert all(set(r) == {"question", "answer"} and r["answer"] == "" for r in prompts + prefixes)
    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok.encode(r["question"], add_special_tokens=False) for r in prompts]
    pre = [tok.encode(r["question"], add_special_tokens=False) for r in prefixes]
    assert all(len(x) == 300 for x in ids) and all(len(p) == 270 for p in pre)
    # Groups of two take the prefixes in mirrored order: 0, 1, 2, 2, 1, 0.
    order = [next(k for k, p in enumerate(pre) if x[:270] == p) for x in ids]
    assert order == [0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0]


def test_synth_layout_and_seed_options(tmp_path: Path) -> None:
    def plan(line: str):
        return synth_plan(parser().parse_args(["dataset", "synth", "--tokenizer", "t", *shlex.split(line)]))

    spec, layout, out = plan(f"--output {tmp_path}")
    assert (layout, spec.seed, out) == (SynthLayout.KVTIER, 0, str(tmp_path))  # kvtier's layout, as before
    spec, layout, out = plan(f"--output {tmp_path} --layout seed --seed 7 --num-groups 4")
    assert (layout, spec.seed, spec.num_groups) == (SynthLayout.SEED, 7, 4)
    assert synth_paths(spec, out, layout)[1] == f"{tmp_path}/3500_7_ds_p10_gs5_ng4/3500_7_pre_50.jsonl"
    spec, layout, _ = plan("--layout kvtier")
    assert layout is SynthLayout.KVTIER and spec.seed == 0
    with pytest.raises(SystemExit):
        plan("--layout other")
