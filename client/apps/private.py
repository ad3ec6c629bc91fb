"""Private prompt spans: text that never leaves the device, replaced by placeholders the target can copy.

A user marks text private with ``<private>...</private>`` in a prompt, by naming it (``--private TEXT``:
every occurrence), or by flagging a whole chat message (``"private": true``). ``mask`` replaces each
private text, wherever it occurs in the prompt (marked or not), with a placeholder ``[PRIVATE_n]`` —
one per distinct text, numbers already written in the input skipped — before the prompt is encoded.

The guarantee: generation runs on the masked prompt, end to end — the server's prefill, the drafter's
context and drafts, offline generation while the link is cut (TLI included), settlement chains — so
the server, every draft and every byte on the link derive from the placeholder prompt alone. The
server learns where private text was (and which places hold the same text), never what it was.
What stays lossless: the output is exactly the target's on the placeholder prompt (greedy: token for
token; sampling: the same distribution), and ``Secrets.render`` puts the private text back where it
wrote a placeholder, on the device. How useful the answer is depends on how well the target copies a
placeholder it cannot read.

Error messages name positions, never the private text: they may end up in logs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

PLACEHOLDER = "[PRIVATE_{}]"
_MARKER = re.compile(r"<(/?)private>", re.IGNORECASE)
_WRITTEN = re.compile(r"\[PRIVATE_(\d+)\]")


class Secrets:
    """The private texts of one prompt by placeholder; renders a masked run's text back on the device.

    Its ``repr`` names only how many there are, so logging it leaks nothing.
    """

    def __init__(self, by_placeholder: dict[str, str] | None = None) -> None:
        self._texts = dict(by_placeholder or {})
        self._pattern = re.compile("|".join(map(re.escape, self._texts))) if self._texts else None

    @property
    def placeholders(self) -> list[str]:
        return list(self._texts)

    def render(self, text: str) -> str:
        """``text`` with each placeholder replaced by its private text (in one pass: a secret is never re-read)."""
        return self._pattern.sub(lambda m: self._texts[m.group()], text) if self._pattern else text

    def renderer(self) -> Renderer:
        """A fresh renderer for one stream of this run's text."""
        return Renderer(self)

    def __len__(self) -> int:
        return len(self._texts)

    def __bool__(self) -> bool:
        return bool(self._texts)

    def __repr__(self) -> str:
        return f"Secrets(private texts: {len(self)})"


class Renderer:
    """Renders a stream of text deltas: a stream never shows half a placeholder, nor a placeholder for a secret.

    ``feed`` holds back the longest tail that could still grow into a placeholder; placeholders end with
    ``]`` and have one ``[``, so none is a prefix of another and anything before that tail is final.
    """

    def __init__(self, secrets: Secrets) -> None:
        self.secrets = secrets
        self._prefixes = {p[:k] for p in secrets.placeholders for k in range(1, len(p))}
        self._longest = max(map(len, secrets.placeholders), default=0)
        self._held = ""

    def feed(self, delta: str) -> str:
        """The rendered text that can be shown now that ``delta`` arrived."""
        text = self._held + delta
        start = max(0, len(text) - self._longest + 1)
        cut = next((i for i in range(start, len(text)) if text[i:] in self._prefixes), len(text))
        self._held = text[cut:]
        return self.secrets.render(text[:cut])

    def flush(self) -> str:
        """The end of the stream: what was held back (part of a placeholder at most, never a whole one)."""
        held, self._held = self._held, ""
        return held


def mask(text: str, literals: Sequence[str] = ()) -> tuple[str, Secrets]:
    """``text`` with every ``<private>...</private>`` span and every occurrence of each of ``literals``
    replaced by a placeholder; and the ``Secrets`` that render it back. ValueError for a malformed span."""
    (masked,), secrets = _mask([text], [False], ["prompt"], literals)
    return masked, secrets


