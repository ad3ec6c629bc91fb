"""bench.cpu_trees: the kind read off the CPU's flags, each target read out of its step's results, the table."""

from __future__ import annotations

import json

import pytest

from bench import cpu_trees


def test_the_kind_comes_from_the_flags_that_set_the_kernels_speed():
    base = {"avx2", "fma", "f16c"}
    assert cpu_trees.kind(base | {"avx512f", "avx512_vnni", "amx_tile", "amx_int8"}) == "Intel with AMX"
    assert cpu_trees.kind(base | {"avx512f", "avx512_vnni", "avx_vnni"}).startswith("AMD Zen 5")
    assert cpu_trees.kind(base | {"avx512f", "avx512_vnni"}).startswith("AMD Zen 4")
    assert cpu_trees.kind(base).startswith("AVX2-only")
    assert cpu_trees.kind(base | {"avx512f"}).startswith("another kind")  # AVX-512 without VNNI: none of ours


def results(tree_ms: tuple[float, float], differ: int) -> dict:
    """The parts of each step's JSON that the targets read, as the benchmarks write them."""
    return {
        "engine": {"forward": [{"engine": "splitspec tree", "n": 1, "ms": tree_ms[0]},
                               {"engine": "splitspec tree", "n": 17, "ms": tree_ms[1]},
                               {"engine": "splitspec chain", "n": 17, "ms": 999.0}],
                   "memory": {"read_gb_per_s": {"forward": 34.5}}},
        "plain": {"llama_cpp": {"plain_side_by_side": {"median_ratio": 1.01}}},
        "local": {"summary": {"qwen2.5-coder-0.5b": {"humaneval": {"median_speedup": 1.22},
                                                      "mt-bench": {"median_speedup": 0.89}},
                              "prompt-lookup": {"mt-bench": {"median_speedup": 1.13}}}},
        "network": {"against_api": {"4g": {"humaneval": {"qwen2.5-coder-0.5b-adaptive": {"speed_vs_api": 1.26},
                                                         "qwen2.5-coder-0.5b+lookup-auto": {"speed_vs_api": 1.8}}}}},
        "paths": {"decode": {"none fp32": {"differ_from_plain": None, "differ_from_hf": 0},
                             "eagle fp32+int4": {"differ_from_plain": differ, "differ_from_hf": None}}},
    }  # fmt: skip


def test_each_target_is_read_from_its_step_and_judged_for_the_kind():
    zen4 = cpu_trees.targets("AMD Zen 4 kind (AVX-512 VNNI, no AVX-VNNI)", results((32.0, 96.0), differ=0))
    got = {r["target"].split(",")[0].split(" (")[0]: (r["measured"], r["verdict"]) for r in zen4}
    assert got["17 tokens ÷ 1 token"] == (3.0, "**met**")  # at most 3.0 on Zen 4
    assert got["plain decoding ÷ llama.cpp's"] == (1.01, "not met")
    assert got["the qwen2.5-coder-0.5b --local on code"] == (1.22, "no target for this kind")
    assert got["the default drafter"] == (1.13, "**met**")
    assert got["4g"] == (1.26, "no target for this kind")
    assert got["every drafter on every path gives plain decoding's tokens"] == (0, "**met**")
    zen5 = cpu_trees.targets("AMD Zen 5 kind (AVX-512 VNNI and AVX-VNNI)", results((32.0, 96.0), differ=1))
    verdicts = [r["verdict"] for r in zen5]
    assert verdicts[0] == "not met" and verdicts[2] == "not met" and verdicts[4] == "not met"  # 1.8x, 1.8x, 1.5x
    assert verdicts[5] == "not met"  # one prompt differs
    assert "the qwen2.5-coder-0.5b: 0.89×" in zen5[3]["note"] and "mode auto: 1.80×" in zen5[4]["note"]


