"""client.apps.text: from (tokens, verified) snapshots to settled text, provisional text and link events."""

from __future__ import annotations

import io
import random

import pytest

from client.apps.private import mask
from client.apps.text import DIM, PLAIN, RESTORE_CLEAR, SAVE, Delta, Terminal, TextDeltas, column, fit

TEXT = "Café 3 € 日本語 🙂 naïve façade, the cat sat on the mat"


@pytest.fixture(scope="module")
def bytes_bpe():
    """A real byte-level BPE tokenizer (the kind SmolLM2 has), trained here on a few lines: with so few merges its
    tokens split multi-byte characters, so decoding a prefix of them can end in U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)  # fmt: skip
    tok.train_from_iterator([TEXT, "Zürich coûte naïve"] * 3, trainer)
    return tok


class Words:
    """A tokenizer stand-in: token i is the word "t<i> "."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"t{i} " for i in ids)


def settle(deltas: TextDeltas, tokens: list[int], verified: list[bool]) -> Delta:
    return deltas.update(tokens, verified)


def test_settled_text_is_the_decoded_verified_prefix_at_every_step(bytes_bpe, tiny_model_dir):
    from shared.engine.models import load_tokenizer

    words = load_tokenizer(str(tiny_model_dir))
    word_ids = words("w5 w9 w14 w5 w9 w21 w33 w40 w41 w5 w9")["input_ids"]
    for tokenizer, ids in ((bytes_bpe, bytes_bpe.encode(TEXT).ids), (words, word_ids)):
        assert tokenizer.decode(ids, skip_special_tokens=True)  # the test has text to check
        rng = random.Random(0)
        for _ in range(20):
            deltas, shown, n = TextDeltas(tokenizer), "", 0
            while n < len(ids):
                n = min(len(ids), n + rng.randint(1, 3))
                shown += deltas.update(ids[:n], [True] * n).settled
                assert "\ufffd" not in shown  # never half a character
                assert tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(shown)
            assert shown + deltas.update(ids, [True] * len(ids), final=True).settled == tokenizer.decode(ids)


def test_a_character_split_across_tokens_waits_for_its_last_token(bytes_bpe):
    ids = bytes_bpe.encode("€").ids
    assert len(ids) >= 2 and bytes_bpe.decode(ids[:1]).endswith("\ufffd")  # the tokenizer does split it
    deltas = TextDeltas(bytes_bpe)
    held = [deltas.update(ids[:n], [True] * n).settled for n in range(1, len(ids))]
    assert held == [""] * (len(ids) - 1)
    assert deltas.update(ids, [True] * len(ids)).settled == "€"
    # at the end an incomplete character is all there is: it is shown
    cut = TextDeltas(bytes_bpe)
    assert cut.update(ids[:1], [True]).settled == ""
    assert cut.update(ids[:1], [True], final=True).settled == bytes_bpe.decode(ids[:1])


def test_the_offline_tail_is_provisional_until_the_server_verdict():
    deltas = TextDeltas(Words())
    assert settle(deltas, [1, 2], [True, True]) == Delta("t1 t2 ", "", [])
    cut = settle(deltas, [1, 2, 3, 4], [True, True, False, False])  # the link is down: 3 and 4 are offline
    assert cut.settled == "" and cut.provisional == "t3 t4 "
    assert cut.events == ["no answer from the server: generating offline; the server verifies them when it is back"]
    more = settle(deltas, [1, 2, 3, 4, 5], [True, True, False, False, False])
    assert more == Delta("", "t3 t4 t5 ", [])  # the whole provisional text, no new event
    back = settle(deltas, [1, 2, 3, 9], [True] * 4)  # the server kept 3 and put 9 in place of 4
    assert back.settled == "t3 t9 " and back.provisional == ""
    assert back.events == ["server back: it verified the 3 offline tokens and kept the first 1"]
    assert settle(deltas, [1, 2, 3, 9, 7], [True] * 5) == Delta("t7 ", "", [])
    assert deltas.events == cut.events + back.events


def test_tokens_still_offline_at_the_end_are_final_then_with_an_event():
    deltas = TextDeltas(Words())
    settle(deltas, [1, 2, 3], [True, False, False])
    end = deltas.update([1, 2, 3], [True, False, False], final=True)
    assert end.settled == "t2 t3 " and end.provisional == ""
    assert end.events == ["2 tokens were generated offline and never verified by the server"]


