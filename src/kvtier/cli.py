"""``kvtier``: one command line for the cache and its tools.

Subcommands: ``demo`` (serve a model with kvtier and show the gain),
``model build`` (make a small test model on disk).
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
