"""``auto`` chooses by measurement: the choice rule on injected tables (an AMX-like machine, a Zen 5, an AVX2 one),
the extrapolation from a timed slice on an injected clock, the cache, and the kernel build chosen by timing."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shared.engine import kernels, paths
from shared.engine.decoder import ModelConfig
from shared.engine.models import on_q4_grid, resolve_precision, served_paths
from shared.engine.paths import PATHS, Table


def table(ms: dict[str, tuple[float, float, float]]) -> Table:
    return Table({p: dict(zip(paths.SIZES, v, strict=True)) for p, v in ms.items()}, "test CPU", "avx2", 2, "now")


# measured shapes of the three kinds of machine (ms for 1, 5, 17 tokens), rounded
AMX = table({"int4": (9, 14, 30), "int8": (11, 15, 32), "bf16": (14, 15, 17), "fp32": (30, 40, 60)})
ZEN5 = table({"int4": (3.3, 4.3, 9.1), "int8": (4.4, 5.5, 11.3), "bf16": (17, 18, 23), "fp32": (40, 56, 77)})
AVX2 = table({"int4": (7, 12, 30), "int8": (10, 15, 40), "bf16": (50, 60, 142), "fp32": (80, 120, 176)})


def test_one_path_serves_every_job_the_cheapest_work_mix():
    """Plain decoding and trees may be fastest on different paths (AMX: int4 for one token, bf16 for trees; AVX2:
    int4 and int8): one path is chosen for both, by the summed cost of a 1-, 5- and 17-token forward."""
    assert AMX.choose() == "bf16"  # 46 ms of mix against int4's 53
    assert AMX.choose(["int4", "fp32"]) == "int4"  # the file's own values: bf16 would round them again
    assert ZEN5.choose() == "int4"  # avx512_bf16 without AMX: slow
    assert AVX2.choose() == "int4" and AVX2.choose(["int8", "bf16", "fp32"]) == "int8"
    with pytest.raises(ValueError, match="none of the paths"):
        ZEN5.choose(["fp16"])


def test_a_drafter_takes_the_path_cheapest_for_drafting():
    """A model drafting runs steps of a few rows and the catch-up after a round, never a 17-row tree: its path is
    the cheapest 1 + 5-token mix, where a target's (1 + 5 + 17) would give AMX's drafters bf16 or int8 tiles, whose
    one row streams 2-4x int4's bytes."""
    assert AMX.choose(mix=paths.DRAFT_MIX) == "int4" and AMX.choose() == "bf16"
    tied = table({"int4": (23.5, 28.5, 46.1), "int8": (26.8, 30.6, 39.8)})  # the 0.5B's table on AMX, 2026-11-29
    assert tied.choose() == "int8" and tied.choose(mix=paths.DRAFT_MIX) == "int4"
    line = tied.line("int4", "a drafter", paths.DRAFT_MIX)
    assert "ms of a 1 + 5-token mix" in line and "int4 52.0, int8 57.4" in line
    apart = table({"int4": (20.0, 25.0, 80.0), "int8": (24.0, 29.0, 40.0)})  # far apart for a target, not a drafter
    assert apart.cost("int8") < apart.cost("int4") / paths.CLOSE and paths.close_calls(apart) == ["int4", "int8"]


def test_layers_are_timed_in_the_files_own_shares_of_kinds():
    """A Q4_K_M file keeps some layers' down projections and v in Q6_K: a slice of its first layers would time
    those only (the 1.5B's 0 and 1 are), so a slice holds each kind of layer in its share of the file."""
    from shared.engine.gguf import sample_layers

    q6, q4 = ("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")
    mixed = [q6, q6, q4, q4, q4, q6, q6, q6, q6, q6, q6, q4, q4, q6] + [q4, q6] * 7  # 28, the 1.5B's order
    assert sample_layers(mixed, 4) == [0, 1, 2, 3] and sample_layers(mixed, 2) == [0, 2]
    assert sample_layers(mixed, 28) == list(range(28))
    picked = sample_layers([q6] * 3 + [q4] * 9, 4)  # a quarter of them: one of the four
    assert sum(1 for i in picked if i < 3) == 1 and len(picked) == 4
    with pytest.raises(ValueError, match="5 layers of 4"):
        sample_layers([q4] * 4, 5)


