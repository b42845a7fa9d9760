#!/usr/bin/env bash
# AISBench (PyPI ais-bench-benchmark) against a running OpenAI-compatible
# server, on datasets made by `kvtier dataset`. See docs/aisbench.md.
#
#   scripts/aisbench.sh setup
#   scripts/aisbench.sh qa         --dataset qa.jsonl   [options]   # long-document QA (QA JSONL)
#   scripts/aisbench.sh multi-turn --dataset chat.json  [options]   # multi-turn (ShareGPT JSON)
#
# Options (run mode):
#   --url URL            server (default http://127.0.0.1:8000)
#   --model NAME         served model name (default: the server's first, from /v1/models)
#   --tokenizer DIR      tokenizer AISBench counts tokens with (default: that model's path on the server)
#   --max-out-len N      output tokens per request (default 16)
#   --batch-size N       requests in flight (default 1)
#   --temperature T      (default 0)
#   --ignore-eos         always generate --max-out-len tokens
#   --num-prompts N      only the first N requests
#   --work-dir DIR       results and the generated configs (default aisbench-out)
#
# AISBench lives in its own virtualenv, $KVTIER_AISBENCH_VENV (default
# ~/.cache/kvtier/aisbench-venv): its pins (numpy<2, transformers,
# datasets, ...) do not fit beside vLLM's.
set -euo pipefail

VENV="${KVTIER_AISBENCH_VENV:-$HOME/.cache/kvtier/aisbench-venv}"
VERSION="${KVTIER_AISBENCH_VERSION:-3.1.20260630}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

die() { echo "aisbench.sh: $*" >&2; exit 2; }

setup() {
    local py="${PYTHON:-python3.11}"
    command -v "$py" >/dev/null || die "PYTHON=$py: not found (AISBench needs Python 3.10 or 3.11)"
    [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
    local cons
    cons="$(mktemp)"
    # ais_bench pins numpy<2, but pyarrow 22+ needs numpy 2: without this pin
    # every ais_bench command fails at import (and `pip check` sees nothing).
    echo 'pyarrow<22' >"$cons"
    # Without a pin pip takes PyPI's CUDA torch (GBs): reuse the CPU torch
    # kvtier's own environment has, when there is one.
    local torch="${KVTIER_AISBENCH_TORCH:-}"
    if [ -z "$torch" ] && [ -x "$ROOT/.venv/bin/python" ]; then
        torch="$("$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' \
                 2>/dev/null || true)"
    fi
    case "$torch" in *+cpu) echo "torch==$torch" >>"$cons" ;; esac
    echo "installing ais-bench-benchmark==$VERSION into $VENV (constraints: $(tr '\n' ' ' <"$cons"))"
    "$VENV/bin/pip" install -q -c "$cons" "ais-bench-benchmark==$VERSION"
    rm -f "$cons"
    "$VENV/bin/ais_bench" -h >/dev/null || die "ais_bench installed but does not start"
    echo "AISBench ready: $VENV/bin/ais_bench"
}

# Writes the model config (and for multi-turn the dataset config) into
# $1/configs; AISBench searches --config-dir before its built-in configs,
# so nothing in site-packages is edited.
write_configs() {
    local dir="$1" kind="$2"
    mkdir -p "$dir/configs/models/kvtier" "$dir/configs/datasets/kvtier"
    cat >"$dir/configs/models/kvtier/kvtier_chat_stream.py" <<EOF
from ais_bench.benchmark.models import VLLMCustomAPIChat
from ais_bench.benchmark.utils.postprocess.model_postprocessors import extract_non_reasoning_content

models = [
    dict(
        attr="service",
        type=VLLMCustomAPIChat,
        abbr="kvtier-chat-stream",
        path=$(py_str "$TOKENIZER"),
        model=$(py_str "$MODEL"),
        stream=True,
        request_rate=0,
        # Attempts, not retries: AISBench sends a request range(retry) times
        # at most, so 0 sends nothing (every request "fails" with no reason).
        # One attempt: a resent request would hit the cache its first try filled.
        retry=1,
        api_key="",
        host_ip=$(py_str "$HOST"),
        host_port=$PORT,
        url="",
        max_out_len=$MAX_OUT_LEN,
        batch_size=$BATCH_SIZE,
        trust_remote_code=False,
        generation_kwargs=dict(temperature=$TEMPERATURE, ignore_eos=$IGNORE_EOS),
        pred_postprocessor=dict(type=extract_non_reasoning_content),
    )
]
EOF
    if [ "$kind" = multi-turn ]; then
        # The built-in sharegpt_gen with our file; "every" mode sends turn by
        # turn and carries the server's answers, as `kvtier bench` does.
        cat >"$dir/configs/datasets/kvtier/kvtier_sharegpt.py" <<EOF
from ais_bench.benchmark.datasets import ShareGPTDataset, ShareGPTEvaluator
from ais_bench.benchmark.openicl.icl_inferencer import MultiTurnGenInferencer
from ais_bench.benchmark.openicl.icl_prompt_template import MultiTurnPromptTemplate
from ais_bench.benchmark.openicl.icl_retriever import ZeroRetriever

kvtier_sharegpt_datasets = [
    dict(
        abbr="kvtier-sharegpt",
        type=ShareGPTDataset,
        disable_shuffle=True,
        path=$(py_str "$DATASET"),
        reader_cfg=dict(input_columns=["question", "answer"], output_column="answer"),
        infer_cfg=dict(
            prompt_template=dict(type=MultiTurnPromptTemplate, template=dict(round=[
                dict(role="HUMAN", prompt="{question}"), dict(role="BOT", prompt="{answer}")])),
            retriever=dict(type=ZeroRetriever),
            inferencer=dict(type=MultiTurnGenInferencer, infer_mode="every"),
        ),
        eval_cfg=dict(evaluator=dict(type=ShareGPTEvaluator)),
    )
]
EOF
    fi
}

