"""The multi-turn episode loop: token-in/token-out rows per the contract, on the real HF engine with the
tiny model, and the tool flow and budgets with scripted assistant turns and the real sandbox."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from trajflow.stages.multi_turn import multi_turn_metrics, multi_turn_table
from trajflow.stages.rollout import SamplingParams
from trajflow.engines.base import GenerationOutput
from trajflow.engines.episodes import EpisodeLimits, run_episodes
from trajflow.engines.hf import HFRolloutEngine
from trajflow.envs.registry import ENVIRONMENTS, EnvContext, Environment, StepResult, make_environment
from trajflow.envs.render import ChatRenderer
from trajflow.envs.sandbox import Sandbox
from trajflow.envs.tools import BUILTIN_TOOLS

ROW = {"messages": [{"role": "user", "content": "Calculate 1234 * 5678."}], "ground_truth": "7006652",
       "data_source": "reasoning_gym/basic_arithmetic", "extra_info": {}, "prompt_id": "0"}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>'


class GoOn(Environment):
    """Never done: answers every assistant message with the user message "go on"."""

    def step(self, message: dict) -> StepResult:
        return StepResult(observations=[{"role": "user", "content": "go on"}])


@ENVIRONMENTS.register("test_go_on")
def _go_on(ctx: EnvContext) -> GoOn:
    return GoOn()


class GradedAtTheEnd(Environment):
    """Steps never reward; a message asking to go on ends after two assistant turns. The terminal
    call rewards 0.25 per assistant message and records the finish reason it was told."""

    def __init__(self):
        self.turns, self.final_calls = 0, []

    def step(self, message: dict) -> StepResult:
        self.turns += 1
        return StepResult(done=self.turns >= 2, observations=[{"role": "user", "content": "go on"}])

    def final_reward(self, messages, finish_reason):
        self.final_calls.append(finish_reason)
        return 0.25 * sum(m["role"] == "assistant" for m in messages)


class SilentToo(GradedAtTheEnd):
    def final_reward(self, messages, finish_reason):
        self.final_calls.append(finish_reason)
        return None


@ENVIRONMENTS.register("test_graded_at_the_end")
def _graded(ctx: EnvContext) -> GradedAtTheEnd:
    return GradedAtTheEnd()


@ENVIRONMENTS.register("test_silent_too")
def _silent(ctx: EnvContext) -> SilentToo:
    return SilentToo()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@dataclass
class Scripted:
    """An engine that "samples" given assistant texts in order (one list per episode), for the loop's logic."""

    tok: object
    turns: list[list[str]]
    calls: int = 0
    stop_ids: tuple = ()  # ids besides the tokenizer's EOS that end a turn ("stop")

    def generate(self, prompt_ids, params):
        out, lps, fin = [], [], []
        for p in prompt_ids:
            k = self.owner[tuple(p[:self.plen])]
            text = self.turns[k].pop(0)
            ids = self.tok(text, add_special_tokens=False)["input_ids"][:params.max_new_tokens]
            out.append(ids)
            lps.append([-0.5] * len(ids))
            fin.append("stop" if ids and (ids[-1] == self.tok.eos_token_id or ids[-1] in self.stop_ids) else "length")
        self.calls += 1
        return GenerationOutput(response_ids=out, finish_reason=fin, rollout_logprobs=lps)


def _scripted(tok, renderer, turns, env_name="tool_calculator", limits=None, sandbox=None, eos_ids=None,
              default_reward=None):
    sandbox = sandbox or Sandbox([BUILTIN_TOOLS["calculator"]], max_response_chars=64,
                                 allow_weaker=True)  # the loop, not the isolation, is tested here
    envs = [make_environment(env_name, EnvContext([], sandbox)) for _ in turns]
    rows = [{**ROW, "messages": [{"role": "user", "content": f"Problem {k}."}]} for k in range(len(turns))]
    engine = Scripted(tok, turns, stop_ids=tuple(eos_ids or ()))
    # Episodes are told apart by their prompt tokens (they differ only in the problem number).
    prompts = [renderer.prompt_ids(e.reset(r)) for e, r in zip(envs, rows)]
    engine.plen = len(prompts[0])
    engine.owner = {tuple(p): k for k, p in enumerate(prompts)}
    limits = limits or EpisodeLimits(total_tokens=512, max_assistant_turns=3, max_user_turns=3)
    return run_episodes(engine, renderer, envs, rows, SamplingParams(temperature=1.0, seed=1), limits,
                        list(eos_ids or [tok.eos_token_id]), default_reward=default_reward)