def test_the_start_up_line_names_the_choice_why_and_its_figures():
    line = ZEN5.line("int4", "the file's own values")
    assert "serving path int4 (the file's own values)" in line and "int4 16.7" in line and "bf16 58.0" in line
    assert "splitspec kernels" in line
    assert "| int4 | 3.30 | 4.30 | 9.10 | 1.30x | 2.76x | 16.70 |" in ZEN5.markdown()


def test_a_table_survives_its_json_and_an_old_version_is_measured_anew():
    again = Table.from_json(json.loads(json.dumps(ZEN5.to_json())))
    assert again == ZEN5
    with pytest.raises(ValueError, match="version"):
        Table.from_json({**ZEN5.to_json(), "version": 0})


def test_auto_resolves_to_the_measured_path(monkeypatch, tiny_model_dir, q4_model_dir):
    """With both auto the measured path is served; a pinned dtype is served as pinned; a checkpoint on the Q4_1 grid
    keeps its own values (int4 or fp32, never int8 or bf16 unless pinned), one that is not never gets int4 (a second
    rounding), and a drafter may take any path."""
    monkeypatch.setattr(paths, "table_for", lambda cfg, cache=None, refresh=False, own=None: AMX)
    path, q4 = str(tiny_model_dir), str(q4_model_dir)
    assert not on_q4_grid(path) and on_q4_grid(q4)
    assert resolve_precision("cpu", "auto", "auto", path) == PATHS["bf16"]
    assert resolve_precision("cpu", "bfloat16", "auto", path) == ("bfloat16", "native")
    assert resolve_precision("cpu", "float32", "native", path) == ("float32", "native")
    assert resolve_precision("cpu", "auto", "int4", path) == ("float32", "int4")
    assert resolve_precision("cpu", "auto", "native", path) == ("bfloat16", "native")  # bf16 46 < fp32 130
    if kernels.available():
        assert resolve_precision("cpu", "auto", "auto", q4) == ("float32", "lowbit")  # not bf16, though cheaper
        assert resolve_precision("cpu", "auto", "auto", q4, rounding=True) == PATHS["int4"]  # a drafter: 1 + 5
        assert served_paths(q4)[0] == ["int4", "fp32"] and "int4" not in served_paths(path)[0]
        monkeypatch.setattr(paths, "table_for", lambda cfg, cache=None, refresh=False, own=None: AVX2)
        assert resolve_precision("cpu", "auto", "auto", path) == PATHS["int8"]  # int4 ruled out
        assert resolve_precision("cpu", "auto", "auto", q4) == ("float32", "lowbit")