py_str() { "$VENV/bin/python" -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$1"; }

run() {
    local kind="$1"; shift
    URL=http://127.0.0.1:8000 MODEL="" TOKENIZER="" MAX_OUT_LEN=16 BATCH_SIZE=1 TEMPERATURE=0
    IGNORE_EOS=False DATASET="" WORK=aisbench-out NUM_PROMPTS=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --url) URL="${2:?--url needs a value}"; shift 2 ;;
            --model) MODEL="${2:?--model needs a value}"; shift 2 ;;
            --tokenizer) TOKENIZER="${2:?--tokenizer needs a value}"; shift 2 ;;
            --max-out-len) MAX_OUT_LEN="${2:?--max-out-len needs a value}"; shift 2 ;;
            --batch-size) BATCH_SIZE="${2:?--batch-size needs a value}"; shift 2 ;;
            --temperature) TEMPERATURE="${2:?--temperature needs a value}"; shift 2 ;;
            --ignore-eos) IGNORE_EOS=True; shift ;;
            --num-prompts) NUM_PROMPTS="${2:?--num-prompts needs a value}"; shift 2 ;;
            --dataset) DATASET="${2:?--dataset needs a value}"; shift 2 ;;
            --work-dir) WORK="${2:?--work-dir needs a value}"; shift 2 ;;
            *) die "unknown option $1 (see the head of $0)" ;;
        esac
    done
    [ -x "$VENV/bin/ais_bench" ] || die "AISBench is not installed in $VENV: run $0 setup"
    [ -n "$DATASET" ] || die "--dataset: required"
    [ -f "$DATASET" ] || die "--dataset: $DATASET: no such file"
    DATASET="$(cd "$(dirname "$DATASET")" && pwd)/$(basename "$DATASET")"
    for n in MAX_OUT_LEN BATCH_SIZE; do
        [[ "${!n}" =~ ^[1-9][0-9]*$ ]] || die "--$(echo "$n" | tr 'A-Z_' 'a-z-'): ${!n}: expected a positive integer"
    done
    [[ "$TEMPERATURE" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--temperature: $TEMPERATURE: expected a number"
    [[ "$URL" =~ ^https?://([^/:]+):([0-9]+)/?$ ]] || die "--url: $URL: expected http://HOST:PORT"
    HOST="${BASH_REMATCH[1]}" PORT="${BASH_REMATCH[2]}"
    # Served name and weights path (vLLM reports the path as the model's root).
    local info
    info="$("$VENV/bin/python" - "$URL" <<'EOF'
import json, sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1].rstrip("/") + "/v1/models", timeout=30) as r:
        m = json.load(r)["data"][0]
except Exception as err:
    sys.exit(f"aisbench.sh: --url: {sys.argv[1]}: no OpenAI-compatible server answers ({err})")
print(m["id"]); print(m.get("root") or "")
EOF
)" || exit 2
    [ -n "$MODEL" ] || MODEL="$(sed -n 1p <<<"$info")"
    [ -n "$TOKENIZER" ] || TOKENIZER="$(sed -n 2p <<<"$info")"
    [ -d "$TOKENIZER" ] || die "--tokenizer: '$TOKENIZER' is not a directory here (pass the model's tokenizer folder)"
    mkdir -p "$WORK"
    WORK="$(cd "$WORK" && pwd)"
    write_configs "$WORK" "$kind"
    local args=(--config-dir "$WORK/configs" --models kvtier_chat_stream --mode perf --num-warmups 0 -w "$WORK")
    [ -z "$NUM_PROMPTS" ] || args+=(--num-prompts "$NUM_PROMPTS")
    if [ "$kind" = qa ]; then
        args+=(--custom-dataset-path "$DATASET")
    else
        args+=(--datasets kvtier_sharegpt)
    fi
    echo "+ ais_bench ${args[*]}"
    # Warm-ups are off: they would put prompts of the dataset in the cache
    # before the measured run.
    "$VENV/bin/ais_bench" "${args[@]}"
}

case "${1:-}" in
    setup) setup ;;
    qa|multi-turn) run "$@" ;;
    *) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
