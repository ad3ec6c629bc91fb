"""Prompt lookup drafts what followed the latest earlier occurrence of the current suffix."""

from __future__ import annotations

import pytest

from client.drafters import PromptLookup, make_drafter
from shared.lookup import PAST_TOKENS


def test_chain_copies_the_latest_match():
    d = PromptLookup(max_ngram=2, num_tokens=3)
    d.begin([1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 1, 2])
    tree = d.propose(max_nodes=10)
    assert tree.tokens == [5, 6, 7] and tree.parents == [-1, 0, 1]  # the later "1 2" wins


def test_longest_ngram_first_then_shorter():
    d = PromptLookup(max_ngram=3, num_tokens=2)
    d.begin([7, 8, 9, 10, 11, 3, 8, 20, 21, 7, 8])
    assert d.propose(10).tokens == [9, 10]  # "7 8" matches; "8" alone would pick 20, 21
    d.absorb([30])
    assert d.propose(10).tokens == []  # 30 never occurred before


def test_branches_merge_into_a_tree_with_shared_prefixes():
    d = PromptLookup(max_ngram=1, min_ngram=1, num_tokens=3, branches=3)
    d.begin([5, 1, 2, 3, 5, 1, 4, 6, 5, 8, 9, 0, 5])
    tree = d.propose(10)
    # latest first: 5 -> [8 9 0], then [1 4 6], then [1 2 3] shares the "1" node
    assert tree.tokens == [8, 9, 0, 1, 4, 6, 2, 3]
    assert tree.parents == [-1, 0, 1, -1, 3, 4, 3, 6]


def test_budget_and_rewind():
    d = PromptLookup(max_ngram=1, min_ngram=1, num_tokens=8)
    d.begin([1, 2, 3, 4, 5, 6, 1])
    assert len(d.propose(max_nodes=3)) == 3
    d.absorb([2, 3])
    d.rewind(2)
    assert d.history == [1, 2, 3, 4, 5, 6, 1] and d.propose(3).tokens == [2, 3, 4]


def test_an_adaptive_copy_runs_as_far_as_copies_paths_stay_likely():
    d = PromptLookup(max_ngram=2, num_tokens=8)
    d.begin([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2])
    assert len(d.propose(10)) == 4  # unscored: 1/2, 1/4, 1/8, 1/16 likely, and then under FLOOR
    d.absorb([3, 4, 5, 6, 7])  # kept whole (settled once its four tokens came)
    assert len(d.propose(10)) == 5  # (2/3)^4 x 1/2 is still over FLOOR
    fixed = PromptLookup(max_ngram=2, num_tokens=8, adaptive=False)
    fixed.begin([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2])
    assert len(fixed.propose(10)) == 8


def test_unknown_drafter_is_a_clear_error():
    import pytest

    from shared.errors import SplitspecError

    with pytest.raises(SplitspecError, match="unknown drafter 'nope': expected one of none, prompt-lookup.*moa-tli1"):
        make_drafter("nope")


def test_the_servers_own_lookup_copies_as_far_as_its_scored_copies_pay_by_the_servers_costs():
    from server.self_draft import SelfDraft

    dear = lambda: (0.01, 0.05)  # noqa: E731 -- a token adds 0.83 of a step: a CPU whose kernels are compute-bound
    draft = SelfDraft([7, 8, 9, 7, 8], max_tokens=4, costs=dear)  # the suffix 7 8 came before: 9 7 8 is its copy
    assert len(draft.propose(4)) == 0  # nothing scored: a copy kept 1 time in 2 does not pay such tokens
    for token in [9, 7, 8] * 8:  # the text repeats: every copy found, though none verified, is scored as kept
        draft.observe([token])
        draft.propose(4)
    record = draft.lookup.record
    assert record.seen[0] >= 20 and record.kept[0] == record.seen[0]
    assert 0 < len(draft.propose(4)) < 3  # (1 + 0.96 + 0.92) / 0.16 s beats 1 / 0.06 s and the whole copy
    for token in [5, 6, 4] * 2:  # new text: the copy made before it is scored as missed at its first token
        draft.observe([token])
    assert record.kept[0] < record.seen[0]

    cheap = SelfDraft([7, 8, 9, 7, 8], max_tokens=4, costs=lambda: (0.05, 0.001))  # a forward bound by its weights
    assert cheap.propose(4).tokens == [9, 7, 8]  # even at 1 in 2 the whole copy pays
    unknown = SelfDraft([7, 8, 9, 7, 8], max_tokens=4, costs=lambda: None)
    assert unknown.propose(4).tokens == [9, 7, 8]

    partly = SelfDraft([7, 8, 9, 7, 8], max_tokens=4, costs=lambda: None)
    partly.propose(4)  # 9 7 8
    partly.observe([9, 7])
    assert list(partly.lookup.record.seen) == [0, 0, 0, 0]  # its first two came as copied: not settled yet
    partly.observe([5])  # the third missed: its first two kept, each of its three tried
    assert list(partly.lookup.record.kept) == [1, 1, 0, 0] and list(partly.lookup.record.seen) == [1, 1, 1, 0]