def test_a_slice_is_timed_and_extrapolated_to_the_whole_model(monkeypatch, tiny_model_dir):
    """On an injected clock that advances 1 ms a reading, each forward and each head call 'takes' 1 ms: the table
    then says exactly how the slice was scaled (layers by L / built, head by vocabulary / rows built)."""
    from transformers import AutoConfig

    cfg = dataclasses.replace(ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir)), num_layers=40,
                              vocab_size=100_000)  # fmt: skip
    monkeypatch.setattr(paths, "SPILL_BYTES", 100_000)  # a slice of 1 layer and 391 vocabulary rows
    ticks = iter(range(10**6))
    got = paths.measure(cfg, ["fp32"], clock=lambda: next(ticks) / 1000, repeats=3)
    per_layer = paths._layer_params(cfg) * 4
    layers = min(cfg.num_layers, -(-paths.SPILL_BYTES // per_layer))
    rows = min(cfg.vocab_size, -(-paths.SPILL_BYTES // (4 * cfg.hidden_size)))
    assert (layers, rows) == (1, 391)
    want = cfg.num_layers / layers + cfg.vocab_size / rows
    for n in paths.SIZES:
        assert got.ms["fp32"][n] == pytest.approx(want)


def test_a_close_call_is_timed_again_and_the_faster_timing_kept(monkeypatch):
    """int4 and int8 within 20 % of each other are timed a second time, in the other order, and each keeps its faster
    timing: a slow moment during int4's first timing (12.2 ms against int8's 11.5) no longer picks int8; a path far
    behind (bf16) is timed once."""
    script = {"int4": [12.2, 9.4], "int8": [11.5, 12.3], "bf16": [45.0]}
    calls = []

    def timed(cfg, path, clock, repeats, slices=None, drop_above=None, own=None):
        calls.append(path)
        ms = script[path].pop(0)
        return {n: ms * n for n in paths.SIZES}

    monkeypatch.setattr(paths, "_time_path", timed)
    table = paths.measure(None, ["int4", "int8", "bf16"])
    assert calls == ["int4", "int8", "bf16", "int8", "int4"]
    assert table.ms["int4"][1] == 9.4 and table.ms["int8"][1] == 11.5 and table.ms["bf16"][1] == 45.0
    assert table.choose() == "int4" and paths.close_calls(table) == []


def test_a_timing_that_caught_the_machine_busy_is_timed_again(monkeypatch):
    """A forward of 1 token timed at 10x one of 5 (a stall: the machine was busy) is timed again, the faster timing
    of each size kept; a path that stays inconsistent is timed at most ``RETIMES`` more times, and a consistent one
    (int8's 1 token a little dearer than 5 on AMX tiles is real) once."""
    script = {"int4": [{1: 50.0, 5: 5.0, 17: 9.0}, {1: 4.0, 5: 5.5, 17: 8.5}],
              "int8": [{1: 12.0, 5: 10.0, 17: 18.0}],
              "bf16": [{1: 90.0, 5: 30.0, 17: 40.0}] * (1 + paths.RETIMES)}  # fmt: skip
    calls = []

    def timed(cfg, path, clock, repeats, slices=None, drop_above=None, own=None):
        calls.append(path)
        return dict(script[path].pop(0))

    monkeypatch.setattr(paths, "_time_path", timed)
    table = paths.measure(None, ["int4", "int8", "bf16"])
    assert table.ms["int4"] == {1: 4.0, 5: 5.0, 17: 8.5} and not paths.stalled(table.ms["int4"])
    assert calls == ["int4", "int8", "bf16", "int4"] + ["bf16"] * paths.RETIMES
    assert paths.stalled(table.ms["bf16"]) and not paths.stalled(table.ms["int8"])


def test_a_path_slower_than_fp32_is_dropped_after_one_forward_and_no_slice_is_built_twice(monkeypatch):
    """fp32 may serve wherever any path may, so a path whose first timed forward already costs more than fp32's whole
    mix is never chosen: it is dropped then (bf16 on AVX2 took ~15 s of a 0.5B's first load), and said so. The close
    call's second timing (int4, int8) reuses the slices built for the first."""
    now, builds, forwards = [0.0], [], []

    class Slice:  # a forward 'takes' its path's ms on the injected clock
        def __init__(self, path: str, ms: float):
            self.path, self.ms = path, ms

        def new_cache(self, n):
            return None

        def forward_many(self, parts):
            forwards.append(self.path)
            now[0] += self.ms
            return [None]

        def logits(self, h):
            return h

    cost = {"int4": 1.0, "int8": 1.1, "fp32": 4.0, "bf16": 20.0}
    monkeypatch.setattr(paths, "_slice",
                        lambda cfg, path, own=None: (builds.append(path), Slice(path, cost[path]), 1, 1)[1:])
    cfg = dataclasses.make_dataclass("Cfg", [("num_layers", int), ("vocab_size", int)])(1, 1)
    table = paths.measure(cfg, list(PATHS), clock=lambda: now[0] / 1000, repeats=3)
    assert builds == ["int4", "int8", "fp32", "bf16"]
    assert forwards.count("bf16") == 2 and forwards.count("int4") == 2 * 3 * 4  # warm-up + 1; two timings of 3 sizes
    assert table.dropped == {"bf16": pytest.approx(12.0)} and "bf16" not in table.ms  # fp32: 3 forwards of 4 ms
    assert table.choose(["bf16", "fp32"]) == "fp32" and table.choose() == "int4"
    assert "bf16 > 12" in table.line("int4") and "bf16" in table.markdown()
    assert Table.from_json(json.loads(json.dumps(table.to_json()))) == table


def test_the_table_is_cached_per_machine_and_model(monkeypatch, tmp_path, tiny_model_dir):
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir))
    calls = []
    monkeypatch.setattr(paths, "measure", lambda c, progress=None, own=None: calls.append(c) or ZEN5)
    assert paths.table_for(cfg, tmp_path) == ZEN5 and len(calls) == 1
    assert paths.table_for(cfg, tmp_path) == ZEN5 and len(calls) == 1  # read back, not measured again
    other = dataclasses.replace(cfg, hidden_size=2 * cfg.hidden_size)
    assert paths.cache_file(other, tmp_path) != paths.cache_file(cfg, tmp_path)
    paths.table_for(cfg, tmp_path, refresh=True)
    assert len(calls) == 2


def test_the_kernel_build_is_chosen_by_timing_not_by_flags(monkeypatch, tmp_path):
    """Of two builds the CPU runs, the one timed faster is used, even the narrower one; ``SPLITSPEC_ISA`` pins one."""
    monkeypatch.setenv("SPLITSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SPLITSPEC_ISA", raising=False)
    monkeypatch.setattr(kernels, "builds", lambda: ["avx512-vnni", "avx2", "portable"])
    monkeypatch.setattr(kernels, "time_builds", lambda tags: {"avx512-vnni": 0.002, "avx2": 0.001})
    kernels.active.cache_clear()
    try:
        assert kernels.active() == "avx2"
        monkeypatch.setattr(kernels, "time_builds", lambda tags: pytest.fail("measured again"))
        kernels.active.cache_clear()
        assert kernels.active() == "avx2"  # from the cache
        monkeypatch.setenv("SPLITSPEC_ISA", "portable")
        kernels.active.cache_clear()
        assert kernels.active() == "portable"
    finally:
        kernels.active.cache_clear()


def test_a_paths_cost_line_prices_a_verification_and_a_load_reports_it(tmp_path, tiny_model_dir, tiny_target):
    """What n tokens cost on the served path, ``fixed + n·per_token`` through the 5- and 17-token forwards (an AMD Zen
    4's int4: 0.4 of a step a token; AMX's bf16: almost nothing), read from the cached table only: it is what a local
    verifier reports with the prompt's verdict, before any tree was timed."""
    from transformers import AutoConfig

    from client.verifiers import LocalVerifier
    from shared.acceptance import SamplingParams

    zen4 = table({"int4": (48.5, 87.3, 224.7), "int8": (71.3, 86.7, 243.9), "bf16": (551.7, 588.8, 1110.6),
                  "fp32": (468.7, 1262.9, 1766.1)})  # fmt: skip
    fixed, per_token = zen4.costs("int4")
    assert per_token == pytest.approx((224.7 - 87.3) / 12 / 1000) and fixed + per_token == pytest.approx(0.0485)
    assert AMX.costs("bf16")[1] < 0.1 * AMX.costs("bf16")[0] < zen4.costs("int4")[1]
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir))
    assert paths.served_costs(cfg, "float32", "lowbit", tmp_path) is None  # nothing measured: nothing measured now
    paths.cache_file(cfg, tmp_path).parent.mkdir(parents=True)
    paths.cache_file(cfg, tmp_path).write_text(json.dumps(zen4.to_json()))
    assert paths.served_costs(cfg, "float32", "lowbit", tmp_path) == zen4.costs("int4")
    assert paths.served_costs(cfg, "bfloat16", "native", tmp_path) == zen4.costs("bf16")
    assert paths.served_costs(cfg, "float16", "native", tmp_path) is None  # a path the table does not have

    saved, tiny_target.costs = tiny_target.costs, (fixed, per_token)
    try:
        load = LocalVerifier(tiny_target).open([1, 2, 3], SamplingParams()).load
    finally:
        tiny_target.costs = saved
    assert (load.step_s, load.node_s) == pytest.approx((fixed, per_token)) and load.prefer == "latency"


def test_a_fresh_server_reports_its_path_timings_costs_until_it_has_fitted_its_own(tiny_target):
    """A server that has not yet timed enough forwards to fit their cost (``server.budget``) reports the path
    timing's line in its ``Load``: a client's first trees are sized by what they cost on this machine."""
    import grpc

    from shared.wire import splitspec_pb2 as pb
    from shared.wire import splitspec_pb2_grpc as pb_grpc
    from tests.conftest import served

    saved, tiny_target.costs = tiny_target.costs, (0.037, 0.0114)
    try:
        with served(tiny_target, max_sessions=2, max_tree_nodes=16, max_context=128) as (address, _):
            with grpc.insecure_channel(address) as channel:
                reply = pb_grpc.SplitSpecStub(channel).OpenSession(pb.OpenSessionRequest(prompt_ids=[1, 2, 3]),
                                                                   timeout=60)  # fmt: skip
    finally:
        tiny_target.costs = saved
    assert (reply.load.step_s, reply.load.node_s) == pytest.approx((0.037, 0.0114))
