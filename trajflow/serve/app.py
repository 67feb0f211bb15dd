"""The OpenAI-compatible endpoint over a rollout engine: ``/v1/chat/completions``, ``/v1/completions``
and ``/v1/models``, on loopback, behind a per-run bearer token.

Each episode gets its own base URL, ``http://127.0.0.1:<port>/s/<session>/v1`` (or the header
``X-Session-Id`` on ``/v1/...``): its calls are recorded token-exact in its
:class:`~trajflow.serve.sessions.Session`. A call outside an open session is refused (HTTP 400), as
is every call while no rollout is running (503).

Sampling during a training rollout is the run's (``rollout.temperature/top_p/top_k``): the stored
rows are trained at that temperature, so a request asking for another is served with the run's and
counted (``rollout/agent_sampling_overrides``). ``max_tokens`` is honoured up to what is left of the
episode's budget. ``stream: true`` answers with OpenAI's server-sent events (:mod:`trajflow.serve.stream`),
``top_logprobs`` (chat, up to 20) and an integer ``logprobs`` (completions) with the most likely tokens
computed teacher-forced (:mod:`trajflow.serve.top_logprobs`). Not supported (HTTP 400): ``echo``,
non-text content parts. vLLM-style extensions: ``return_token_ids`` (the prompt's and each choice's ids in
the response) and ``return_tokens_as_token_ids`` (log-prob entries name ids, ``token_id:<id>``).

A standalone server (``open_budget`` > 0, :mod:`trajflow.serve.standalone`, e.g. an LLM judge) also
serves calls without a session, each in a session of its own that is not kept.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from trajflow.serve.batching import GenerationQueue
from trajflow.serve.chat import RequestError, assistant_message, cut_at_stop, message_key, template_messages
from trajflow.serve.sessions import BudgetExhausted, Sample, Session, SessionClosed, Turn
from trajflow.serve.stream import chat_chunks, completion_chunks, include_usage, sse, token_pieces

#: The model name the endpoint answers to (any name is accepted in requests).
MODEL_NAME = "trajflow-policy"


class AgentServer:
    """The endpoint, its sessions and the engine queue of the running rollout.

    Args:
        tokenizer: the policy's tokenizer (with a chat template for chat completions).
        eos_ids: ids that end a turn.
        fmt: the tool-call format (``rollout.multi_turn.format``).
        open_budget: > 0: a call without a session is served (most ``open_budget`` new tokens) in a
            session of its own, not kept (a standalone server); 0: such a call is refused.

    Attributes:
        token: the bearer token (``api_key``) every request must carry; new per server.
        base_url: ``http://127.0.0.1:<port>``.
    """

    def __init__(self, tokenizer: Any, eos_ids, fmt: str = "hermes", open_budget: int = 0) -> None:
        self.tokenizer = tokenizer
        self.open_budget = int(open_budget)
        self.eos_ids = [int(e) for e in eos_ids]
        self.fmt = fmt
        self.token = secrets.token_urlsafe(32)
        self.sessions: dict[str, Session] = {}
        self.queue: GenerationQueue | None = None
        self.sampling: tuple[float, float, int] | None = None
        self.sampling_overrides = 0
        self._renderers: dict[str, Any] = {}
        self._lock = threading.Lock()
        # A fast tokenizer is one Rust object: concurrent calls from the handler threads can fail
        # ("Already borrowed"), so every use of it by the endpoint is serialised.
        self.tokenizer_lock = threading.RLock()
        self._server = None
        self._thread = None
        self.port = 0

    # ------------------------------------------------------------------ life cycle
    def start(self, port: int = 0) -> "AgentServer":
        """Serve on 127.0.0.1 (``port``, 0 = a free one) from a daemon thread; returns once it accepts connections."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", int(port)))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="trajflow-agent-server")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start on 127.0.0.1")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving (waits for the server thread)."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def session_url(self, sid: str) -> str:
        """The OpenAI ``base_url`` of session ``sid``."""
        return f"{self.base_url}/s/{sid}/v1"

    # ------------------------------------------------------------------ rollouts and sessions
    def attach(self, queue: GenerationQueue, sampling: tuple[float, float, int] | None) -> None:
        """Serve calls into ``queue`` from now on; ``sampling`` = ``(temperature, top_p, top_k)`` every
        call is sampled with (None: the request's own)."""
        self.queue, self.sampling, self.sampling_overrides = queue, sampling, 0

    def detach(self) -> None:
        """No rollout is running: calls get HTTP 503; every session is dropped."""
        self.queue = None
        with self._lock:
            for s in self.sessions.values():
                s.close("the rollout is over")
            self.sessions.clear()

    def open_session(self, budget: int, max_prompt_length: int = 0, turn_tokens: int = 0) -> Session:
        """A new session (random id) for one episode."""
        sid = uuid.uuid4().hex
        s = Session(sid, budget, max_prompt_length, turn_tokens, self.eos_ids)
        with self._lock:
            self.sessions[sid] = s
        return s

    def session(self, sid: str | None) -> Session:
        if not sid and self.open_budget > 0:  # a standalone server: a session for this call alone
            return Session(uuid.uuid4().hex, self.open_budget, 0, 0, self.eos_ids)
        if not sid:
            raise RequestError("no session: call the episode's base URL (…/s/<session>/v1) or send X-Session-Id")
        with self._lock:
            s = self.sessions.get(sid)
        if s is None:
            raise SessionClosed(f"unknown session {sid!r}")
        return s

    def renderer(self, tools: list[dict]) -> tuple[Any, str]:
        """The chat renderer for ``tools`` (cached) and the tools' canonical JSON text."""
        from trajflow.envs.render import ChatRenderer

        key = json.dumps(tools, sort_keys=True, ensure_ascii=False) if tools else ""
        with self.tokenizer_lock, self._lock:
            r = self._renderers.get(key)
            if r is None:
                try:
                    r = self._renderers[key] = ChatRenderer(self.tokenizer, tools, self.eos_ids)
                except ValueError as e:
                    raise RequestError(str(e)) from None
        return r, key

    # ------------------------------------------------------------------ sampling
    def _sample(self, prepared, body: dict, n: int, default_max: int, top: int = 0) -> list:
        queue = self.queue
        if queue is None:
            raise _Unavailable("no rollout is running")
        if top and queue.top_logprobs is None:
            raise RequestError("top_logprobs: not available with this rollout engine (it needs the model in this process)")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        cap = prepared.budget if max_tokens is None else min(_int(max_tokens, "max_tokens", 1), prepared.budget)
        cap = min(cap, default_max) if max_tokens is None and default_max else cap
        asked = (_num(body.get("temperature"), "temperature", 1.0), _num(body.get("top_p"), "top_p", 1.0))
        if self.sampling is not None:
            temperature, top_p, top_k = self.sampling
            if (body.get("temperature") is not None and asked[0] != temperature) or \
                    (body.get("top_p") is not None and asked[1] != top_p):
                with self._lock:
                    self.sampling_overrides += 1
        else:
            temperature, top_p, top_k = asked[0], asked[1], 0
        return queue.submit(prepared.prompt_ids, n, cap, temperature, top_p, top_k, top).result()

    def decode(self, ids) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _cut(self, row, stop: list[str]) -> tuple[list[int], Any, str, str]:
        """A sampled row cut at its first stop string: (ids, log-probs, finish reason, text).

        The ids and log-probs kept are those up to the token that completes the stop string (what
        the session records and the row trains on); the text ends before the stop string, as
        OpenAI's API returns it.
        """
        ids, before = cut_at_stop(row.ids, stop, self.decode)
        lps = row.logprobs[:len(ids)] if row.logprobs is not None else None
        finish = "stop" if before is not None else row.finish_reason
        return ids, lps, finish, (before if before is not None else self.decode(ids))

    def _token_name(self, t: int, as_ids: bool) -> str:
        """A log-prob entry's ``token``: its text, special tokens written out (``<|im_end|>``), as vLLM does."""
        if as_ids:
            return f"token_id:{t}"
        with self.tokenizer_lock:
            return self.tokenizer.decode([int(t)], skip_special_tokens=False)

    def _token_entries(self, ids, lps, as_ids: bool, top=None) -> list[dict]:
        out = []
        for k, (t, lp) in enumerate(zip(ids, lps)):
            tok = self._token_name(t, as_ids)
            alts = []
            for a, alp in (top[k] if top is not None and k < len(top) else []):
                name = self._token_name(a, as_ids)
                alts.append({"token": name, "logprob": float(alp), "bytes": list(name.encode("utf-8"))})
            out.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode("utf-8")), "top_logprobs": alts})
        return out

    # ------------------------------------------------------------------ endpoints
    def chat(self, sid: str | None, body: dict) -> dict:
        """``POST /v1/chat/completions`` (the whole response; :meth:`stream_chat` for ``stream: true``)."""
        return self._chat(sid, body)[0]

    def _chat(self, sid: str | None, body: dict) -> tuple[dict, list[Sample]]:
        session = self.session(sid)
        _refuse_unsupported(body)
        raw = body.get("messages")
        history = template_messages(raw)
        tools = body.get("tools") or []
        if not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type", "function") != "function"
                                              for t in tools):
            raise RequestError("tools: expected a list of {'type': 'function', 'function': {...}}")
        if body.get("tool_choice") == "none":
            tools = []
        renderer, tools_key = self.renderer(tools)
        keys = [message_key(m) for m in raw]
        with self.tokenizer_lock:
            prepared = session.prepare_chat(renderer, history, keys, tools_key)
        n = _int(body.get("n", 1), "n", 1)
        stop = _stops(body.get("stop"))
        top = _int(body.get("top_logprobs") or 0, "top_logprobs", 0)
        if top > 20 or (top and not body.get("logprobs")):
            raise RequestError("top_logprobs: expected an integer from 0 to 20, with logprobs: true")
        rows = self._sample(prepared, body, n, 0, top)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        turn = Turn("chat", prepared.prompt_ids, history, keys, tools_key, prepared.parent, prepared.obs_ids,
                    prepared.drift, raw=[dict(m) for m in raw])
        choices = []
        for i, row in enumerate(rows):
            ids, lps, finish, text = self._cut(row, stop)
            message, has_calls = assistant_message(text, self.fmt)
            turn.samples.append(Sample(ids, lps, finish, text, message))
            choice = {"index": i, "message": message,
                      "finish_reason": "tool_calls" if has_calls and finish == "stop" else finish,
                      "logprobs": {"content": self._token_entries(ids, lps, as_ids, row.top), "refusal": None}
                      if body.get("logprobs") and lps is not None else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            choices.append(choice)
        session.record(turn)
        return _response("chatcmpl", "chat.completion", body, choices, prepared.prompt_ids, turn.samples), turn.samples

    def completion(self, sid: str | None, body: dict) -> dict:
        """``POST /v1/completions``: a text prompt or token ids (the whole response; :meth:`stream_completion`
        for ``stream: true``)."""
        return self._completion(sid, body)[0]

    def _completion(self, sid: str | None, body: dict) -> tuple[dict, list[Sample]]:
        session = self.session(sid)
        _refuse_unsupported(body)
        if body.get("echo"):
            raise RequestError("echo is not supported")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            text, ids = None, [int(t) for t in prompt]
        elif isinstance(prompt, str) and prompt:
            text, ids = prompt, None
        else:
            raise RequestError("prompt: expected one non-empty string or one list of token ids")
        with self.tokenizer_lock:  # before the session's lock, as for chat (one lock order)
            prepared = session.prepare_completion(self.encode, text, ids)
        n = _int(body.get("n", 1), "n", 1)
        stop = _stops(body.get("stop"))
        want = body.get("logprobs")  # an integer here: the number of most likely tokens (0 = the sampled one's only)
        top = 0 if want is None else _int(want, "logprobs", 0)
        if top > 5:
            raise RequestError("logprobs: expected an integer from 0 to 5")
        rows = self._sample(prepared, body, n, 16, top)  # OpenAI's default max_tokens for completions
        turn = Turn("completion", prepared.prompt_ids, [text] if text is not None else [], parent=prepared.parent,
                    obs_ids=prepared.obs_ids, drift=prepared.drift)
        choices = []
        for i, row in enumerate(rows):
            ids, lps, finish, out_text = self._cut(row, stop)
            turn.samples.append(Sample(ids, lps, finish, out_text))
            logprobs = None
            if want is not None and lps is not None:
                as_ids = bool(body.get("return_tokens_as_token_ids"))
                toks = [self._token_name(t, as_ids) for t in ids]
                offsets, pos = [], 0
                for tok in toks:
                    offsets.append(pos)
                    pos += len(tok)
                tops = None if not top or row.top is None else \
                    [{self._token_name(a, as_ids): float(alp) for a, alp in alts} for alts in row.top[:len(ids)]]
                logprobs = {"tokens": toks, "token_logprobs": [float(x) for x in lps], "top_logprobs": tops,
                            "text_offset": offsets}
            choice = {"index": i, "text": out_text, "finish_reason": finish, "logprobs": logprobs}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            choices.append(choice)
        session.record(turn)
        return _response("cmpl", "text_completion", body, choices, prepared.prompt_ids, turn.samples), turn.samples

    def stream_chat(self, sid: str | None, body: dict) -> list[dict]:
        """``POST /v1/chat/completions`` with ``stream: true``: the response's chunks (:func:`trajflow.serve.stream.chat_chunks`)."""
        response, samples = self._chat(sid, body)
        pieces = [token_pieces(s.ids, c["message"].get("content") or "", self.decode)
                  for s, c in zip(samples, response["choices"])]
        return list(chat_chunks(response, pieces, include_usage(body)))

    def stream_completion(self, sid: str | None, body: dict) -> list[dict]:
        """``POST /v1/completions`` with ``stream: true``: the response's chunks."""
        response, samples = self._completion(sid, body)
        pieces = [token_pieces(s.ids, c["text"], self.decode) for s, c in zip(samples, response["choices"])]
        return list(completion_chunks(response, pieces, include_usage(body)))


class _Unavailable(RuntimeError):
    """No rollout is running (HTTP 503)."""


def _refuse_unsupported(body: dict) -> None:
    if not isinstance(body, dict):
        raise RequestError("expected a JSON object")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise RequestError(f"stream: expected true or false, got {body.get('stream')!r}")


def _int(v: Any, name: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise RequestError(f"{name}: expected an integer >= {lo}, got {v!r}")
    return v


def _num(v: Any, name: str, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise RequestError(f"{name}: expected a number >= 0, got {v!r}")
    return float(v)


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return [s for s in stop if s]
    raise RequestError("stop: expected a string or a list of up to 4 strings")


def _response(id_prefix: str, kind: str, body: dict, choices: list[dict], prompt_ids, samples) -> dict:
    """The OpenAI response object around ``choices`` (``kind``: ``chat.completion`` or
    ``text_completion``), with the prompt's token ids when the request asked for them (vLLM's
    ``return_token_ids``)."""
    out = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
           "model": body.get("model") or MODEL_NAME, "choices": choices, "usage": _usage(prompt_ids, samples)}
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = prompt_ids
    return out


def _usage(prompt_ids, samples) -> dict:
    done = sum(len(s.ids) for s in samples)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": done, "total_tokens": len(prompt_ids) + done}


def build_app(server: AgentServer):
    """The FastAPI app of ``server`` (handlers run in FastAPI's thread pool and wait on the engine queue)."""
    app = FastAPI(title="trajflow rollout endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)

    def authorised(request: Request) -> bool:
        got = request.headers.get("authorization", "")
        return got.startswith("Bearer ") and secrets.compare_digest(got[7:].encode(), server.token.encode())

    def handle(request: Request, sid: str | None, body: Any, fn) -> JSONResponse:
        if not authorised(request):
            return error(401, "missing or wrong bearer token (the api_key the agent was given)",
                         "authentication_error", "invalid_api_key")
        try:
            sid = sid or request.headers.get("x-session-id")
            if isinstance(body, dict) and body.get("stream"):
                # Generated before the first event, so a refusal is still an HTTP error, as OpenAI's.
                chunks = (server.stream_chat if fn == server.chat else server.stream_completion)(sid, body)
                return StreamingResponse(sse(iter(chunks)), media_type="text/event-stream")
            return JSONResponse(fn(sid, body))
        except BudgetExhausted as e:
            return error(400, str(e), "invalid_request_error", "context_length_exceeded")
        except SessionClosed as e:
            return error(400, str(e), "invalid_request_error", "session_closed")
        except RequestError as e:
            return error(400, str(e), "invalid_request_error")
        except _Unavailable as e:
            return error(503, str(e), "server_error")

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    for prefix in ("/v1", "/s/{sid}/v1"):
        async def chat(request: Request, sid: str | None = None):
            return await run_in_threadpool(handle, request, sid, await body_of(request), server.chat)

        async def completions(request: Request, sid: str | None = None):
            return await run_in_threadpool(handle, request, sid, await body_of(request), server.completion)

        async def models(request: Request, sid: str | None = None):
            if not authorised(request):
                return error(401, "missing or wrong bearer token", "authentication_error", "invalid_api_key")
            return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0,
                                                             "owned_by": "trajflow"}]})

        app.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/models", models, methods=["GET"])
    return app
