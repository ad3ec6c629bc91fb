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
    from client.apps.demo import verdict

    run = {"tok_s": 13.8, "wait_s": 0.3}
    assert "1.00x the tokens/s (even)" in verdict(run, {"tok_s": 13.82, "wait_s": 3.5})
    assert "(SLOWER)" in verdict(run, {"tok_s": 15.0, "wait_s": 3.5})
    assert "(faster)" in verdict({"tok_s": 20.0, "wait_s": 0.3}, {"tok_s": 15.0, "wait_s": 0.1})
    assert "(LONGER" in verdict({"tok_s": 20.0, "wait_s": 0.3}, {"tok_s": 15.0, "wait_s": 0.1})


def test_the_api_baseline_gives_up_on_a_stream_that_never_starts(monkeypatch):
    """A stream that breaks before its first token, again and again, is a failure, not a cut: the baseline stops after
    RESUME_TRIES and says why (it once retried for ever, each try taking a place on the server). Breaks that yield
    tokens between them are a cut and are resumed."""
    import client.net.api
    from client.apps.demo import RESUME_TRIES, api_resuming
    from client.net.connection import LinkCounters
    from shared.errors import SplitspecError

    class Remote:
        counters = LinkCounters()

        def reachable(self, timeout_s):
            return True

    calls = []

    def never(remote, prompt_ids, limit, on_update):
        calls.append(len(prompt_ids))
        raise SplitspecError("Complete unanswered within 1.09s")

    monkeypatch.setattr(client.net.api, "api_complete", never)
    with pytest.raises(SplitspecError, match=f"broke {RESUME_TRIES} times in a row.*1.09s"):
        api_resuming(Remote(), [1, 2, 3], 10, show=None, clock=lambda: 0.0, sleep=lambda s: None)
    assert len(calls) == RESUME_TRIES

    def a_token_a_try(remote, prompt_ids, limit, on_update):  # a link that breaks after every token: resumed
        calls.append(len(prompt_ids))
        on_update([7], [True])
        raise SplitspecError("the link broke")

    calls.clear()
    monkeypatch.setattr(client.net.api, "api_complete", a_token_a_try)
    class Shown(list):
        longest_wait = longest_stall = 0.0

        def __call__(self, ids, verified):
            self.append(list(ids))

    shown = Shown()
    out = api_resuming(Remote(), [1, 2, 3], 10, show=shown, clock=lambda: 0.0, sleep=lambda s: None)
    assert out["tokens"] == 10 and calls == list(range(3, 13)) and shown[-1] == [7] * 10
