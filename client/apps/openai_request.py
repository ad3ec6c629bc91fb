"""What an OpenAI request asks for (``parse`` -> ``Ask``), checked field by field, and the errors in OpenAI's shape
(``RequestError``: status, message, ``param``, ``code``) that its SDKs and apps recognise."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


class RequestError(Exception):
    """A request the endpoint refuses: OpenAI's error shape, with the HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def context_exceeded(prompt_tokens: int, max_context: int, param: str) -> RequestError:
    """OpenAI's answer to a prompt longer than the model's context (what its SDKs and apps recognise)."""
    return RequestError(400, f"This model's maximum context length is {max_context} tokens, however your prompt is "
                        f"{prompt_tokens} tokens (the prompt plus one generated token must fit). Please reduce the "
                        "length of the prompt.", param, "context_length_exceeded")  # fmt: skip


def completion_exceeded(prompt_tokens: int, max_tokens: int, max_context: int, chat: bool) -> RequestError:
    """OpenAI's answer to a ``max_tokens`` that cannot fit after the prompt (rather than generating until the context
    is full, for minutes, as a ``max_tokens`` of 10**12 did)."""
    where = "messages" if chat else "prompt"
    return RequestError(400, f"This model's maximum context length is {max_context} tokens. However, you requested "
                        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the "
                        f"completion). Please reduce the length of the {where} or completion.", "max_tokens",
                        "context_length_exceeded")  # fmt: skip


# --- what a request asks for ---


@dataclass
class Ask:
    """One request, checked: the prompt (text, token ids or chat messages) and how to generate."""

    chat: bool
    prompt: str | list[int] | list[dict]
    max_tokens: int | None  # None: not asked for, as many as fit (up to DEFAULT_MAX_TOKENS)
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    provisional: bool = False  # splitspec's extension: stream the text that may still change too
    acceptance: str = "exact"  # splitspec's extension: "typical" judges sampled drafts by Medusa's rule (not lossless)


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(400, f"{key} must be a number in [{low:g}, {high:g}], got {value!r}", key)
    return float(value)


def _integer(body: dict, key: str, default: int | None, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(400, f"{key} must be an integer >= {low}, got {value!r}", key)
    return value


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or OpenAI's list of content parts (text parts only)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts, got {content!r:.80}",
                       f"messages[{i}].content")  # fmt: skip


def _prompt(prompt: object) -> str | list[int]:
    """A completion's prompt: text or token ids (OpenAI's ``[1, 2, 3]``); a batch of one of either is that one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    raise RequestError(400, "prompt must be a non-empty string or a non-empty list of token ids (integers >= 0), one "
                       f"prompt per request, got {prompt!r:.80}", "prompt")  # fmt: skip


def parse(body: object, chat: bool, model: str) -> Ask:
    """Check a request body against what the endpoint serves; RequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    asked = body.get("model")
    if not isinstance(asked, str) or not asked:
        raise RequestError(400, "model is required: a string, e.g. " + json.dumps(model), "model")
    if asked != model:
        raise RequestError(404, f"The model {asked!r} does not exist; this endpoint serves {model!r}", "model",
                           "model_not_found")  # fmt: skip
    if _integer(body, "n", 1, 1) != 1:
        raise RequestError(400, "n must be 1: one choice per request", "n")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list of {role, content}", "messages")
        prompt = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise RequestError(400, f"messages[{i}].role must be system, developer, user or assistant",
                                   f"messages[{i}].role")  # fmt: skip
            role = "system" if m["role"] == "developer" else m["role"]
            prompt.append({"role": role, "content": _content(m, i), **({"private": True} if m.get("private") else {})})
    else:
        prompt = _prompt(body.get("prompt"))
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop must be a non-empty string or a list of at most 4 of them", "stop")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object", "stream_options")
    seed = _integer(body, "seed", None, 0)
    from shared.acceptance import ACCEPTANCE

    extension = body.get("splitspec") or {}
    if not isinstance(extension, dict) or not isinstance(extension.get("provisional", False), bool):
        raise RequestError(400, 'splitspec must be an object such as {"provisional": true}', "splitspec")
    if extension.get("acceptance", "exact") not in ACCEPTANCE:
        raise RequestError(400, f"splitspec.acceptance must be one of {', '.join(ACCEPTANCE)}, "
                           f"got {extension.get('acceptance')!r}", "splitspec")  # fmt: skip
    return Ask(
        chat=chat,
        prompt=prompt,
        max_tokens=_integer({"max_tokens": limit}, "max_tokens", None, 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        seed=seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little"),
        stop=stop,
        stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)),
        provisional=extension.get("provisional", False),
        acceptance=extension.get("acceptance", "exact"),
    )
