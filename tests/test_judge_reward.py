"""``reward.judge``: an LLM judge behind a real OpenAI-compatible endpoint (trajflow's own, serving a
tiny model whose greedy verdict is known from a plain transformers forward), called with the real
``openai`` client: verdicts parsed and mapped, failures (unparseable replies, a dead port, a server
that never answers) counted and scored ``error_score`` with the row's error, never silent zeros; a
run folder's judge URL and key variable are not used unless named again."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.mt_envs import make_digit_judge, make_eos_model
from trajflow.config import load_config
from trajflow.config.judge import DEFAULT_JUDGE_TEMPLATE
from trajflow.errors import ConfigError
from trajflow.stages.judge import (VerdictError, combine, judge_api_key, judge_metrics, judge_prompt, judge_scores,
                                   parse_verdict)

QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
# (response, ground truth): chosen so the digit judge says 7 for some and 2 for others.
ROWS = [("5", "5"), ("3579", "5"), ("6", "5"), ("Answer: 13579", "13"), ("hello", "4"), ("1 3 5 7 9 1", "5")]


@pytest.mark.parametrize("text,lo,hi,want", [
    ("Score: 7", 0, 10, 0.7), ("The answer is right.\n**Score:** 8/10", 0, 10, 0.8), ("rating = 3", 1, 5, 0.5),
    ("7", 0, 10, 0.7), ("  9.  ", 0, 10, 0.9), ("Grade: 3 out of 4", 0, 10, 0.75),
    ("score 2 at first, then Score: 10", 0, 10, 1.0), ("Verdict: 0", 0, 10, 0.0), ("7/10", 0, 10, 0.7)])
def test_parse_verdict_reads_the_last_score(text, lo, hi, want):
    assert parse_verdict(text, lo, hi) == pytest.approx(want)


@pytest.mark.parametrize("text", ["", "The answer is correct.", "Score: 11", "Score: -1", "12 out of 10", "2 and 3"])
def test_parse_verdict_refuses_what_has_no_score_in_range(text):
    with pytest.raises(VerdictError):
        parse_verdict(text, 0, 10)


def test_judge_prompt_fills_the_placeholders():
    t = "Q={question}|P={prompt}|R={response}|G={ground_truth}|{{literal}}"
    assert judge_prompt(t, QUESTION, "5", 5) == \
        "Q=What is 2 + 3?|P=system: Be brief.\nuser: What is 2 + 3?|R=5|G=5|{literal}"
    assert judge_prompt(t, "plain prompt", None, None) == "Q=plain prompt|P=plain prompt|R=|G=|{literal}"


def test_config_rules_and_the_api_key_variable(monkeypatch):
    with pytest.raises(ConfigError, match="reward.judge.base_url"):
        load_config(None, ["reward.judge.enable=true"])
    with pytest.raises(ConfigError, match=r"uses \{answer\}"):
        load_config(None, ["reward.judge.enable=true", "reward.judge.base_url=http://127.0.0.1:9/v1",
                           "reward.judge.prompt_template=rate {answer}"])
    with pytest.raises(ConfigError, match="score_max"):
        load_config(None, ["reward.judge.enable=true", "reward.judge.base_url=http://127.0.0.1:9/v1",
                           "reward.judge.score_max=0"])
    # A judge trajflow serves: model_path instead of base_url, exactly one, with its own token.
    with pytest.raises(ConfigError, match="name one"):
        load_config(None, ["reward.judge.enable=true", "reward.judge.base_url=http://127.0.0.1:9/v1",
                           "reward.judge.model_path=smollm2-135m-instruct"])
    with pytest.raises(ConfigError, match="its own per-run token"):
        load_config(None, ["reward.judge.enable=true", "reward.judge.model_path=smollm2-135m-instruct",
                           "reward.judge.api_key_env=TRAJFLOW_TEST_JUDGE_KEY"])
    assert load_config(None, ["reward.judge.enable=true", "reward.judge.model_path=smollm2-135m-instruct"]
                       ).reward.judge.model_path == "smollm2-135m-instruct"
    assert judge_api_key({"api_key_env": None}) == "EMPTY"
    monkeypatch.delenv("TRAJFLOW_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="TRAJFLOW_TEST_JUDGE_KEY"):
        judge_api_key({"api_key_env": "TRAJFLOW_TEST_JUDGE_KEY"})
    monkeypatch.setenv("TRAJFLOW_TEST_JUDGE_KEY", "s3cret")
    assert judge_api_key({"api_key_env": "TRAJFLOW_TEST_JUDGE_KEY"}) == "s3cret"


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    from trajflow.serve.standalone import ModelServer

    d = make_digit_judge(tmp_path_factory.mktemp("digit-judge"))
    s = ModelServer(str(d), token="judge-token", max_new_tokens=16).start()
    yield s, d
    s.stop()


def _cfg(base_url: str, **kw) -> dict:
    cfg = load_config(None, ["reward.judge.enable=true", f"reward.judge.base_url={base_url}",
                             "reward.judge.api_key_env=TRAJFLOW_TEST_JUDGE_KEY", "reward.judge.max_tokens=1"])
    out = dict(cfg.reward.judge)
    out.update(kw)
    return out


def _expected_verdicts(model_dir: Path, template: str) -> list[float]:
    """The digit judge's greedy first token for each row, by a plain transformers forward, as a score."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for response, truth in ROWS:
        text = template.format(question="What is 2 + 3?", prompt="", response=response, ground_truth=truth)
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            digit = tok.decode([int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())])
        out.append(int(digit) / 10)
    return out