def test_the_tree_row_names_the_least_ratio_the_memory_and_the_multiplies_allow():
    engine = results((32.0, 96.0), differ=0)["engine"]
    assert cpu_trees.floor(engine) is None  # no peak measured: no bound
    engine["int8_rates"] = {"fp32+lowbit": {"build": "avx2", "g_macs_per_token": 1.31, "peak_g_per_s": 377.0}}
    engine["memory"]["gb_per_token"] = {"fp32+lowbit": 1.0}
    # one token >= 1.0 GB / 34.5 GB/s = 29.0 ms; 17 >= 17 x 1.31 G / 377 G/s = 59.1 ms
    assert cpu_trees.floor(engine) == pytest.approx(17 * 1.31 / 377 * 34.5)
    row = cpu_trees.targets("AVX2-only kind (\"Zen 3\")", {"engine": engine})[0]
    assert row["note"].endswith("the multiply instruction's peak allow ≥ 2.04×")
    engine["int8_rates"]["fp32+lowbit"]["peak_g_per_s"] = 4000.0  # multiplies that cost nothing: the memory's bound
    assert cpu_trees.floor(engine) == 1.0


def test_a_step_that_did_not_run_is_not_measured():
    rows = cpu_trees.targets("AVX2-only kind (\"Zen 3\")", {step: None for step in cpu_trees.STEPS})
    assert {r["verdict"] for r in rows} == {"not measured"}


def test_the_table_names_the_kind_every_target_and_each_step(tmp_path):
    result = {"environment": {"command": "python -m bench.cpu_trees", "date": "2026-11-30", "cpu": "AMD EPYC",
                              "cpu_count": 2, "kernels": "avx512-vnni"},
              "kind": "AMD Zen 4 kind (AVX-512 VNNI, no AVX-VNNI)",
              "steps": {"engine": "ran", "plain": "not run: needs --llama-bench", "local": "ran", "network": "ran",
                        "paths": "failed (exit 1)"},
              "targets": cpu_trees.targets("AMD Zen 4 kind (AVX-512 VNNI, no AVX-VNNI)", results((30.0, 120.0), 0))}
    md = cpu_trees.markdown(json.loads(json.dumps(result)))  # fmt: skip
    assert "**AMD Zen 4 kind (AVX-512 VNNI, no AVX-VNNI)**" in md
    assert "| 17 tokens ÷ 1 token, the 1.5B as a tree | 4.00× | ≤ 3.00× | not met |" in md
    assert "gives plain decoding's tokens (prompts that differ) | 0 | ≤ 0 | **met** |" in md
    assert "* [engine](engine/engine.md): ran" in md and "* plain: not run: needs --llama-bench" in md
    assert "* [paths](paths/engine.md): failed (exit 1)" in md


def test_bad_steps_and_a_missing_llama_bench_are_named(capsys):
    with pytest.raises(SystemExit):
        cpu_trees.parse_args(["--steps", "engine,kernels"])
    assert "unknown step(s) kernels: expected some of engine, plain, local, network, paths" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cpu_trees.parse_args(["--llama-bench", "/nonexistent/llama-bench"])
    assert "--llama-bench /nonexistent/llama-bench: no such file" in capsys.readouterr().err


def test_each_step_runs_its_benchmark_and_plain_needs_llama_bench(tmp_path):
    lines = cpu_trees.commands("python", tmp_path, None, None, quick=True)
    assert lines["plain"] is None
    assert lines["engine"][:3] == ["python", "-m", "bench.engine"] and "--llama-bench" not in lines["engine"]
    assert lines["local"][lines["local"].index("--out") + 1] == str(tmp_path / "local")
    with_llama = cpu_trees.commands("python", tmp_path, "/bin/llama-bench", "/m.gguf", quick=False)
    assert with_llama["engine"][with_llama["engine"].index("--gguf") + 1] == "/m.gguf"
    assert with_llama["plain"][with_llama["plain"].index("--llama-rounds") + 1] == "7"