def test_tool_call_episode_follows_the_row_contract(tok):
    renderer = ChatRenderer(tok, [BUILTIN_TOOLS["calculator"].schema()], [tok.eos_token_id])
    eos = tok.eos_token
    (ep,) = _scripted(tok, renderer, [[f"Let me compute. {CALL}{eos}", f"The product is 7006652.\nAnswer: 7006652{eos}"]])
    assert ep.finish_reason == "stop" and ep.num_turns == 2
    t1 = tok(f"Let me compute. {CALL}{eos}", add_special_tokens=False)["input_ids"]
    t2 = tok(f"The product is 7006652.\nAnswer: 7006652{eos}", add_special_tokens=False)["input_ids"]
    # ChatML, written out by hand: the closing newline, the tool turn, the next generation prompt.
    obs = tok("\n<|im_start|>tool\n7006652<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ep.response_ids == t1 + obs + t2
    assert ep.loss_mask == [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
    assert ep.rollout_logprobs == [-0.5] * len(t1) + [0.0] * len(obs) + [-0.5] * len(t2)
    assert ep.turn_spans == [0, len(t1), len(t1) + len(obs), len(t1) + len(obs) + len(t2)]
    assert [m["role"] for m in ep.messages] == ["assistant", "tool", "assistant"]
    assert '"expression": "1234 * 5678"' in ep.messages[0]["tool_calls"] and ep.messages[2]["tool_calls"] is None
    (call,) = ep.tool_calls
    assert (call["turn"], call["name"], call["result"], call["error"]) == (0, "calculator", "7006652", None)
    # The prompt: the reset messages with the plain tools block in the system message (no tools= in SmolLM2's template).
    text = tok.decode(ep.prompt_ids)
    assert text.startswith("<|im_start|>system\n") and '"name": "calculator"' in text and "<tools>" in text
    assert text.endswith("<|im_start|>user\nProblem 0.<|im_end|>\n<|im_start|>assistant\n")


def test_a_turn_ended_by_another_end_token_keeps_the_templates_closing(tok):
    """The model stops on <|endoftext|> (an end-of-turn id too) where ChatML closes turns with
    <|im_end|>: only what the model wrote is taken off the closing, so <|im_end|> is still appended."""
    other = tok.convert_tokens_to_ids("<|endoftext|>")
    assert other != tok.eos_token_id and tok.eos_token == "<|im_end|>"
    eos_ids = [tok.eos_token_id, other]
    renderer = ChatRenderer(tok, [BUILTIN_TOOLS["calculator"].schema()], eos_ids)
    (ep,) = _scripted(tok, renderer, [[f"Let me compute. {CALL}<|endoftext|>", f"Answer: 7006652{tok.eos_token}"]],
                      eos_ids=eos_ids)
    t1 = tok(f"Let me compute. {CALL}<|endoftext|>", add_special_tokens=False)["input_ids"]
    t2 = tok(f"Answer: 7006652{tok.eos_token}", add_special_tokens=False)["input_ids"]
    assert t1[-1] == other
    # ChatML by hand: the whole closing (<|im_end|> and the newline), the tool turn, the generation prompt.
    obs = tok("<|im_end|>\n<|im_start|>tool\n7006652<|im_end|>\n<|im_start|>assistant\n",
              add_special_tokens=False)["input_ids"]
    assert ep.response_ids == t1 + obs + t2
    # Ended on the template's own end of turn: only the newline is appended (unchanged).
    direct = renderer.observation_ids([{"role": "user", "content": "hi"}], [{"role": "user", "content": "go on"}],
                                      tok.eos_token_id)
    assert tok.decode(direct) == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_episodes_no_step_rewarded_get_the_terminal_call_or_the_default(tok):
    from types import SimpleNamespace

    renderer = ChatRenderer(tok, [], [tok.eos_token_id])
    eos = tok.eos_token
    # Episode 0 ends after two answered turns (stop), episode 1's first turn is cut by the budget, so
    # step is never called: both get final_reward, 0.25 per assistant message (2 and 1).
    turns = [[f"one{eos}", f"two{eos}"], ["no end of turn here"]]
    eps = _scripted(tok, renderer, turns, env_name="test_graded_at_the_end")
    assert [e.finish_reason for e in eps] == ["stop", "length"]
    assert [e.env_reward for e in eps] == [0.5, 0.25]
    assert [e.env_reward_source for e in eps] == ["final", "final"]
    # The environment gives nothing at the end either: the configured default, recorded as such.
    eps = _scripted(tok, renderer, [[f"one{eos}", f"two{eos}"], ["cut"]], env_name="test_silent_too",
                    default_reward=-1.0)
    assert [e.env_reward for e in eps] == [-1.0, -1.0] and [e.env_reward_source for e in eps] == ["default"] * 2
    # Neither: null, which the env scorer refuses naming the row (test_env_reward); rewarded steps win.
    eps = _scripted(tok, renderer, [["cut"]], env_name="test_silent_too")
    assert eps[0].env_reward is None and eps[0].env_reward_source is None
    prompts = [SimpleNamespace(prompt_id="0", ground_truth="1", data_source="d", extra_info={})]
    table = multi_turn_table(0, prompts, eps, ["x"], n=1, policy_version=0)
    assert table.column("env_reward_source").to_pylist() == [None]


def test_errors_turns_and_budgets(tok):
    renderer = ChatRenderer(tok, [BUILTIN_TOOLS["calculator"].schema()], [tok.eos_token_id])
    eos = tok.eos_token
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 **"}}</tool_call>'
    eps = _scripted(tok, renderer, [
        [f"{bad}{eos}", f"{CALL}{eos}", f"{CALL}{eos}"],           # 3 turns, still calling: max_turns
        ["<tool_call>{oops</tool_call>" + eos, f"Answer: 1{eos}"],  # malformed, then stops
        ["no end of turn here"],                                     # no EOS: cut, length
    ])
    assert [e.finish_reason for e in eps] == ["max_turns", "stop", "length"]
    assert [e.num_turns for e in eps] == [3, 2, 1]
    assert eps[0].tool_calls[0]["error"].startswith("exception: ValueError: cannot parse")
    assert eps[0].tool_calls[0]["result"].startswith("Error: exception:")
    assert eps[1].tool_calls[0]["error"].startswith("malformed:") and eps[1].tool_calls[0]["name"] == ""
    # The last turn's tool result is recorded but its tokens are not appended (nothing would answer them).
    assert eps[0].loss_mask[-1] == 1 and eps[0].messages[-1]["role"] == "tool"

    from types import SimpleNamespace
    prompts = [SimpleNamespace(prompt_id=str(k), ground_truth="1", data_source="d", extra_info={}) for k in range(3)]
    table = multi_turn_table(0, prompts, eps, ["x"] * 3, n=1, policy_version=0)
    m = multi_turn_metrics(table)
    # calls: 3 (episode 0) + 1 (episode 1); errors: the bad expression and the malformed call.
    assert m["tool/calls"] == 4 and m["tool/errors"] == 2 and m["tool/timeouts"] == 0
    # Episode 0 made well-formed calls (the bad expression parsed; the tool raised); episode 1's only
    # call was malformed; episode 2 made none: 1 of 3.
    assert m["tool/well_formed_frac"] == pytest.approx(1 / 3)
    assert m["num_turns/mean"] == pytest.approx(2.0) and m["num_turns/max"] == 3
    assert table.schema.field("loss_mask").type.value_type.bit_width == 8

    # Total budget: an observation that does not fit ends the episode with `length`, before it is appended.
    t1 = len(tok(f"{CALL}{eos}", add_special_tokens=False)["input_ids"])
    (ep,) = _scripted(tok, renderer, [[f"{CALL}{eos}", f"Answer: 7006652{eos}"]],
                      limits=EpisodeLimits(total_tokens=t1 + 5, max_assistant_turns=3, max_user_turns=3))
    assert ep.finish_reason == "length" and len(ep.response_ids) == t1 and ep.num_turns == 1
    # max_user_turns=0: no observation may be appended.
    (ep,) = _scripted(tok, renderer, [[f"{CALL}{eos}"]],
                      limits=EpisodeLimits(total_tokens=512, max_assistant_turns=3, max_user_turns=0))
    assert ep.finish_reason == "max_turns" and ep.num_turns == 1


def test_hf_engine_episodes_keep_sampled_tokens_and_logprobs(tiny_model_dir, tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eos = tok.eos_token_id
    bias = torch.zeros(len(tok))
    bias[eos] = 9.0  # the random tiny model ends a turn after a few tokens instead of never
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    engine = HFRolloutEngine(model, tok.pad_token_id, [eos], micro_batch_size=8)
    renderer = ChatRenderer(tok, [], [eos])
    envs = [make_environment("test_go_on", EnvContext([], None)) for _ in range(4)]
    rows = [{**ROW, "messages": [{"role": "user", "content": f"Say {k}."}]} for k in range(4)]
    eps = run_episodes(engine, renderer, envs, rows, SamplingParams(temperature=1.0, seed=3),
                       EpisodeLimits(total_tokens=96, turn_tokens=24, max_assistant_turns=3, max_user_turns=3), [eos])
    obs = tok("\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    multi = 0
    for ep in eps:
        assert ep.finish_reason in ("max_turns", "length")
        assert len(ep.response_ids) == len(ep.loss_mask) == len(ep.rollout_logprobs) <= 96
        spans = list(zip(ep.turn_spans[::2], ep.turn_spans[1::2]))
        multi += len(spans) > 1
        for (a, b), nxt in zip(spans, spans[1:] + [(len(ep.response_ids), None)]):
            assert ep.loss_mask[a:b] == [1] * (b - a) and b - a <= 24
            assert ep.response_ids[b:nxt[0]] == (obs if nxt[1] is not None else [])
            assert ep.loss_mask[b:nxt[0]] == [0] * (nxt[0] - b)
        # Teacher-forced log-probs of the whole sequence equal the sampler's at the generated tokens.
        ids = torch.tensor([ep.prompt_ids + ep.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        tf = logp.gather(-1, ids[0, 1:, None])[:, 0][len(ep.prompt_ids) - 1:]
        mask = torch.tensor(ep.loss_mask, dtype=torch.bool)
        assert torch.allclose(tf[mask], torch.tensor(ep.rollout_logprobs)[mask], atol=1e-4)
        assert all(lp == 0.0 for lp, m in zip(ep.rollout_logprobs, ep.loss_mask) if m == 0)
    assert multi >= 2  # the check covered tokens after an observation


def test_templates_with_tools_and_without_the_prefix_property(tiny_model_dir):
    from transformers import AutoTokenizer

    from trajflow.envs.render import TemplatePrefixError

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # A template that takes tools= (as Qwen's and Hermes' do) gets the schemas, not the plain block.
    tok.chat_template = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};"
                         "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% endif %}")
    r = ChatRenderer(tok, [BUILTIN_TOOLS["calculator"].schema(), BUILTIN_TOOLS["python"].schema()], [tok.eos_token_id])
    assert r.native_tools
    text = tok.decode(r.prompt_ids([{"role": "user", "content": "hi"}]))
    assert text == "<|im_start|>system\nTOOLS:calculator;python;<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    # A template whose header counts the messages re-renders earlier text: refused, not guessed at.
    tok.chat_template = ("{{ messages|length }} messages\n{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    r = ChatRenderer(tok, [], [tok.eos_token_id])
    with pytest.raises(TemplatePrefixError, match="prefix|extension"):
        r.observation_ids([{"role": "user", "content": "hi"}], [{"role": "user", "content": "go on"}], True)


class LongReset(GoOn):
    """Its reset turns every dataset prompt into a 40-word prompt (a system message added)."""

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "system", "content": " ".join(["word"] * 40)}, *row["messages"]]


def test_prompt_from_reset_over_max_prompt_length_names_row_length_and_key(tok):
    renderer = ChatRenderer(tok, [], [tok.eos_token_id])
    rows = [{**ROW, "prompt_id": "p0"}, {**ROW, "prompt_id": "p1", "messages": [{"role": "user", "content": "x"}]}]
    cap = len(renderer.prompt_ids(rows[0]["messages"]))  # row 0 fits exactly
    n_long = len(renderer.prompt_ids(LongReset().reset(rows[1])))
    assert n_long > cap >= len(renderer.prompt_ids(rows[1]["messages"]))
    engine = Scripted(tok, [])
    limits = EpisodeLimits(total_tokens=16, max_assistant_turns=1, max_user_turns=1)
    with pytest.raises(ValueError) as e:
        run_episodes(engine, renderer, [GoOn(), LongReset()], rows, SamplingParams(), limits, [tok.eos_token_id],
                     max_prompt_length=cap)
    assert str(e.value).startswith(f"prompt row 1 (prompt_id 'p1'): the environment's reset gave a prompt of "
                                   f"{n_long} tokens, more than data.max_prompt_length={cap}")
    assert engine.calls == 0  # checked before anything is generated
