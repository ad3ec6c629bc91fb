"""`splitspec edge`: the client as apps use it, an OpenAI-compatible HTTP endpoint on the device.

Apps on a device talk to language models through the OpenAI API (llama.cpp's server, Ollama and LM
Studio serve it locally), so the edge serves it too: ``GET /v1/models``, ``POST /v1/chat/completions``
and ``POST /v1/completions`` (streamed as server-sent events or not), ``GET /health`` and ``GET /metrics``.
Behind them every request is one generation of the one decode loop (``client.loop.decode.generate``): the
drafter here, verification on ``--server``, offline generation when the link drops. A stream carries only
text that can no longer change (what the server verified; offline tokens once settled), so an app never
sees text taken back. Replies carry OpenAI's ``usage`` and splitspec's own figures under ``splitspec``.

An app that can show text which may still change opts in with ``"splitspec": {"provisional": true}`` in a
streamed request: while the link is cut, the tokens made offline are text the server may still replace,
and its chunks then also carry a top-level ``"splitspec": {"provisional": "..."}``, the text after all
the content streamed so far that may still change, whole: it replaces the previous one (``""``: none);
a chunk without it leaves it as it was. Such chunks may have no content of their own (an empty
``delta``, or ``text: ""``), and ``"events"`` there narrates the link ("no answer from the server:
generating offline", "server back: ..."). The content itself is the same as a plain client's, which
never sees either (``client.apps.text.TextDeltas`` makes both); the usage chunk's ``splitspec`` holds the
figures, as always. With the ``openai`` client: ``extra_body={"splitspec": {"provisional": True}}``, and
``chunk.model_extra.get("splitspec")``.

``POST /v1/completions`` takes the prompt as text or as token ids (``"prompt": [1, 2, 3]``); a prompt that
leaves no room in the server's context is OpenAI's ``400 context_length_exceeded``.

Built on Starlette + uvicorn (and sse-starlette for the event streams): well-kept ASGI libraries, the
same stack as netsim's Toxiproxy API. What answers the requests is ``client.apps.edge_pool``: generations run in worker
threads (torch releases the GIL), so
several requests proceed at once, each with its own drafter state and server session; a worker hands its
text to the event loop (``call_soon_threadsafe``), so a waiting request holds no thread. Connections to the
server (a channel that has done its Handshake) are kept for the next request, as drafters are: a request
on a slow link does not pay a Handshake's round trip. ``GET /health`` answers from the latest check of the server,
made on a thread of its own (``ServerHealth``): it never waits for the server nor for a generation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import threading
import time
import uuid

from client.apps.edge_pool import IDLE_MB, Edge, Job
from client.apps.openai_request import RequestError, parse
from shared.engine.decoder import DTYPES
from shared.engine.models import DEFAULT_MODEL

MAX_BODY_BYTES = 4 << 20


def usage(prompt_tokens: int, gen) -> dict:
    """OpenAI's usage object; ``cached_tokens``: the prompt's tokens the server took from its prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(gen.token_ids),
            "total_tokens": prompt_tokens + len(gen.token_ids),
            "prompt_tokens_details": {"cached_tokens": gen.stats.reused_tokens}}  # fmt: skip


def extension(gen, drafter: str, acceptance: str = "exact") -> dict:
    """splitspec's own figures about a reply: how it was made (``acceptance`` "typical": not the target's own
    distribution)."""
    s = gen.stats
    return {
        "drafter": drafter,
        "acceptance": acceptance,
        "server_calls": s.server_calls,
        "rounds": s.rounds,
        "streamed_tokens": s.streamed_tokens,
        "acceptance_length": round(s.acceptance_length, 3),
        "offline_tokens": s.offline_tokens,
        "disconnects": s.disconnects,
        "unverified_tokens": len(gen.verified) - sum(gen.verified),
        "bytes_sent": s.bytes_sent,
        "bytes_received": s.bytes_received,
        "rtt_ms": None if s.rtt_ms is None else round(s.rtt_ms, 2),
        "tokens_per_s": round(s.tokens_per_s, 2),
    }


def finish_reason(gen, stopped: bool) -> str:
    return "stop" if stopped or gen.finish_reason == "stop" else "length"