def test_served_judge_scores_with_the_real_client(judge_server, monkeypatch):
    server, model_dir = judge_server
    monkeypatch.setenv("TRAJFLOW_TEST_JUDGE_KEY", "judge-token")
    cfg = _cfg(server.base_url)
    want = _expected_verdicts(model_dir, DEFAULT_JUDGE_TEMPLATE)
    assert set(want) == {0.2, 0.7}  # both verdicts occur: the scores depend on what is judged
    prompts, responses, truths = [QUESTION] * len(ROWS), [r for r, _ in ROWS], [g for _, g in ROWS]
    first = judge_scores(cfg, prompts, responses, truths)
    assert first.errors == [None] * len(ROWS)
    assert first.scores.tolist() == pytest.approx(want)
    assert first.replies == [str(int(w * 10)) for w in want]
    again = judge_scores(cfg, prompts, responses, truths)  # temperature 0: the same verdicts
    assert again.scores.tolist() == first.scores.tolist()
    # Combined with rule scores: rule_weight * rule + weight * judge, extras per row.
    rule = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0], np.float32)
    score, extras = combine(rule, [{"acc": 1.0}] * len(ROWS), first, dict(cfg, rule_weight=0.5, weight=2.0))
    assert score.tolist() == pytest.approx([0.5 * r + 2.0 * w for r, w in zip(rule, want)])
    assert [e["judge_score"] for e in extras] == pytest.approx(want) and all(e["acc"] == 1.0 for e in extras)
    assert judge_metrics(extras) == {"reward/judge_error_frac": 0.0, "reward/judge_score/mean": pytest.approx(np.mean(want))}


def test_failed_judgements_are_counted_and_scored_error_score(judge_server, monkeypatch, tmp_path):
    server, _ = judge_server
    monkeypatch.setenv("TRAJFLOW_TEST_JUDGE_KEY", "judge-token")
    prompts, responses, truths = [QUESTION] * 3, ["5", "6", "7"], ["5", "5", "5"]
    # A judge asked for a score between 0 and 1 answers 2 or 7: out of range, every row fails.
    r = judge_scores(_cfg(server.base_url, score_max=1.0, error_score=-1.0), prompts, responses, truths)
    assert r.scores.tolist() == [-1.0] * 3
    assert all(e.startswith("judge: score ") and "outside [0, 1]" in e for e in r.errors)
    # A wrong key: HTTP 401, not retried, one line per row.
    monkeypatch.setenv("TRAJFLOW_TEST_JUDGE_KEY", "wrong")
    r = judge_scores(_cfg(server.base_url), prompts, responses, truths)
    assert all(e.startswith("judge: AuthenticationError") for e in r.errors)
    monkeypatch.setenv("TRAJFLOW_TEST_JUDGE_KEY", "judge-token")
    # Nobody listening: the client's retries, then a connection error.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    r = judge_scores(_cfg(f"http://127.0.0.1:{dead}/v1", max_retries=1), prompts[:1], responses[:1], truths[:1])
    assert r.errors[0].startswith("judge: APIConnectionError") and r.scores.tolist() == [0.0]
    # A server that accepts and never answers: the per-request timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        r = judge_scores(_cfg(f"http://127.0.0.1:{port}/v1", timeout_s=0.5, max_retries=1), prompts[:2],
                         responses[:2], truths[:2])
    assert all(e.startswith("judge: APITimeoutError") for e in r.errors)
    # Two rows judged, one failed: half the rows count as judge errors; the failed row carries the error.
    ok = judge_scores(_cfg(server.base_url), prompts[:1], responses[:1], truths[:1])
    score, extras = combine(np.zeros(2, np.float32), [{}, {"error": "scorer broke"}],
                            type(ok)(np.concatenate([ok.scores, r.scores[:1]]), [None, r.errors[0]], ["2", None]),
                            {"rule_weight": 0.0, "weight": 1.0})
    assert extras[1]["error"] == "scorer broke" and extras[1]["judge_error"].startswith("judge: APITimeoutError")
    assert judge_metrics(extras)["reward/judge_error_frac"] == 0.5


