"""The OpenAI-compatible rollout endpoint, driven by the real ``openai`` client: chat and completions,
tools, n, logprobs, budgets, auth; sessions recorded token-exact (drift counted, sampled ids kept);
agents run with timeouts, errors and concurrency, their calls batched into the engine.

The engine is the real HF engine over the EOS-prone tiny model (tests.mt_envs.make_eos_model):
turns of a few random tokens that end, so the multi-turn bookkeeping is exercised with real samples.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest
import torch

from tests.mt_envs import make_eos_model
from trajflow.engines.hf import HFRolloutEngine
from trajflow.serve.agents import AgentLimits, run_agent_episodes
from trajflow.serve.app import AgentServer
from trajflow.serve.batching import GenerationQueue
from trajflow.serve.chat import assistant_message, cut_at_stop, template_messages
from trajflow.serve.sessions import drift_tokens

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_eos_model(tmp_path_factory.mktemp("eos-model"))


@pytest.fixture(scope="module")
def policy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def server(policy):
    _, tok = policy
    s = AgentServer(tok, [tok.eos_token_id]).start()
    yield s
    s.stop()


@pytest.fixture
def serving(policy, server):
    """Serve the engine from a background thread for a test's direct client calls (one session)."""
    model, tok = policy
    engine = HFRolloutEngine(model, tok.pad_token_id, [tok.eos_token_id], micro_batch_size=8)
    queue = GenerationQueue(engine.generate, seed=1, window_s=0.01)
    server.attach(queue, None)
    stop = threading.Event()
    t = threading.Thread(target=lambda: torch.no_grad()(queue.serve)(stop.is_set, lambda: 1), daemon=True)
    t.start()
    yield queue
    stop.set()
    t.join(10)
    server.detach()


def teacher_forced(model, prompt, response, temperature=1.0):
    """log softmax(logits / T) of each response token given everything before it (by hand)."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(response)]


def chatml(messages, gen=True, system=True):
    """SmolLM2's ChatML written by hand (its template adds the default system prompt first)."""
    out = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n" \
        if system and messages[0]["role"] != "system" else ""
    out += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if gen else "")


def test_chat_round_trip_records_what_was_fed_and_sampled(policy, server, serving):
    model, tok = policy
    sess = server.open_session(budget=40)
    client = openai.OpenAI(base_url=server.session_url(sess.sid), api_key=server.token, max_retries=0)
    msgs = [{"role": "user", "content": "Calculate 2 + 3."}]
    r = client.chat.completions.create(model="any", messages=msgs, n=3, max_tokens=6, logprobs=True,
                                       extra_body={"return_token_ids": True})
    extra = r.model_extra
    assert extra["prompt_token_ids"] == tok(chatml(msgs), add_special_tokens=False)["input_ids"]
    assert len(r.choices) == 3 and r.usage.prompt_tokens == len(extra["prompt_token_ids"])
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert 1 <= len(ids) <= 6
        assert c.finish_reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
        lps = [e.logprob for e in c.logprobs.content]
        assert lps == pytest.approx(teacher_forced(model, extra["prompt_token_ids"], ids), abs=1e-4)
        assert c.message.content == tok.decode(ids, skip_special_tokens=True)
    # The session's row: the first call's prompt and choice 0's tokens exactly, all generated.
    e = sess.episode(tok.eos_token_id)
    assert e.prompt_ids == extra["prompt_token_ids"]
    assert e.response_ids == r.choices[0].model_extra["token_ids"]
    assert e.loss_mask == [1] * len(e.response_ids)
    assert e.rollout_logprobs == pytest.approx([x.logprob for x in r.choices[0].logprobs.content], abs=1e-6)