def test_past_answers_are_copied_where_the_text_has_no_match_and_never_across_two_of_them():
    lookup = make_drafter("past-lookup", num_tokens=4, adaptive=False)  # PAST_TOKENS of past answers
    assert lookup.past_tokens == PAST_TOKENS
    lookup.begin([1, 2, 3, 50])  # a first request: its prompt, then its answer 50 51 52 53 54 55
    lookup.absorb([51, 52, 53, 54, 55])
    lookup.begin([7, 8, 9, 60])  # another request; its answer is 60 61, then the first answer's 52 53 again
    assert lookup.propose(8).tokens == []  # nothing in this text or the past follows 9 60
    lookup.absorb([61, 51, 52])
    assert lookup.propose(8).tokens == [53, 54, 55]  # from the first answer, which ends there
    lookup.begin([70, 71, 72])  # a third: both answers are past now, SEPARATOR between them
    lookup.absorb([55, 60])
    assert lookup.propose(8).tokens == []  # 55 ends the first answer and 60 begins the second: no such bigram
    lookup.absorb([61])
    assert lookup.propose(8).tokens == [51, 52]  # the second answer, to its end
    off = PromptLookup(num_tokens=4, adaptive=False)  # the default: no past answers
    off.begin([1, 2, 3, 50])
    off.absorb([51, 52, 53, 54, 55])
    off.begin([7, 8, 51, 52])
    assert off.propose(8).tokens == []


def test_past_answers_keep_the_newest_whole_answers_within_their_budget():
    lookup = PromptLookup(num_tokens=4, adaptive=False, past_tokens=13)
    for start in (100, 200, 300):
        lookup.begin([1, start])
        lookup.absorb(list(range(start + 1, start + 6)))
    lookup.begin([2])
    assert lookup.past == [200, 201, 202, 203, 204, 205, -1, 300, 301, 302, 303, 304, 305]


def test_copies_are_scored_against_the_text_that_came_whether_sent_or_not():
    d = PromptLookup(max_ngram=2, num_tokens=3)
    d.begin([1, 2, 3, 4, 9, 1, 2])
    copy = d.propose(10)
    assert copy.tokens == [3, 4, 9] and copy.kept == pytest.approx([0.5, 0.25, 0.125])  # unscored: 1 in 2 a token
    d.absorb([3])  # the copy was cut to nothing (a plain step) and its first token came: not settled yet
    assert d.propose(10, depth=1).tokens == [4, 9, 1]  # an offline step's copy is not scored: it keeps itself
    d.absorb([4, 7])  # its third token missed
    record = d.record
    assert list(record.kept) == [1, 1, 0] and list(record.seen) == [1, 1, 1]
    assert d.length == 3  # 2/3, 4/9, 4/27 likely: all over FLOOR
    d.begin([1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 5, 1, 2])  # the conversation's next turn: its text goes on
    assert d.record is record and list(d.record.seen) == [1, 1, 1]
    d.begin([1, 2, 3, 1, 2])  # another text
    assert d.record is not record and list(d.record.seen) == [0, 0, 0]


def test_assumed_tokens_score_no_copy_and_a_rewind_keeps_copies_made_before():
    d = PromptLookup(max_ngram=2, num_tokens=2)
    d.begin([1, 2, 3, 4, 1, 2])
    assert d.propose(10).tokens == [3, 4]
    d.assume([3, 4])  # drafting ahead of the verdict: not the target's yet
    assert list(d.record.seen) == [0, 0]
    d.rewind(2)
    assert len(d.record.pending) == 1  # made before the rewound tokens: still waits for what comes
    d.absorb([3, 5])
    assert list(d.record.kept) == [1, 0] and list(d.record.seen) == [1, 1]


def test_a_model_with_lookup_drafts_itself_while_copies_miss_and_copies_again_once_they_hold(tiny_target):
    from client.drafters.model import ModelDrafter

    drafter = ModelDrafter(tiny_target, width=1, depth=2, lookup=True, floor=0.0, vocab=None)
    drafter.begin([5, 6, 7, 8, 5, 6])
    first = drafter.propose(8)
    assert first.scores is None and first.tokens == [7, 8, 5, 6]  # an unscored copy expects 0.94 tokens: taken
    drafter.absorb([9, 5, 6])  # the copy missed at once; the text then ends in 5 6 again
    own = drafter.propose(8)
    assert own.scores is not None  # a copy's first token now kept 1 time in 3, 0.58 tokens expected: the model drafts
    assert len(drafter.lookup.record.pending) == 1  # ... and the copy it passed over (9 5 6) is still scored
    drafter.absorb([9, 5, 6])  # the text went as that copy said
    assert drafter.propose(8).scores is None  # 1/2, 1/3, 2/9 likely: 1.06 tokens expected, copies are the draft again