def test_an_unparseable_judge_is_asked_again_only_when_sampling(tmp_path, monkeypatch):
    """The EOS-prone tiny model answers random tokens: no score. Greedy: one request per row; sampled:
    1 + max_retries requests per row, then the row's error."""
    from trajflow.serve.standalone import ModelServer

    d = make_eos_model(tmp_path / "eos")
    s = ModelServer(str(d), token="t", max_new_tokens=8).start()
    monkeypatch.setenv("TRAJFLOW_TEST_JUDGE_KEY", "t")
    try:
        calls = []
        real = s.server.chat
        s.server.chat = lambda sid, body: calls.append(1) or real(sid, body)
        r = judge_scores(_cfg(s.base_url, max_tokens=4), [QUESTION] * 2, ["5", "6"], ["5", "5"])
        assert len(calls) == 2 and all(e.startswith("judge: no score in the judge's reply") for e in r.errors)
        calls.clear()
        r = judge_scores(_cfg(s.base_url, max_tokens=4, temperature=1.0, max_retries=2), [QUESTION] * 2,
                         ["5", "6"], ["5", "5"])
        assert len(calls) == 6 and all(e is not None for e in r.errors)
    finally:
        s.stop()


def _check_flow_scores(summary: dict, judge_dir: Path) -> list[float]:
    """The stored scores of the run's iteration 1 are the judge's verdicts on the stored prompts and
    responses, recomputed by a plain forward of the judge model; returns them."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trajflow.batch import decode_nested

    m = summary["metrics"]
    assert m["reward/judge_error_frac"] == 0.0
    it = Path(summary["run_dir"]) / "iterations" / "000001"
    rollout = pq.read_table(it / "rollout.parquet").to_pylist()
    reward = {r["sample_id"]: r for r in pq.read_table(it / "reward.parquet").to_pylist()}
    tok = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    want = []
    for row in rollout:
        text = judge_prompt(DEFAULT_JUDGE_TEMPLATE, decode_nested(row["prompt"]), row["response_text"],
                            row["ground_truth"])
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            want.append(int(tok.decode([int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())])) / 10)
        assert reward[row["sample_id"]]["reward_error"] is None
    assert [reward[r["sample_id"]]["score"] for r in rollout] == pytest.approx(want)
    assert m["reward/judge_score/mean"] == pytest.approx(np.mean(want))
    return want


@pytest.mark.usefixtures("ray_local")
def test_the_judge_scores_a_training_iteration(judge_server, tiny_model_dir, tmp_path, monkeypatch):
    """Through the real flow (Prefect, Ray, MLflow on SQLite): the stored scores are the judge's verdicts
    on the stored prompts and responses, recomputed here by a plain forward of the judge model."""
    from tests.conftest import tiny_overrides
    from trajflow.flows.train import train

    server, judge_dir = judge_server
    monkeypatch.setenv("TRAJFLOW_TEST_JUDGE_KEY", "judge-token")
    over = tiny_overrides(tiny_model_dir, tmp_path / "runs", **{
        "trainer.total_iterations": 1, "trainer.test_freq": 0, "trainer.save_freq": 0, "trainer.log_samples": 0,
        "reward.judge.enable": True, "reward.judge.base_url": server.base_url, "reward.judge.max_tokens": 1,
        "reward.judge.api_key_env": "TRAJFLOW_TEST_JUDGE_KEY", "gates.enabled": True})
    _check_flow_scores(train(None, over), judge_dir)


@pytest.mark.usefixtures("ray_local")
def test_trajflow_serves_the_judge_model_itself(judge_server, tiny_model_dir, tmp_path, monkeypatch):
    """``reward.judge.model_path``: the run starts the judge model as a Ray actor serving the endpoint on
    loopback with its own token, scores through it (the stored scores are the verdicts recomputed by
    hand) and stops it when the run ends."""
    import openai

    from tests.conftest import tiny_overrides
    from trajflow.flows.train import train
    from trajflow.run import workers

    served = []
    real_finish = workers.finish_judge_worker

    def finish_and_probe(ctx):  # the real call, then what the served endpoint admits
        real_finish(ctx)
        url, token = ctx.judge_endpoint
        assert url.startswith("http://127.0.0.1:") and len(token) >= 32
        with pytest.raises(openai.AuthenticationError):  # no call without the run's token
            openai.OpenAI(base_url=url, api_key="guess", max_retries=0).models.list()
        served.append(url)

    monkeypatch.setattr(workers, "finish_judge_worker", finish_and_probe)
    _, judge_dir = judge_server  # only the model directory: trajflow serves it
    over = tiny_overrides(tiny_model_dir, tmp_path / "runs", **{
        "trainer.total_iterations": 1, "trainer.test_freq": 0, "trainer.save_freq": 0, "trainer.log_samples": 0,
        "reward.judge.enable": True, "reward.judge.model_path": str(judge_dir), "reward.judge.max_tokens": 1})
    _check_flow_scores(train(None, over), judge_dir)
    assert len(served) == 1  # one judge for the whole run
    with pytest.raises(openai.APIConnectionError):  # torn down at the run's end
        openai.OpenAI(base_url=served[0], api_key="x", max_retries=0, timeout=5).models.list()