def test_second_turn_uses_recorded_tokens_and_counts_drift(policy, server, serving):
    """The agent sends the reply back re-serialised (tool calls as structured fields, content
    stripped): the next prompt is the first prompt, the sampled ids, then the template's tool turn."""
    model, tok = policy
    sess = server.open_session(budget=200)
    client = openai.OpenAI(base_url=server.session_url(sess.sid), api_key=server.token, max_retries=0)
    msgs = [{"role": "user", "content": "What is 12 * 7?"}]
    r1 = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, tools=[CALC], logprobs=True,
                                        extra_body={"return_token_ids": True})
    ids1 = r1.choices[0].model_extra["token_ids"]
    # The agent pretends the model called the tool (the tiny model writes noise): it sends an assistant
    # message with a tool call the model never wrote -> not a continuation: a fresh, unchained prompt.
    fake = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*7"}'}}]}
    r_fake = client.chat.completions.create(model="m", messages=msgs + [fake, {"role": "tool", "tool_call_id": "c1",
                                                                               "content": "84"}],
                                            max_tokens=4, tools=[CALC], extra_body={"return_token_ids": True})
    rendered = template_messages(msgs + [fake, {"role": "tool", "content": "84"}])
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>' in rendered[1]["content"]
    assert r_fake.model_extra["prompt_token_ids"][:len(r1.model_extra["prompt_token_ids"]) - 3] == \
        r1.model_extra["prompt_token_ids"][:-3]
    # Now the real continuation: the reply exactly as returned (an SDK object dumped), then a tool message.
    reply = r1.choices[0].message.model_dump(exclude_none=True)
    follow = msgs + [reply, {"role": "tool", "tool_call_id": "x", "content": "84"}]
    r2 = client.chat.completions.create(model="m", messages=follow, max_tokens=8, tools=[CALC], logprobs=True,
                                        extra_body={"return_token_ids": True})
    p1, p2 = r1.model_extra["prompt_token_ids"], r2.model_extra["prompt_token_ids"]
    ended = ids1[-1] == tok.eos_token_id
    tool_turn = ("" if ended else "<|im_end|>") + "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    obs = tok(tool_turn, add_special_tokens=False)["input_ids"]
    assert p2 == p1 + ids1 + obs  # token-in/token-out: the sampled ids, never re-tokenised
    # Drift: what a re-render of the agent's history would have fed, against what was fed.
    from trajflow.envs.render import ChatRenderer

    rerendered = ChatRenderer(tok, [CALC], [tok.eos_token_id]).prompt_ids(template_messages(follow))
    assert sess.turns[2].drift == drift_tokens(rerendered, p2)
    assert sess.turns[2].parent == (0, 0) and sess.turns[1].parent is None
    # The stored row follows the chain that ends at the last call; the fake call is left out.
    ids2 = r2.choices[0].model_extra["token_ids"]
    e = sess.episode(tok.eos_token_id)
    assert e.prompt_ids == p1
    assert e.response_ids == ids1 + obs + ids2
    assert e.loss_mask == [1] * len(ids1) + [0] * len(obs) + [1] * len(ids2)
    lp2 = [x.logprob for x in r2.choices[0].logprobs.content]
    assert e.rollout_logprobs[-len(ids2):] == pytest.approx(lp2, abs=1e-6)
    assert lp2 == pytest.approx(teacher_forced(model, p2, ids2), abs=1e-4)
    assert e.rollout_logprobs[len(ids1):len(ids1) + len(obs)] == [0.0] * len(obs)
    assert e.turn_spans == [0, len(ids1), len(ids1) + len(obs), len(ids1) + len(obs) + len(ids2)]
    assert sess.unchained == 1 and sess.drift == sess.turns[2].drift
    assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant"]


def test_completions_with_token_ids_chain_exactly(policy, server, serving):
    model, tok = policy
    sess = server.open_session(budget=100)
    client = openai.OpenAI(base_url=server.session_url(sess.sid), api_key=server.token, max_retries=0)
    prompt = tok("Question: 2 + 2 =", add_special_tokens=False)["input_ids"]
    r1 = client.completions.create(model="m", prompt=prompt, max_tokens=5, logprobs=0,
                                   extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    ids1 = r1.choices[0].model_extra["token_ids"]
    assert r1.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids1]
    assert r1.choices[0].logprobs.token_logprobs == pytest.approx(teacher_forced(model, prompt, ids1), abs=1e-4)
    more = tok(" Next:", add_special_tokens=False)["input_ids"]
    r2 = client.completions.create(model="m", prompt=prompt + ids1 + more, max_tokens=5,
                                   extra_body={"return_token_ids": True})
    assert sess.turns[1].parent == (0, 0) and sess.turns[1].obs_ids == more and sess.turns[1].drift == 0
    e = sess.episode(tok.eos_token_id)
    assert e.response_ids == ids1 + more + r2.choices[0].model_extra["token_ids"]


