"""A scripted tool environment and an EOS-prone tiny model, for multi-turn runs through the real flow.

The random tiny model cannot write tool calls, so :class:`ScriptedCalls` makes them itself: whatever
the assistant says, turn 1 runs ``calculator`` on ``1234 * 5678`` and turn 2 calls an unknown tool,
both in the real sandbox; turn 3 ends the episode. :class:`RewardedTurns` returns known rewards,
:class:`Unrewarded` none.
"""

from __future__ import annotations

from pathlib import Path

from trajflow.envs.registry import EnvContext, Environment, StepResult, ToolEnvironment
from trajflow.envs.sandbox import ToolCall
from trajflow.envs.tools import BUILTIN_TOOLS


class ScriptedCalls(ToolEnvironment):
    def __init__(self, ctx: EnvContext) -> None:
        super().__init__(ctx, default_tools=[BUILTIN_TOOLS["calculator"]])
        self.turn = 0

    def step(self, message: dict) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            calls = [ToolCall("calculator", {"expression": "1234 * 5678"}, "")]
        elif self.turn == 2:
            calls = [ToolCall("search", {"q": "x"}, "")]
        else:
            return StepResult(done=True)
        results = self.sandbox.run(calls)
        return StepResult(observations=[{"role": "tool", "content": r.result} for r in results], tool_calls=results)


def scripted_calls(ctx: EnvContext) -> ScriptedCalls:
    return ScriptedCalls(ctx)


class RewardedTurns(Environment):
    """Rewards every assistant message: the k-th (1-based) gets ``0.5 * k + 0.01 * len(content)``; the
    second ends the episode. ``env_reward`` is the last one given, so a test can compute it by hand from
    the stored ``messages``."""

    def __init__(self) -> None:
        self.turn = 0

    def step(self, message: dict) -> StepResult:
        self.turn += 1
        reward = 0.5 * self.turn + 0.01 * len(message["content"])
        if self.turn >= 2:
            return StepResult(done=True, reward=reward)
        return StepResult(observations=[{"role": "user", "content": "go on"}], reward=reward)


def rewarded_turns(ctx: EnvContext) -> RewardedTurns:
    return RewardedTurns()


def rewarded_turns_expected(row: dict) -> float:
    """:class:`RewardedTurns`'s reward of a stored rollout row, from its messages: the last assistant
    message that the environment answered (all of them when the episode stopped; the last one was
    cut by a budget otherwise)."""
    said = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    answered = said if row["finish_reason"] == "stop" else said[:-1]
    return 0.5 * len(answered) + 0.01 * len(answered[-1])


class Unrewarded(Environment):
    """Ends every episode after one message without a reward (``env_reward`` null)."""

    def step(self, message: dict) -> StepResult:
        return StepResult(done=True)


def unrewarded(ctx: EnvContext) -> Unrewarded:
    return Unrewarded()


def make_eos_model(out: Path, eos_logit_scale: float = 1.7) -> Path:
    """The tiny model (tests.conftest.make_tiny_model) changed so that every token is followed by EOS with
    probability ~0.2 and by a uniformly drawn token otherwise: turns of a few tokens that end.

    The residual stream is just the token embedding (attention and MLP outputs zeroed), whose
    dimension 0 is a constant 4, and the untied head reads only that dimension into the EOS logit.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import make_tiny_model

    make_tiny_model(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 4.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False)
        head.weight.zero_()
        head.weight[model.config.eos_token_id, 0] = eos_logit_scale
        model.lm_head = head
    model.save_pretrained(out)
    return out


def make_digit_judge(out: Path, high: str = "7", low: str = "2") -> Path:
    """A tiny judge whose greedy reply is digits that depend on the conversation: roughly, ``high``
    where the context holds more odd digits than even ones, else ``low``.

    Embedding dimension 1 is +1 on the tokens of odd digits, -1 on even ones, 0 elsewhere; layer 0's
    attention is uniform over the context (query and key weights zero) and carries that dimension
    (after the layer's norm) into the residual's dimension 0 (whose own embedding is zero);
    everything else in the blocks is zeroed. The final norm keeps only dimension 0 and the untied head maps it
    to +50 on ``high``'s logit and -50 on ``low``'s, 0 elsewhere.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import make_tiny_model

    make_tiny_model(out, seed=3)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        hidden = emb.shape[1]
        emb[:, 0] = 0.0
        emb[:, 1] = 0.0
        for d in range(10):
            emb[tok.convert_tokens_to_ids(str(d)), 1] = 1.0 if d % 2 else -1.0
        for i, layer in enumerate(model.model.layers):
            layer.mlp.down_proj.weight.zero_()
            layer.self_attn.o_proj.weight.zero_()
            if i == 0:
                layer.self_attn.q_proj.weight.zero_()
                layer.self_attn.k_proj.weight.zero_()
                layer.self_attn.v_proj.weight.zero_()
                layer.self_attn.v_proj.weight[0, 1] = 1.0
                layer.self_attn.o_proj.weight[0, 0] = 10.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        head = torch.nn.Linear(hidden, model.config.vocab_size, bias=False)
        head.weight.zero_()
        head.weight[tok.convert_tokens_to_ids(high), 0] = 50.0
        head.weight[tok.convert_tokens_to_ids(low), 0] = -50.0
        model.lm_head = head
    model.save_pretrained(out)
    return out