async def read_json(request) -> dict:
    """A request's JSON body, or a RequestError: too big, or not JSON."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"request body of {len(raw)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(400, f"the request body is not JSON: {exc}") from None


class Reply:
    """One request's answer in OpenAI's shape: its id and object kind, then either its chunks as they come
    (``events``) or its whole body (``whole``)."""

    def __init__(self, edge: Edge, ask, chat: bool, prompt_tokens: int) -> None:
        self.edge, self.ask, self.chat, self.prompt_tokens = edge, ask, chat, prompt_tokens
        self.ident, self.created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"

    def head(self) -> dict:
        """What every chunk and the whole body begin with."""
        kind = f"{self.kind}.chunk" if self.chat else self.kind
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.edge.model}

    def chunk(self, text: str | None, reason: str | None, first: bool = False, extra: dict | None = None) -> str:
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return json.dumps(self.head() | {"choices": [choice]} | ({"splitspec": extra} if extra else {}))

    async def events(self, job):
        """The stream's events: the text as it settles (with provisional text and link events when asked), the
        finish, the usage when asked, ``[DONE]``; an error once the stream has begun goes in it."""
        chat, ask = self.chat, self.ask
        try:
            if chat:
                yield self.chunk("", None, first=True)
            shown = ""  # the provisional text the app has
            async for delta in job.deltas():
                extra = {}
                if ask.provisional:
                    if delta.provisional != shown:
                        extra["provisional"] = shown = delta.provisional
                    if delta.events:
                        extra["events"] = delta.events
                if delta.settled or extra:
                    yield self.chunk(delta.settled or (None if chat else ""), None, extra=extra)
            gen = job.result()
            yield self.chunk(None if chat else "", finish_reason(gen, job.stopped))
            if ask.include_usage:
                yield json.dumps(self.head() | {"choices": [], "usage": usage(self.prompt_tokens, gen),
                                                "splitspec": extension(gen, self.edge.drafter_name, ask.acceptance)})
        except Exception as exc:  # noqa: BLE001 - the stream has begun: the error goes in it
            yield json.dumps(RequestError(502, f"generation failed: {exc}", kind="server_error").body())
        finally:
            job.cancel()
        yield "[DONE]"

    def whole(self, job, gen) -> dict:
        """The body of an answer that is not streamed."""
        text = job.text
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat
                  else {"index": 0, "text": text, "logprobs": None})  # fmt: skip
        choice["finish_reason"] = finish_reason(gen, job.stopped)
        return {"id": self.ident, "object": self.kind, "created": self.created, "model": self.edge.model,
                "choices": [choice], "usage": usage(self.prompt_tokens, gen),
                "splitspec": extension(gen, self.edge.drafter_name, self.ask.acceptance)}  # fmt: skip


def app(edge: Edge):
    """The Starlette application serving ``edge``."""
    from prometheus_client import make_asgi_app
    from sse_starlette.sse import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Mount, Route

    c = edge.counters

    def error(exc: RequestError, route: str) -> JSONResponse:
        c.requests.labels(route, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    async def models(request: Request) -> JSONResponse:
        c.requests.labels("models", "200").inc()
        return JSONResponse({"object": "list", "data": [
            {"id": edge.model, "object": "model", "created": 0, "owned_by": "splitspec"}]})  # fmt: skip

    async def health(request: Request) -> JSONResponse:
        """From the latest check of the server (``ServerHealth``): never waits for the server or a generation."""
        serving, age_s = await edge.health.serving()
        return JSONResponse({"status": "ok", "server": edge.server, "server_serving": serving,
                             "server_checked_s": None if age_s is None else round(age_s, 3),
                             "drafter": edge.drafter_name, "model": edge.model})  # fmt: skip

    async def completion(request: Request, chat: bool):
        route = "chat" if chat else "completions"
        try:
            ask = parse(await read_json(request), chat, edge.model)
        except RequestError as exc:
            return error(exc, route)
        job = Job(edge, ask)
        job.start()
        try:  # the answer's status waits for the prompt's checks (encoded and sized on the worker, not on the loop)
            begun = await job.started()
        except BaseException:
            job.cancel()
            raise
        if not begun and isinstance(job.error, RequestError):
            return error(job.error, route)
        reply = Reply(edge, ask, chat, len(job.prompt_ids))
        if ask.stream:
            c.requests.labels(route, "200").inc()
            return EventSourceResponse(reply.events(job), ping=15)
        try:
            async for _ in job.deltas():
                pass
            gen = job.result()
        except Exception as exc:  # noqa: BLE001 - whatever stopped the generation, said in OpenAI's shape
            return error(RequestError(502, f"generation failed: {exc}", kind="server_error"), route)
        finally:
            job.cancel()
        c.requests.labels(route, "200").inc()
        return JSONResponse(reply.whole(job, gen))

    async def chat(request: Request):
        return await completion(request, chat=True)

    async def complete(request: Request):
        return await completion(request, chat=False)

    async def not_found(request: Request, exc) -> JSONResponse:
        status = getattr(exc, "status_code", 404)
        message = "no such route" if status == 404 else "method not allowed" if status == 405 else str(exc)
        return JSONResponse(RequestError(status, f"{message}: {request.method} {request.url.path}").body(),
                            status_code=status)  # fmt: skip

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Mount("/metrics", make_asgi_app(c.registry)),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


# --- the command ---


def add_arguments(p: argparse.ArgumentParser) -> None:
    from client.apps.options import add_connection_arguments, add_mode_argument

    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this device only)")
    p.add_argument("--port", type=int, default=8000, help="port to serve on (default 8000)")
    add_connection_arguments(p)
    add_mode_argument(p)
    p.add_argument("--drafter", default="prompt-lookup",
                   help="none, prompt-lookup (default), a model sharing the target's tokenizer (qwen2.5-coder-0.5b, "
                        "with +lookup for prompt lookup first; a GGUF or Hugging Face folder), a trained bundle "
                        "(moa-tli0, moa-tli1, moa-tli3, eagle, independent) or a bundle's path")  # fmt: skip
    p.add_argument("--on-reconnect", default="verify", choices=["verify", "keep"],
                   help="when the link fails, generate offline, then have the server verify those tokens (verify, "
                        "the default: streams wait for it) or take them as they are (keep)")  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help="the served model's name and tokenizer (default "
                   f"{DEFAULT_MODEL})")
    p.add_argument("--cache-dir", help="where converted models are kept")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="a trained drafter's and its frozen target parts' dtype (default auto)")  # fmt: skip
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--idle-memory-mb", type=int, default=IDLE_MB, help="what idle clients' drafters may hold for the "
                   f"conversations they go on from (default {IDLE_MB}; the ones idle longest are closed beyond it)")


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from client.net.endpoint import Endpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        address = args.server
        if args.via_netsim:
            from netsim import simulated_link

            address = stack.enter_context(simulated_link(args.server, args.via_netsim)).address
        endpoint = Endpoint.from_files(address, args.tls, args.tls_ca, args.tls_cert, args.tls_key,
                                       args.auth_token_file)  # fmt: skip
        edge = Edge(args.server, args.drafter, args.model, args.on_reconnect, endpoint, args.dtype, args.cache_dir,
                    args.connect_timeout, mode=args.mode, idle_mb=args.idle_memory_mb)  # fmt: skip
        stack.callback(edge.close)
        link = f", via netsim {args.via_netsim}" if args.via_netsim else ""
        print(f"splitspec edge: OpenAI-compatible API on http://{args.host}:{args.port}/v1 (model {edge.model!r}, "
              f"drafter {args.drafter}, server {args.server}{link})", flush=True)  # fmt: skip
        config = uvicorn.Config(app(edge), host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=SHUTDOWN_S)  # fmt: skip
        serve_until_stopped(config, edge.stopping)
    return 0


SHUTDOWN_S = 5.0  # after SIGTERM, the longest uvicorn waits for open responses before it closes them


def serve_until_stopped(config, stopping: threading.Event) -> None:
    """Run uvicorn; on SIGTERM/SIGINT first tell every generation to end (a stream then gets its last chunk and
    ``[DONE]``; a generation waiting for a vanished server stops waiting), then shut down as usual. uvicorn alone
    waits for open responses, and a generation parked offline would keep one open for minutes. The process then
    exits 0: a stop that was asked for is not a failure (uvicorn re-raises the signal, exit code -15)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # uvicorn's own would raise the signal again on the way out
            stopping.set()
            self.force_exit = self.should_exit and sig == signal.SIGINT  # a second Ctrl-C: now
            self.should_exit = True

    Server(config).run()
