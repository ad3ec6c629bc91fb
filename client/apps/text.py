"""From tokens to the text a display shows: one class for the CLI, the edge endpoint and the demo.

The decode loop (``client.loop.decode.generate``) reports the whole output after every change,
``on_update(tokens, verified)``. Most of it is final: what the server verified, and under ``keep`` the
offline tokens too. But while the link is cut the tail is made offline, and under ``verify`` the server
may replace part of it once it is back. A display wants text, and wants to know which text can still
change: ``TextDeltas.update`` turns each snapshot into a ``Delta`` with

* ``settled``: new final text, to append;
* ``provisional``: the text after it that may still change (the offline tail), whole: it replaces the
  previous one, and a display that shows it rewrites it in place (or shows none: plain apps, pipes);
* ``events``: what happened to the link, in words ("no answer from the server: generating offline",
  "server back: ..."), so that every display narrates from the same source.

Settled text is decoded incrementally, as TGI does: a token's text is the text of a short window ending
with it minus the text of the window without it (a token's text can depend on the one before: a
SentencePiece word's leading space). What could still change is held back: an incomplete UTF-8
character (text ending in U+FFFD, until the next token completes it), what could begin a stop string
(the text ends before the first one, and ``stopped`` tells the generation to end) and what could begin
a private placeholder (``client.apps.private``: the private text is put back for whole placeholders only).
At the end (``final``) nothing is held back and every token is final.

``Terminal`` shows deltas on a terminal: settled text as it comes and, on a TTY, the provisional text
dim after it, rewritten in place; the events as notes on stderr.
"""

from __future__ import annotations

import shutil
import sys
import threading
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from client.loop.decode import verified_prefix


@dataclass
class Delta:
    """What a display shows after one update."""

    settled: str = ""  # new final text: append it
    provisional: str = ""  # all the text after the settled text that may still change: it replaces the last one
    events: list[str] = field(default_factory=list)  # what happened to the link since the last update