def mask_messages(messages: list[dict]) -> tuple[list[dict], Secrets]:
    """Chat messages ``{"role", "content", "private"?}`` masked as one conversation: a ``private`` message whole,
    markers in any; one ``Secrets`` for all. The messages returned have no ``"private"`` key."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
    contents, secrets = _mask([m["content"] for m in messages], [bool(m.get("private")) for m in messages],
                              [f"messages[{i}].content" for i in range(len(messages))])  # fmt: skip
    kept = [{k: v for k, v in m.items() if k != "private"} for m in messages]
    return [{**m, "content": c} for m, c in zip(kept, contents, strict=True)], secrets


def _mask(texts: list[str], whole: list[bool], names: list[str],
          literals: Sequence[str] = ()) -> tuple[list[str], Secrets]:  # fmt: skip
    """Mask ``texts`` together (``whole[i]``: all of text i is private). A private text found anywhere is masked
    everywhere, the same text always by the same placeholder; overlapping occurrences are masked as one."""
    pieces = []  # per text: (piece, private) in order
    for text, private, name in zip(texts, whole, names, strict=True):
        parts = _split(text, name)
        if private:
            joined = "".join(piece for piece, _ in parts)
            if not joined.strip():
                raise ValueError(f"{name}: a private message must have text, got {len(joined)} blank characters")
            parts = [(joined, True)]
        pieces.append(parts)
    for k, literal in enumerate(literals, 1):
        if not isinstance(literal, str) or not literal.strip():
            raise ValueError(f"private text #{k} must be non-blank text, got {literal!r}")
    known = {piece for parts in pieces for piece, private in parts if private} | set(literals)
    longest_first = "|".join(re.escape(s) for s in sorted(known, key=len, reverse=True))
    anywhere = re.compile(f"(?=({longest_first}))") if known else None  # a lookahead: overlapping occurrences too
    numbers = _free_numbers(texts)
    by_secret: dict[str, str] = {}

    def placeholder(secret: str) -> str:
        if secret not in by_secret:
            by_secret[secret] = PLACEHOLDER.format(next(numbers))
        return by_secret[secret]

    def hide(piece: str) -> str:
        covered: list[list[int]] = []  # the occurrences, overlapping ones merged
        for m in anywhere.finditer(piece) if anywhere else ():
            start, end = m.start(), m.start() + len(m.group(1))
            if covered and start < covered[-1][1]:
                covered[-1][1] = max(covered[-1][1], end)
            else:
                covered.append([start, end])
        out, pos = [], 0
        for start, end in covered:
            out += [piece[pos:start], placeholder(piece[start:end])]
            pos = end
        return "".join(out) + piece[pos:]

    masked = ["".join(placeholder(piece) if private else hide(piece) for piece, private in parts) for parts in pieces]
    return masked, Secrets({p: s for s, p in by_secret.items()})


def _split(text: str, name: str) -> list[tuple[str, bool]]:
    """``text`` as (piece, private) pieces, its markers dropped; ValueError naming where a span is malformed."""
    parts, pos, opened = [], 0, None  # opened: where the open span's marker starts
    for m in _MARKER.finditer(text):
        closing = bool(m.group(1))
        if opened is None and closing:
            raise ValueError(f"{name}: </private> at character {m.start()} closes no <private>")
        if opened is not None and not closing:
            raise ValueError(f"{name}: <private> at character {m.start()} is inside the span opened at "
                             f"character {opened}; spans do not nest")  # fmt: skip
        piece = text[pos : m.start()]
        if not closing:
            parts.append((piece, False))
        elif not piece.strip():
            raise ValueError(f"{name}: the private span at character {opened} is empty; put the private text "
                             "between <private> and </private>")  # fmt: skip
        else:  # the text without the whitespace around it: that is what is masked wherever else it occurs
            core = piece.strip()
            lead = piece.index(core)
            parts += [(piece[:lead], False), (core, True), (piece[lead + len(core) :], False)]
        pos, opened = m.end(), None if closing else m.start()
    if opened is not None:
        raise ValueError(f"{name}: <private> at character {opened} is never closed; end the span with </private>")
    parts.append((text[pos:], False))
    return [(piece, private) for piece, private in parts if piece]


def _free_numbers(texts: list[str]) -> Iterator[int]:
    """1, 2, 3, ... skipping every n whose placeholder the input already contains (it would render wrongly)."""
    written = {int(n) for text in texts for n in _WRITTEN.findall(text)}
    n = 0
    while True:
        n += 1
        if n not in written:
            yield n