def test_under_keep_offline_tokens_are_final_at_once():
    deltas = TextDeltas(Words(), final_offline=True)
    assert settle(deltas, [1], [True]).settled == "t1 "
    cut = settle(deltas, [1, 2, 3], [True, False, False])
    assert cut.settled == "t2 t3 " and cut.provisional == ""
    assert cut.events == ["no answer from the server: generating offline; its tokens are kept as they are"]
    back = settle(deltas, [1, 2, 3, 4], [True, False, False, True])  # the server goes on after them
    assert back.settled == "t4 " and back.events == ["server back: the 2 offline tokens are kept as they are"]
    end = deltas.update([1, 2, 3, 4], [True, False, False, True], final=True)
    assert end.settled == "" and end.events == ["2 tokens were generated offline and never verified by the server"]


def test_a_stop_string_ends_the_text_before_it():
    deltas = TextDeltas(Words(), stop=["t7 t8", "never"])
    assert settle(deltas, [1, 7], [True, True]).settled == "t1 "  # "t7 " may begin the stop string: held back
    assert settle(deltas, [1, 7, 9], [True] * 3).settled == "t7 t9 " and not deltas.stopped
    offline = settle(deltas, [1, 7, 9, 7, 8, 5], [True] * 3 + [False] * 3)
    assert offline.settled == "" and offline.provisional == "" and not deltas.stopped  # provisional text stops too
    stop = settle(deltas, [1, 7, 9, 7, 8, 5], [True] * 6)
    assert stop.settled == "" and deltas.stopped  # the text ends right before "t7 t8"
    assert settle(deltas, [1, 7, 9, 7, 8, 5, 6], [True] * 7).settled == ""
    assert deltas.update([1, 7, 9, 7, 8, 5, 6], [True] * 7, final=True).settled == ""
    assert deltas.text[: deltas.sent] == "t1 t7 t9 "


def test_private_placeholders_are_rendered_whole_in_settled_and_provisional_text():
    class Pieces:
        PIECES = ["Dear ", "[PRIV", "ATE_", "1", "]", ", hi"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.PIECES[i] for i in ids)

    _, secrets = mask("<private>Ann</private>")
    deltas = TextDeltas(Pieces(), secrets=secrets)
    assert settle(deltas, [0, 1, 2], [True] * 3).settled == "Dear "  # "[PRIVATE_" may begin a placeholder
    offline = settle(deltas, [0, 1, 2, 3, 4], [True] * 3 + [False] * 2)
    assert offline.settled == "" and offline.provisional == "Ann"  # the held part and the offline tail, rendered
    assert settle(deltas, [0, 1, 2, 3, 4, 5], [True] * 6) == Delta("Ann, hi", "", deltas.events[-1:])


class Screen(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_shows_provisional_text_dim_on_a_tty_and_rewrites_it():
    screen, said = Screen(), []
    term = Terminal(screen)
    term(Delta("a b ", "", []))
    term(Delta("", "c d", ["lost"]), said.append)
    assert said == ["lost"]
    first = screen.getvalue()
    assert first.startswith("a b ") and first.endswith(SAVE + DIM + "c d" + PLAIN)
    term(Delta("", "c d", []))  # nothing changed: nothing written
    assert screen.getvalue() == first
    term(Delta("c ", "", []))
    assert screen.getvalue() == first + RESTORE_CLEAR + "c "  # back to where "c d" began, erased, the final text
    term(Delta("", "d", []))
    before = screen.getvalue()
    term.aside(lambda: screen.write("\n[note]\n"))  # a note from elsewhere: the provisional text makes way, then back
    assert screen.getvalue()[len(before) :].startswith(RESTORE_CLEAR + "\n[note]\n")
    assert screen.getvalue().endswith(SAVE + DIM + "d" + PLAIN)

    pipe = io.StringIO()
    plain = Terminal(pipe)
    plain(Delta("a ", "b", ["lost"]), said.append)
    plain(Delta("c ", "", []))
    assert pipe.getvalue() == "a c " and said[-1] == "lost"  # not a terminal: final text only


def test_fit_keeps_provisional_text_on_the_screen():
    assert fit("abc", 80, 10) == ("abc", 1)
    assert fit("a\nb", 80, 10) == ("a\nb", 2)
    text, rows = fit("x" * 1000, 10, 5)  # 200 rows at worst: cut to what the 5 rows hold
    assert rows == 5 and text.endswith("…") and 2 * len(text) <= 5 * 10


def test_settled_text_at_the_right_margin_wraps_before_the_provisional_text(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10")
    monkeypatch.setenv("LINES", "5")
    assert column("abc", 3) == 3 and column("abcd", 3) == 1 and column("日本", 3) == 2 and column("a\tb", 20) == 9
    screen = Screen()
    Terminal(screen)(Delta("x" * 10, "p", []))  # the cursor waits at the margin: moving it would lose the wrap
    assert screen.getvalue().startswith("x" * 10 + "\n\033D")
    screen = Screen()
    Terminal(screen)(Delta("x" * 9, "p", []))
    assert screen.getvalue().startswith("x" * 9 + "\033D")
