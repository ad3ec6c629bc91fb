"""`make demo`'s command runs without a terminal (as in CI), narrates the cut and exits 0, stopping what it started."""

from __future__ import annotations

import pytest

from tests.test_cli import splitspec

pytestmark = pytest.mark.real


def test_the_demo_runs_through_a_cut_without_a_terminal(real_target):
    out = splitspec("demo", "--max-new-tokens", "40", "--cut-after", "10", "--cut-for", "1", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    err = out.stderr
    for event in ("[link cut after", "[no answer from the server: generating offline", "[link restored]",
                  "[server back:", "[the API stream broke", "streaming API",
                  "[mode: the server decodes by itself", "longest wait for text s"):  # fmt: skip
        assert event in err, (event, err[-2000:])
    assert "\x1b[" not in err  # no terminal: no escape codes
    assert len(out.stdout.strip()) > 20


def test_the_verdict_judges_the_speed_it_prints():
    """1.00x is "even", not "SLOWER" (a 0.998 ratio printed as 1.00x once read as a loss)."""
    from client.demo import verdict

    run = {"tok_s": 13.8, "wait_s": 0.3}
    assert "1.00x the tokens/s (even)" in verdict(run, {"tok_s": 13.82, "wait_s": 3.5})
    assert "(SLOWER)" in verdict(run, {"tok_s": 15.0, "wait_s": 3.5})
    assert "(faster)" in verdict({"tok_s": 20.0, "wait_s": 0.3}, {"tok_s": 15.0, "wait_s": 0.1})
    assert "(LONGER" in verdict({"tok_s": 20.0, "wait_s": 0.3}, {"tok_s": 15.0, "wait_s": 0.1})
