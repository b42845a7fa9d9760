"""The demo refuses options under which its table would mislabel its rows."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.demo import DemoOptions, check_options, serving_dtype


@pytest.mark.parametrize("kw,key", [
    ({"docs": 0}, "--docs"),
    ({"docs": 40}, "--docs"),  # more than the library's 30 reference pages: refused before any model is built
    ({"docs": 2}, "--docs"),  # 2 x 48 blocks fit 110: the repeats would be device hits, not kvtier's
    ({"doc_tokens": 8000}, "--doc-tokens"),  # longer than the device cache
])
def test_options_the_table_could_not_honour_are_refused(kw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_options(DemoOptions(**kw))
    assert info.value.key == key


def test_the_defaults_and_the_e2e_tests_options_pass() -> None:
    check_options(DemoOptions())
    check_options(DemoOptions(geometry="tiny", docs=3, doc_tokens=800, device_blocks=30))


@pytest.mark.parametrize("flags, dtype", [
    ("fpu sse2 avx avx2 fma", "float32"),  # AVX2 only (an AMD EPYC of these machines): bf16 emulated
    ("fpu avx avx2 avx512f avx512bw", "float32"),  # AVX-512 without bf16 instructions
    ("fpu avx avx2 avx512f avx512_bf16", "bfloat16"),
    ("fpu avx avx2 avx512f amx_bf16 amx_tile", "bfloat16"),
    ("fp asimd bf16", "bfloat16"),  # not x86: vLLM's own kernels decide
])
def test_the_demo_serves_in_float32_where_the_cpu_would_emulate_bf16(tmp_path, monkeypatch, flags: str,
                                                                      dtype: str) -> None:
    import kvtier.tools.serve as serve_mod

    monkeypatch.setattr(serve_mod, "cuda_build", lambda: False)  # vLLM's CPU build, as here
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert serving_dtype(real=False, cpuinfo=str(info)) == dtype
    assert serving_dtype(real=True, cpuinfo=str(info)) == dtype
    assert serving_dtype(real=False, cpuinfo=str(tmp_path / "none")) == "bfloat16"
    monkeypatch.setattr(serve_mod, "cuda_build", lambda: True)  # the model on a GPU: the host's CPU does not matter
    assert serving_dtype(real=True, cpuinfo=str(info)) == "bfloat16"


@pytest.mark.parametrize("flags, chosen", [([], "float32"), (["--dtype", "bfloat16"], "bfloat16")])
def test_bench_compare_takes_the_demos_dtype_unless_told(monkeypatch, capsys, flags: list[str], chosen: str) -> None:
    """``kvtier bench compare`` without --dtype serves as the demo does
    (here a CPU that would emulate bf16); --dtype is taken as given."""
    import kvtier.tools.demo as demo
    import kvtier.tools.loadgen as loadgen
    import kvtier.tools.server as server
    from kvtier.cli import main as cli_main

    monkeypatch.setattr(demo, "serving_dtype", lambda real: "float32")
    monkeypatch.setattr(loadgen, "load_workload", lambda *a: [])
    started: list[str | None] = []

    def start(self: server.VllmServer) -> server.VllmServer:
        started.append(self.options.dtype)
        raise server.ServerError("not started (test)")

    monkeypatch.setattr(server.VllmServer, "start", start)
    assert cli_main(["bench", "compare", "--model-dir", "/nonexistent", "--configs", "vllm",
                     "--dataset", "unused.jsonl", *flags]) == 2
    assert started == [chosen]
    assert "not started (test)" in capsys.readouterr().err
