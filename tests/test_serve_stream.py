"""The endpoint's ``stream: true`` (server-sent events as OpenAI sends them, parsed by the real
``openai`` client, usage chunk included) and ``top_logprobs`` (the most likely tokens at each
sampled position, checked against a teacher-forced forward by hand)."""

from __future__ import annotations

import threading

import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from tests.test_serve_endpoint import model_dir, policy, server  # noqa: F401 - the module-scoped fixtures
from trajflow.engines.hf import HFRolloutEngine
from trajflow.serve.batching import GenerationQueue
from trajflow.serve.stream import chat_chunks, token_pieces
from trajflow.serve.top_logprobs import teacher_forced_top_logprobs

MSGS = [{"role": "user", "content": "Calculate 2 + 3."}]


@pytest.fixture
def serving(policy, server):  # noqa: F811
    """The engine served from a background thread, with teacher-forced top log-probs."""
    model, tok = policy
    engine = HFRolloutEngine(model, tok.pad_token_id, [tok.eos_token_id], micro_batch_size=8)
    queue = GenerationQueue(engine.generate, seed=3, window_s=0.01,
                            top_logprobs=lambda *a: teacher_forced_top_logprobs(model, *a))
    server.attach(queue, None)
    stop = threading.Event()
    t = threading.Thread(target=lambda: torch.no_grad()(queue.serve)(stop.is_set, lambda: 1), daemon=True)
    t.start()
    yield
    stop.set()
    t.join(10)
    server.detach()


def _client(server, budget=64):  # noqa: F811
    sess = server.open_session(budget=budget)
    return openai.OpenAI(base_url=server.session_url(sess.sid), api_key=server.token, max_retries=0), sess


def test_chat_stream_is_the_response_in_chunks(policy, server, serving):  # noqa: F811
    _, tok = policy
    client, sess = _client(server)
    chunks = list(client.chat.completions.create(model="m", messages=MSGS, max_tokens=12, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    [turn] = sess.turns  # what the endpoint fed and sampled, recorded
    # OpenAI's shape: one id, chat.completion.chunk, a role delta first, the finish reason last per
    # choice, every chunk with usage null but the last, which has no choices and the usage.
    assert {c.id for c in chunks} == {chunks[0].id} and {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == len(turn.prompt_ids)
    assert chunks[-1].usage.completion_tokens == sum(len(s.ids) for s in turn.samples)
    for i, sample in enumerate(turn.samples):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert [m.finish_reason for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == sample.finish_reason and mine[-1].delta.content is None
        assert len(mine) - 2 == len(sample.ids)  # one content chunk per sampled token
        assert "".join(m.delta.content or "" for m in mine) == tok.decode(sample.ids, skip_special_tokens=True)


def test_stream_logprobs_and_the_clients_accumulator(policy, server, serving):  # noqa: F811
    from tests.test_serve_endpoint import teacher_forced

    model, tok = policy
    client, sess = _client(server)
    with client.chat.completions.stream(model="m", messages=MSGS, max_tokens=8, logprobs=True) as stream:
        final = stream.get_final_completion()
    [turn] = sess.turns
    ids = turn.samples[0].ids
    assert final.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    assert [e.logprob for e in final.choices[0].logprobs.content] == \
        pytest.approx(teacher_forced(model, turn.prompt_ids, ids), abs=1e-4)
    assert final.usage is None  # no include_usage: no usage chunk


def test_top_logprobs_are_the_most_likely_tokens_teacher_forced(policy, server, serving):  # noqa: F811
    model, tok = policy
    client, _ = _client(server)
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=6, temperature=0.7, logprobs=True,
                                       top_logprobs=3, extra_body={"return_token_ids": True})
    prompt, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float() / 0.7
    lp = torch.log_softmax(logits, -1)
    for k, entry in enumerate(r.choices[0].logprobs.content):
        vals, idx = torch.topk(lp[len(prompt) - 1 + k], 3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([int(i)]) for i in idx]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-4)
        assert entry.logprob == pytest.approx(float(lp[len(prompt) - 1 + k, ids[k]]), abs=1e-4)
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-5
    # Completions: an integer logprobs is the number of most likely tokens, as a {token: logprob} per position.
    c = client.completions.create(model="m", prompt="2 + 3 =", max_tokens=4, temperature=0.7, logprobs=2,
                                  extra_body={"return_token_ids": True})
    ids, prompt = c.choices[0].model_extra["token_ids"], c.model_extra["prompt_token_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float() / 0.7, -1)
    assert len(c.choices[0].logprobs.top_logprobs) == len(ids)
    for k, top in enumerate(c.choices[0].logprobs.top_logprobs):
        vals, idx = torch.topk(lp[len(prompt) - 1 + k], 2)
        assert list(top) == [tok.decode([int(i)]) for i in idx]
        assert list(top.values()) == pytest.approx(vals.tolist(), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="m", messages=MSGS, logprobs=True, top_logprobs=21)


def test_completion_stream_and_usage(policy, server, serving):  # noqa: F811
    _, tok = policy
    client, sess = _client(server)
    chunks = list(client.completions.create(model="m", prompt="2 + 3 =", max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))
    [turn] = sess.turns
    ids = turn.samples[0].ids
    assert {c.object for c in chunks} == {"text_completion"} and len(chunks) == len(ids) + 2
    assert "".join(c.choices[0].text for c in chunks[:-1]) == tok.decode(ids, skip_special_tokens=True)
    assert chunks[-2].choices[0].finish_reason == turn.samples[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


def test_tool_call_chunks_parse_back_to_the_message(policy):  # noqa: F811
    """A reply with a tool call, chunked, and accumulated by the openai client's own stream state."""
    response = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
                    "role": "assistant", "content": "Let me compute.", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "calculator", "arguments": "{\"expression\": \"2 + 3\"}"}}]}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}
    state = ChatCompletionStreamState()
    for c in chat_chunks(response, [["unused"]], usage=True):
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    final = state.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == "Let me compute." and final.choices[0].finish_reason == "tool_calls"
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls] == \
        [("call_1", "calculator", "{\"expression\": \"2 + 3\"}")]
    assert final.usage.total_tokens == 14


def test_token_pieces_join_to_the_text(policy):  # noqa: F811
    _, tok = policy
    text = "héllo → wörld 12"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = token_pieces(ids, text, lambda x: tok.decode(list(x), skip_special_tokens=True))
    assert len(pieces) == len(ids) and "".join(pieces) == text
    # a cut text (a stop string after it): the tokens past it add nothing
    pieces = token_pieces(ids, "héllo", lambda x: tok.decode(list(x), skip_special_tokens=True))
    assert "".join(pieces) == "héllo" and pieces[-1] == ""
