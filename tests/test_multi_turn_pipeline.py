"""Multi-turn rows through the stored pipeline on a real local Ray and Prefect (MLflow on SQLite).

A 1-iteration run with the tiny model gives a parent run; its rollout is replaced by multi-turn
episodes written by hand (a tool call, the tool's answer, a final answer) following the rollout row
contract, and ``replay --from-stage reward`` runs the reward, gate, advantage and update stages on them
through the same Prefect tasks and Ray workers as training. The stored rewards, advantages and the
update's metrics are then checked against values computed by hand over the generated tokens only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import tiny_overrides
from tests.multi_turn_rows import episode, multi_turn_columns
from trajflow.batch import decode_nested
from trajflow.store import RunStore

pytestmark = pytest.mark.timeout(900)


def logprobs_and_entropy(model, prompt_ids, response_ids, temperature):
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.fixture(scope="module")
def replayed(tiny_model_dir, ray_local, tmp_path_factory):
    from trajflow.flows.replay import replay
    from trajflow.flows.train import train

    root = tmp_path_factory.mktemp("store")
    parent = train(None, tiny_overrides(tiny_model_dir, root, **{
        "trainer.total_iterations": 1, "gates.enabled": True, "rollout.max_new_tokens": 32}))
    store = RunStore(root, parent["run_id"])
    cfg = store.read_config()
    stored = store.read_stage(1, "rollout")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    eps = []
    for k, (messages, gt) in enumerate(zip(stored.column("prompt").to_pylist(), stored.column("ground_truth").to_pylist())):
        final = f"Answer: {gt}" if k % 2 == 0 else "Answer: -1"  # one right and one wrong answer per prompt
        # Row 2 ran out of turns: its response ends inside an observation, after the right answer.
        eps.append(episode(tok, decode_nested(messages), [(f"calc {k}", "7"), (final, "out of turns" if k == 2 else None)]))
    assert [e["prompt_ids"] for e in eps] == stored.column("prompt_ids").to_pylist()  # rendered the same way
    with torch.no_grad():
        old = [logprobs_and_entropy(model, e["prompt_ids"], e["response_ids"], cfg.rollout.temperature)[0].tolist()
               for e in eps]
    cols = multi_turn_columns(eps, old)
    table = stored.drop_columns([c for c in ("rollout_logprobs",) if c in stored.column_names])
    for name, col in cols.items():
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, col)
        else:
            table = table.append_column(name, col)
    table = table.set_column(table.column_names.index("finish_reason"), "finish_reason",
                             pa.array(["max_turns" if k == 2 else "stop" for k in range(table.num_rows)], pa.string()))
    entry = store.stage_entry(1, "rollout")
    store.write_stage(1, "rollout", table, policy_version=0, inputs=entry["inputs"], meta=entry["meta"])
    # A generation budget every episode keeps to, though tool output makes some responses longer: the
    # gate (response_length_max, a failing check) must measure generated tokens, not the whole response.
    budget = max(sum(e["loss_mask"]) for e in eps)
    assert max(len(e["loss_mask"]) for e in eps) > budget
    summary = replay(parent["run_id"], "reward", iteration=1,
                     overrides=[f"store.root={root}", f"rollout.max_new_tokens={budget}"])
    d = Path(summary["run_dir"]) / "iterations" / "000001"
    return {"eps": eps, "cfg": cfg, "model": model, "dir": d, "rollout": table,
            "reward": pq.read_table(d / "reward.parquet"), "advantage": pq.read_table(d / "advantage.parquet"),
            "update": json.loads((d / "update.json").read_text())}


def test_stored_rollout_keeps_the_multi_turn_columns(replayed):
    rollout = pq.read_table(replayed["dir"] / "rollout.parquet")
    assert rollout.equals(replayed["rollout"])
    assert rollout.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert rollout.column("num_turns").to_pylist() == [2, 2, 2, 2]
    assert replayed["eps"][2]["loss_mask"][-1] == 0  # ends inside an observation


def test_outcome_reward_is_on_the_last_generated_token(replayed):
    scores = replayed["reward"].column("score").to_pylist()
    assert scores[0] > scores[1] and scores[2] > scores[3]
    for e, s, tr in zip(replayed["eps"], scores, replayed["reward"].column("token_rewards").to_pylist()):
        last = max(i for i, m in enumerate(e["loss_mask"]) if m)
        assert tr == pytest.approx([s if i == last else 0.0 for i in range(len(tr))])


def test_grpo_advantages_cover_generated_tokens_only(replayed):
    scores = np.array(replayed["reward"].column("score").to_pylist(), np.float64)
    groups = replayed["rollout"].column("group_id").to_pylist()
    for e, s, g, adv in zip(replayed["eps"], scores, groups, replayed["advantage"].column("advantages").to_pylist()):
        same = scores[[gg == g for gg in groups]]
        a = (s - same.mean()) / (same.std(ddof=1) + 1e-6)
        assert adv == pytest.approx([a if m else 0.0 for m in e["loss_mask"]], abs=1e-5)


def test_update_equals_the_hand_loss_over_generated_tokens(replayed):
    # One on-policy optimizer step (4 rows = ppo_mini_batch_size * n), token-mean: the PPO ratio is 1,
    # so pg_loss = -sum_t A_t m_t / N and its gradient is that of -sum_t A_t m_t log pi(y_t) / N,
    # N = the number of generated tokens in the batch.
    eps, model, upd = replayed["eps"], replayed["model"], replayed["update"]
    temperature = replayed["cfg"].rollout.temperature
    advs = replayed["advantage"].column("advantages").to_pylist()
    masks = [torch.tensor(e["loss_mask"], dtype=torch.float64) for e in eps]
    n = sum(float(m.sum()) for m in masks)
    model.zero_grad(set_to_none=True)
    pg, ent = 0.0, 0.0
    for e, a, m in zip(eps, advs, masks):
        logp, entropy = logprobs_and_entropy(model, e["prompt_ids"], e["response_ids"], temperature)
        a = torch.tensor(a, dtype=torch.float64)
        (-(a * m * logp.double()).sum() / n).backward()
        pg += float(-(a * m).sum()) / n
        ent += float((entropy.detach().double() * m).sum()) / n
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    assert upd["actor/pg_loss"] == pytest.approx(pg, abs=1e-6)
    assert upd["actor/entropy"] == pytest.approx(ent, rel=1e-4)
    assert upd["actor/grad_norm"] == pytest.approx(norm, rel=1e-3)
    assert upd["actor/rollout_logprob_diff"] < 1e-4
    assert upd["response_length_trainable/mean"] == pytest.approx(np.mean([sum(e["loss_mask"]) for e in eps]))
    assert upd["response_length/mean"] == pytest.approx(np.mean([len(e["loss_mask"]) for e in eps]))