class TextDeltas:
    """Successive ``(tokens, verified)`` snapshots of one generation as text ``Delta``s (see the module docstring).

    ``final_offline``: offline tokens are final at once (``--on-reconnect keep``); ``stop``: stop strings;
    ``secrets`` (``client.apps.private.Secrets``): the private texts to put back in place of their placeholders.
    """

    def __init__(self, tokenizer, final_offline: bool = False, stop: Sequence[str] = (), secrets=None):
        self.tokenizer, self.final_offline, self.stop, self.secrets = tokenizer, final_offline, list(stop), secrets
        self.placeholders = secrets.placeholders if secrets else []
        self.ids: list[int] = []  # the settled tokens
        self.window = self.read = 0  # ids[:read] are in text; ids[window:read] is the context for the next token
        self.text = ""  # the settled tokens' text (placeholders not rendered)
        self.sent = 0  # characters of text handed out as settled
        self.stopped = False  # a stop string was found in the settled text: the text ends before it
        self.events: list[str] = []  # every event so far
        self.offline_tail: tuple[int, list[int]] | None = None  # while the link is down: where it starts, and it

    def update(self, tokens: list[int], verified: list[bool], final: bool = False) -> Delta:
        """The delta after this snapshot; ``final``: the generation ended, nothing is held back."""
        delta = Delta(events=self._link(tokens, verified, final))
        if self.stopped:
            return delta
        settled = len(tokens) if final or self.final_offline else verified_prefix(verified)
        for token in tokens[len(self.ids) : settled]:
            self.ids.append(token)
            self._read(final=False)
        if final:
            self._read(final=True)
        end = len(self.text)
        for s in self.stop:
            at = self.text.find(s, self.sent)
            if at != -1 and at < end:
                end, self.stopped = at, True
        if not (self.stopped or final):  # what could still become a stop string, then a placeholder
            end -= _tail(self.text[:end], self.stop)
            end -= _tail(self.text[:end], self.placeholders)
        if end > self.sent:
            delta.settled, self.sent = self._render(self.text[self.sent : end]), end
        if len(tokens) > len(self.ids) and not self.stopped:
            delta.provisional = self._provisional(tokens[len(self.ids) :])
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _read(self, final: bool) -> None:
        """Append the text the settled tokens not yet read add; wait while it ends in an incomplete character."""
        if self.read == len(self.ids):
            return
        before, after = self._decode(self.ids[self.window : self.read]), self._decode(self.ids[self.window :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self.window, self.read = self.read, len(self.ids)

    def _provisional(self, tail: list[int]) -> str:
        """The text after what was sent: held-back settled text, then ``tail``'s, up to a stop string."""
        before = self._decode(self.ids[self.window : self.read])
        text = self.text[self.sent :] + self._decode(self.ids[self.window :] + tail)[len(before) :]
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                text = text[:at]
        return self._render(text.rstrip("\ufffd"))

    def _render(self, text: str) -> str:
        return self.secrets.render(text) if self.secrets else text

    def _link(self, tokens: list[int], verified: list[bool], final: bool) -> list[str]:
        """The link's events: the tail is written offline (the link is down), the server is back, tokens end
        unverified."""
        events = []
        start = len(verified)
        while start and not verified[start - 1]:
            start -= 1
        if start < len(verified):  # the last tokens are offline ones: the link is down
            if self.offline_tail is None:
                events.append("no answer from the server: generating offline"
                              + ("; its tokens are kept as they are" if self.final_offline
                                 else "; the server verifies them when it is back"))  # fmt: skip
            self.offline_tail = (start, tokens[start:])
        elif self.offline_tail is not None:
            start, tail = self.offline_tail
            if self.final_offline:
                events.append(f"server back: the {len(tail)} offline tokens are kept as they are")
            else:
                kept = next((i for i, (a, b) in enumerate(zip(tail, tokens[start:], strict=False)) if a != b),
                            min(len(tail), len(tokens) - start))  # fmt: skip
                events.append(f"server back: it verified the {len(tail)} offline tokens and kept the first {kept}")
            self.offline_tail = None
        unverified = len(verified) - sum(verified)
        if final and unverified:
            events.append(f"{unverified} tokens were generated offline and never verified by the server")
        self.events += events
        return events


def _tail(text: str, words: list[str]) -> int:
    """The length of the longest end of ``text`` that is the beginning of one of ``words`` (not all of it)."""
    return max((k for w in words for k in range(min(len(w) - 1, len(text)), 0, -1) if text.endswith(w[:k])),
               default=0)  # fmt: skip


# --- on a terminal ---

DIM, PLAIN = "\033[2m", "\033[0m"
SAVE, RESTORE_CLEAR = "\0337", "\0338\033[J"  # DECSC; DECRC, then erase to the end of the screen


def note(message: str, file=None) -> None:
    """A line about the generation (a link event) on ``file`` (stderr): bold on a terminal."""
    file = file or sys.stderr
    print(f"\n\033[1m[{message}]\033[0m" if file.isatty() else f"\n[{message}]", file=file, flush=True)


class Terminal:
    """Shows deltas on ``out``: settled text as it comes; on a TTY, the provisional text dim after it, rewritten in
    place; not on a TTY (a pipe, a file), no provisional text at all: only final text.

    Rewriting: the cursor is saved where the provisional text begins, restored and the screen cleared below it
    before anything else is written. The provisional text must not scroll the screen while shown (the saved
    position would point at the wrong row), so room is made below the cursor first (ESC D scrolls where needed,
    then the cursor goes back up), and a provisional text too long for the screen is shown cut. Moving the cursor
    would lose a wrap the terminal has pending (settled text ending right at the margin), so then a newline goes
    first: this is why the terminal follows the columns of the settled text's last line (notes end in newlines).
    """

    def __init__(self, out=None, tty: bool | None = None):
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.provisional = ""  # on the screen now
        self.line = ""  # the text written since the last newline
        self.lock = threading.RLock()  # notes from other threads (``aside``) take turns with the text

    def __call__(self, delta: Delta, say: Callable[[str], None] = note) -> None:
        """Show ``delta``: its settled text, its events (``say``, between the text and the provisional text)."""
        with self.lock:
            if not self.tty:
                self.out.write(delta.settled)
                self.out.flush()
                for event in delta.events:
                    say(event)
                return
            if delta.settled or delta.events or delta.provisional != self.provisional:
                self._erase()
                self.out.write(delta.settled)
                self.out.flush()
                self.line = (self.line + delta.settled).rsplit("\n", 1)[-1]
                for event in delta.events:
                    say(event)
                    self.line = ""
                self._show(delta.provisional)
                self.out.flush()

    def aside(self, write: Callable[[], None]) -> None:
        """Run ``write``, which prints elsewhere on this screen (a note on stderr), with the provisional text off it."""
        with self.lock:
            shown = self.provisional
            self._erase()
            self.out.flush()
            write()
            self.line = ""
            self._show(shown)
            self.out.flush()

    def _erase(self) -> None:
        if self.provisional:
            self.out.write(RESTORE_CLEAR)
            self.provisional = ""

    def _show(self, text: str) -> None:
        if not text or not self.tty:
            return
        columns, lines = shutil.get_terminal_size()
        if self.line and column(self.line, columns) == columns:  # a wrap pending, which moving would lose: do it
            self.out.write("\n")
            self.line = ""
        shown, rows = fit(text, max(columns, 2), max(lines - 1, 1))
        room = "\033D" * rows + f"\033[{rows}A" if rows else ""  # down (scrolling if need be), then back up
        self.out.write(room + SAVE + DIM + shown + PLAIN)
        self.provisional = text


def fit(text: str, columns: int, rows: int) -> tuple[str, int]:
    """``text`` cut to what surely fits in ``rows`` rows of ``columns`` from anywhere on a row (a character counted
    two columns wide), and the rows it may move the cursor down."""
    kept, used = [], 0
    for line in text.split("\n"):
        need = 1 + 2 * len(line) // columns  # the newline (or the column it starts at), then wraps
        if used + need > rows:
            room = (rows - used - 1) * columns // 2  # characters that surely fit in the rows left, after a newline
            if room > 0:
                kept.append(line[: room - 1] + "…")
                used = rows
            break
        kept.append(line)
        used += need
    return "\n".join(kept), used


def column(line: str, columns: int) -> int:
    """Where the cursor is after ``line`` written from column 0 on a terminal ``columns`` wide (``columns``: at the
    right margin, about to wrap); wide characters take two columns, combining ones none."""
    col = 0
    for ch in line:
        if ch == "\r":
            col = 0
        elif ch == "\t":
            col = min(col - col % 8 + 8, columns - 1)
        elif unicodedata.category(ch) not in ("Mn", "Me", "Cf", "Cc"):
            width = 2 if unicodedata.east_asian_width(ch) in "WF" else 1
            col = (0 if col + width > columns else col) + width
    return col
