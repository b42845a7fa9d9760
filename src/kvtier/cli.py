"""``kvtier``: one command line for the cache and its tools.

Subcommands: ``demo`` (serve a model with kvtier and show the gain),
``disk prepare|check|release`` (SSD tier paths), ``model build`` (make a
small test model on disk).
"""

from __future__ import annotations

import argparse
import sys

from kvtier.errors import KvtierError


def _demo(args: argparse.Namespace) -> int:
    from kvtier.tools.demo import DemoOptions, run_demo

    run_demo(DemoOptions(geometry=args.model, docs=args.docs, doc_tokens=args.doc_tokens,
                         device_blocks=args.device_blocks, dram_size=args.dram_size, log_path=args.server_log))
    return 0


def _model_build(args: argparse.Namespace) -> int:
    from kvtier.tools.model import build_model

    print(build_model(args.geometry, cache_dir=args.cache_dir, dtype=args.dtype))
    return 0


def _disk_prepare(args: argparse.Namespace) -> int:
    from kvtier.config import parse_size
    from kvtier.tools.disk import prepare

    path = prepare(args.path, parse_size("--size", args.size), loop=args.loop, force=args.force)
    print(path)
    print(f'connector extra config: "ssd_path": "{path}", "ssd_size": "{args.size}"', file=sys.stderr)
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


def parser() -> argparse.ArgumentParser:
    from kvtier.tools.model import GEOMETRIES

    p = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache pool for vLLM")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="serve a test model with kvtier; print TTFT and hit rates")
    d.add_argument("--model", default="bench", choices=sorted(GEOMETRIES), help="test model geometry")
    d.add_argument("--docs", type=int, default=6, help="number of documents")
    d.add_argument("--doc-tokens", type=int, default=3000, help="tokens per document")
    d.add_argument("--device-blocks", type=int, default=110, help="vLLM device cache size in blocks of 64")
    d.add_argument("--dram-size", default="1GB", help="kvtier DRAM tier size")
    d.add_argument("--server-log", default=None, help="where the vLLM server's log goes")
    d.set_defaults(func=_demo)

    disk = sub.add_parser("disk", help="prepare, check and release SSD tier paths")
    dsub = disk.add_subparsers(dest="disk_command", required=True)
    dp = dsub.add_parser("prepare", help="create a pre-allocated file (and a loop device on it)")
    dp.add_argument("path")
    dp.add_argument("--size", required=True, help="e.g. 64GB")
    dp.add_argument("--loop", action="store_true", help="attach a loop device with direct I/O (root)")
    dp.add_argument("--force", action="store_true", help="reuse an existing file")
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

    m = sub.add_parser("model", help="small test models")
    msub = m.add_subparsers(dest="model_command", required=True)
    b = msub.add_parser("build", help="build (or find cached) a test model; print its directory")
    b.add_argument("--geometry", default="tiny", choices=sorted(GEOMETRIES))
    b.add_argument("--cache-dir", default=None)
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.set_defaults(func=_model_build)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KvtierError as err:
        print(f"kvtier: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