def test_refusals_are_openai_errors(policy, server, serving):
    _, tok = policy
    sess = server.open_session(budget=3)
    url = server.session_url(sess.sid)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(model="m", messages=msgs)
    good = openai.OpenAI(base_url=url, api_key=server.token, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="unknown session"):
        openai.OpenAI(base_url=server.session_url("nope"), api_key=server.token,
                      max_retries=0).chat.completions.create(model="m", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="top_logprobs: expected an integer from 0 to 20, with logprobs"):
        good.chat.completions.create(model="m", messages=msgs, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs: not available with this rollout engine"):
        good.chat.completions.create(model="m", messages=msgs, logprobs=True, top_logprobs=2)
    r = good.chat.completions.create(model="m", messages=msgs, max_tokens=50)
    assert r.usage.completion_tokens <= 3  # capped by the episode's budget
    reply = r.choices[0].message.model_dump(exclude_none=True)
    with pytest.raises(openai.BadRequestError) as err:
        good.chat.completions.create(model="m", messages=msgs + [reply, {"role": "user", "content": "more"}])
    assert err.value.code == "context_length_exceeded" and sess.out_of_budget
    assert sess.episode(tok.eos_token_id).finish_reason == "length"
    server.detach()
    with pytest.raises(openai.BadRequestError, match="unknown session"):
        good.chat.completions.create(model="m", messages=msgs)


def test_tool_calls_parse_and_stop_strings(policy):
    _, tok = policy
    msg, calls = assistant_message('Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                   '{"expression": "2+3"}}</tool_call>')
    assert calls and msg["content"] == "Let me compute."
    assert msg["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "2+3"}'}
    bad, calls = assistant_message("<tool_call>{oops</tool_call>")
    assert not calls and bad["content"] == "<tool_call>{oops</tool_call>"
    ids = tok("The answer is 5. Done here", add_special_tokens=False)["input_ids"]
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    kept, text = cut_at_stop(ids, [". D"], decode)
    assert text == "The answer is 5" and decode(kept).startswith("The answer is 5. D")
    assert decode(kept[:-1]).find(". D") < 0  # the last kept token completes the stop string
    assert cut_at_stop(ids, ["zzz"], decode) == (ids, None)


def _engine(policy):
    model, tok = policy
    return HFRolloutEngine(model, tok.pad_token_id, [tok.eos_token_id], micro_batch_size=16)


def tool_loop_agent(task, base_url, api_key):
    """Three chat calls, feeding back each reply and a tool answer; returns the last reply's text."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task["messages"])
    for k in range(3):
        r = client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=6)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "t", "content": str(k)})
    return r.choices[0].message.content or ""


def test_agent_episodes_are_batched_and_errors_are_rows(policy, server):
    model, tok = policy
    engine = _engine(policy)
    calls = []

    def generate(prompts, params):
        calls.append(len(prompts))
        return engine.generate(prompts, params)

    def agent(task, base_url, api_key):
        kind = task["extra_info"]["kind"]
        if kind == "crash":
            raise RuntimeError("the agent fell over")
        if kind == "slow":
            time.sleep(120)
        if kind == "reward":
            tool_loop_agent(task, base_url, api_key)
            return 0.75
        return tool_loop_agent(task, base_url, api_key)

    kinds = ["loop"] * 6 + ["crash", "slow", "reward"]
    rows = [{"messages": [{"role": "user", "content": f"Task {i}"}], "ground_truth": "", "data_source": "t",
             "extra_info": {"kind": k}, "prompt_id": str(i)} for i, k in enumerate(kinds)]
    t0 = time.monotonic()
    with torch.no_grad():
        out = run_agent_episodes(agent, server, generate, rows, (1.0, 1.0, 0),
                                 AgentLimits(budget=120, timeout_s=15.0, concurrency=8))
    assert time.monotonic() - t0 < 60  # the slow agent was cut at its timeout, not waited for
    requests = sum(o.calls for o in out)
    assert [o.error for o in out[:6]] == [None] * 6, [o.error for o in out]
    assert requests == 3 * 7  # six loops and the rewarded one, three calls each
    assert len(calls) < requests / 2  # the episodes' calls shared engine batches
    for o, k in zip(out, kinds):
        e = o.episode
        assert len(e.response_ids) == len(e.loss_mask) == len(e.rollout_logprobs)
        if k in ("loop", "reward"):
            assert o.error is None and e.num_turns == 3 and o.unchained == 0
            assert e.loss_mask.count(0) > 0 and [m["role"] for m in e.messages][-1] == "assistant"
        if k == "loop":
            assert o.answer == tok.decode(e.response_ids[e.turn_spans[-2]:], skip_special_tokens=True)
    crash, slow, rewarded = out[6], out[7], out[8]
    assert crash.error == "RuntimeError: the agent fell over" and crash.episode.loss_mask == [0]
    assert crash.episode.prompt_ids == tok(chatml(rows[6]["messages"]), add_special_tokens=False)["input_ids"]
    assert crash.episode.env_reward == 0.0 and crash.episode.env_reward_source == "agent_error"
    assert slow.error.startswith("timeout:") and slow.episode.env_reward_source == "agent_error"
    assert rewarded.episode.env_reward == 0.75 and rewarded.episode.env_reward_source == "agent"
    # Every stored generated token's log-prob is the policy's, teacher-forced on the stored row.
    e = out[0].episode
    tf = teacher_forced(model, e.prompt_ids, e.response_ids)
    got = [lp for lp, m in zip(e.rollout_logprobs, e.loss_mask) if m]
    want = [lp for lp, m in zip(tf, e.loss_mask) if m]
    assert got == pytest.approx(want, abs=1e-4)
