"""Prompt dataset specs, loaders and the epoch sampler."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajflow.prompts import (
    DATASETS_DIR,
    DataError,
    PromptRecord,
    PromptSampler,
    load_prompt_dataset,
    load_spec,
)


def _eval_question(q: str) -> int:
    """Independent check: 'Calculate a op b.' -> a op b."""
    a, op, b = q.removeprefix("Calculate ").removesuffix(".").split()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


# --------------------------------------------------------------------------------------------- reasoning-gym specs


@pytest.fixture(scope="module")
def default_data():
    return load_prompt_dataset("basic_arithmetic")


def test_default_dataset_settings(default_data):
    spec = default_data.spec
    assert spec["generator"] == "basic_arithmetic" and spec["source"] == "reasoning_gym"
    assert spec["config"] == {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2,
                              "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False,
                              "format_style": "simple", "whitespace": "single"}
    assert len(default_data.train) == 2000
    assert len(default_data.validation) == 256


def test_default_dataset_prompts(default_data):
    rec = default_data.train[0]
    assert isinstance(rec, PromptRecord)
    assert rec.data_source == "reasoning_gym/basic_arithmetic"
    roles = [m["role"] for m in rec.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert "Answer: <answer>" in rec.messages[0]["content"]
    assert rec.messages[1]["content"] == "Calculate 3 + 5."
    assert rec.messages[2]["content"] == "3 + 5 = 8\nAnswer: 8"
    for r in default_data.train[:200] + default_data.validation:
        q = r.messages[-1]["content"]
        assert q == r.extra_info["question"]
        assert str(_eval_question(q)) == r.ground_truth
        a, _, b = q.removeprefix("Calculate ").removesuffix(".").split()
        assert 0 <= int(a) <= 100 and 0 <= int(b) <= 100
        json.dumps(r.extra_info)  # JSON-serialisable
    ids = [r.prompt_id for r in default_data.train + default_data.validation]
    assert len(set(ids)) == len(ids)


def test_held_out_problems_are_disjoint_and_distinct(default_data):
    val_q = [r.messages[-1]["content"] for r in default_data.validation]
    train_q = {r.messages[-1]["content"] for r in default_data.train}
    assert len(set(val_q)) == 256
    assert not set(val_q) & train_q


def test_small_problem_space_still_holds_out_problems():
    # 1-digit operands: randint(0, 10) each, 11 * 11 * 2 = 242 problems; 600 rows must repeat problems.
    data = load_prompt_dataset("basic_arithmetic", {"size": 600, "config.min_digits": 1, "config.max_digits": 1,
                                                    "split": {"validation_size": 40}})
    train_q = Counter(r.messages[-1]["content"] for r in data.train)
    val_q = [r.messages[-1]["content"] for r in data.validation]
    assert len(data.train) == 600 and max(train_q.values()) > 1
    assert len(set(val_q)) == 40 and not set(val_q) & set(train_q)


def test_reasoning_gym_loading_is_deterministic():
    a = load_prompt_dataset("basic_arithmetic", {"size": 30, "split.validation_size": 5})
    b = load_prompt_dataset("basic_arithmetic", {"size": 30, "split.validation_size": 5})
    c = load_prompt_dataset("basic_arithmetic", {"size": 30, "split.validation_size": 5, "seed": 1})
    assert a.train == b.train and a.validation == b.validation
    assert [r.ground_truth for r in a.train] != [r.ground_truth for r in c.train] or \
        [r.messages for r in a.train] != [r.messages for r in c.train]


def test_too_large_holdout_is_an_error():
    with pytest.raises(DataError, match="validation_size"):
        load_prompt_dataset("basic_arithmetic", {"size": 10, "config.min_digits": 1, "config.max_digits": 1,
                                                 "split.validation_size": 5000})


def test_spec_errors_name_the_key(tmp_path):
    with pytest.raises(DataError, match="'sise'") as e:
        load_spec("basic_arithmetic", {"sise": 10})
    assert "size" in str(e.value)  # suggests the close match
    with pytest.raises(DataError, match="'holdout'"):
        load_spec("basic_arithmetic", {"split": {"holdout": 3}})
    with pytest.raises(DataError, match="generator"):
        load_prompt_dataset("basic_arithmetic", {"generator": "basic_arithmetics", "size": 3})
    with pytest.raises(DataError, match="config"):
        load_prompt_dataset("basic_arithmetic", {"config.no_such_option": 1, "size": 3})
    with pytest.raises(DataError, match="prompt_template"):
        load_spec("basic_arithmetic", {"prompt_template": "Solve: {problem}"})
    with pytest.raises(DataError, match="basic_arithmetic"):  # unknown name lists shipped specs
        load_spec("basic_arithmatic")
    with pytest.raises(DataError, match="math_verify"):  # lists the registered scorers
        load_spec("gsm8k_sample", {"scorer": "math_verfy"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: huggingface\n")
    with pytest.raises(DataError, match="source"):
        load_spec(str(bad))


def test_specs_are_found_by_name_and_path():
    assert (DATASETS_DIR / "basic_arithmetic.yaml").is_file()
    by_name = load_spec("basic_arithmetic")
    by_path = load_spec(str(DATASETS_DIR / "basic_arithmetic.yaml"))
    assert by_name == by_path and by_name["name"] == "basic_arithmetic"


# --------------------------------------------------------------------------------------------- file specs


def _row(i, question, answer, source="test/src"):
    return {"data_source": source,
            "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": i}}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _spec(tmp_path, name, body):
    p = tmp_path / f"{name}.yaml"
    p.write_text(body)
    return str(p)


def test_shipped_gsm8k_sample():
    data = load_prompt_dataset("gsm8k_sample")
    assert len(data.train) == 6 and len(data.validation) == 2
    assert data.spec["scorer"] == "math_verify"
    assert {r.data_source for r in data.train + data.validation} == {"openai/gsm8k"}
    train_q = {r.messages[-1]["content"] for r in data.train}
    val_q = {r.messages[-1]["content"] for r in data.validation}
    assert len(train_q | val_q) == 8 and not train_q & val_q
    assert sorted(int(r.ground_truth) for r in data.train + data.validation) == [12, 15, 16, 16, 26, 32, 38, 154]


def test_file_dataset_jsonl_and_parquet(tmp_path):
    rows = [_row(0, "1+1?", "2"), _row(1, "2+2?", 4), _row(2, "3+3?", "6")]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    pq.write_table(pa.Table.from_pylist([_row(9, "9+9?", "18")]), tmp_path / "val.parquet")
    spec = _spec(tmp_path, "mine", "source: file\npath: train.jsonl\nvalidation_path: val.parquet\n")
    data = load_prompt_dataset(spec)
    assert [r.ground_truth for r in data.train] == ["2", "4", "6"]  # numbers become strings
    assert data.train[1].messages == [{"role": "user", "content": "2+2?"}]
    assert data.train[0].data_source == "test/src"
    assert data.train[0].extra_info["index"] == 0
    assert [r.prompt_id for r in data.train] == ["mine:train:0", "mine:train:1", "mine:train:2"]
    assert len(data.validation) == 1 and data.validation[0].ground_truth == "18"
    assert data.validation[0].messages[-1]["content"] == "9+9?"

    # the same rows as Parquet for train, with a held-out split instead of a validation file
    rows[1]["reward_model"]["ground_truth"] = "4"  # a Parquet column has one type
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    spec2 = _spec(tmp_path, "mine2", "source: file\npath: train.parquet\nsplit: {validation_size: 1}\nseed: 3\n")
    data2 = load_prompt_dataset(spec2)
    assert len(data2.train) == 2 and len(data2.validation) == 1
    assert {r.ground_truth for r in data2.train + data2.validation} == {"2", "4", "6"}


@pytest.mark.parametrize(
    "bad_row, match",
    [
        ({"data_source": "s", "reward_model": {"ground_truth": "1"}}, "prompt"),
        ({"data_source": "s", "prompt": [], "reward_model": {"ground_truth": "1"}}, "prompt"),
        ({"data_source": "s", "prompt": [{"role": "user", "content": "q"}]}, "ground_truth"),
        ({"data_source": "s", "prompt": [{"role": "user", "content": "q"}], "reward_model": {"style": "rule"}},
         "ground_truth"),
    ],
)
def test_bad_jsonl_row_names_file_and_line(tmp_path, bad_row, match):
    path = tmp_path / "broken_rows.jsonl"
    # line 1: good, line 2: blank (skipped but counted), line 3: the bad row
    path.write_text(json.dumps(_row(0, "q", "1")) + "\n\n" + json.dumps(bad_row) + "\n")
    spec = _spec(tmp_path, "broken", "source: file\npath: broken_rows.jsonl\n")
    with pytest.raises(DataError, match=match) as e:
        load_prompt_dataset(spec)
    assert "broken_rows.jsonl" in str(e.value) and "line 3" in str(e.value)


@pytest.mark.parametrize("field", ["prompt", "ground_truth"])
def test_bad_parquet_row_names_file_and_row_index(tmp_path, field):
    rows = [_row(0, "q0", "1"), _row(1, "q1", "2"), _row(2, "q2", "3")]
    if field == "prompt":
        rows[2]["prompt"] = None
    else:
        rows[2]["reward_model"]["ground_truth"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "broken_rows.parquet")
    spec = _spec(tmp_path, "broken", "source: file\npath: broken_rows.parquet\n")
    with pytest.raises(DataError, match=field) as e:
        load_prompt_dataset(spec)
    assert "broken_rows.parquet" in str(e.value) and "row index 2 (0-based)" in str(e.value)


def test_file_spec_errors(tmp_path):
    _write_jsonl(tmp_path / "t.jsonl", [_row(0, "q", "1")])
    with pytest.raises(DataError, match="'generator'"):  # a reasoning_gym key in a file spec
        load_spec(_spec(tmp_path, "a", "source: file\npath: t.jsonl\ngenerator: x\n"))
    with pytest.raises(DataError, match="missing.jsonl"):
        load_spec(_spec(tmp_path, "b", "source: file\npath: missing.jsonl\n"))
    with pytest.raises(DataError, match="path"):
        load_spec(_spec(tmp_path, "c", "source: file\n"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "q"\n')
    with pytest.raises(DataError, match="line 1"):
        load_prompt_dataset(_spec(tmp_path, "d", "source: file\npath: bad.jsonl\n"))


# --------------------------------------------------------------------------------------------- sampler


def _records(n):
    return [PromptRecord(prompt_id=f"p{i}", data_source="s", messages=[], ground_truth=str(i)) for i in range(n)]


@pytest.mark.parametrize("n, batch", [(12, 4), (10, 3), (7, 7), (9, 1)])
def test_sampler_every_prompt_once_per_epoch(n, batch):
    s = PromptSampler(_records(n), batch_size=batch, seed=5)
    assert s.iterations_per_epoch == n // batch
    orders = []
    for epoch in range(3):
        seen = [r.prompt_id for _ in range(s.iterations_per_epoch) for r in s.next_batch()]
        assert len(seen) == (n // batch) * batch
        assert len(set(seen)) == len(seen)  # no prompt twice in an epoch
        if n % batch == 0:
            assert sorted(seen) == sorted(f"p{i}" for i in range(n))  # nothing dropped
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled per epoch (fixed seed, so deterministic)


def test_sampler_drops_only_the_tail_and_starts_next_epoch():
    s = PromptSampler(_records(10), batch_size=4, seed=0)
    s.next_batch(), s.next_batch()
    assert s.state_dict() == {"epoch": 0, "cursor": 8, "seed": 0}
    s.next_batch()  # 2 prompts left in epoch 0: dropped; this batch is epoch 1's first
    assert s.state_dict() == {"epoch": 1, "cursor": 4, "seed": 0}


def test_sampler_is_deterministic_for_a_seed():
    def seq(seed):
        s = PromptSampler(_records(20), batch_size=3, seed=seed)
        return [[r.prompt_id for r in s.next_batch()] for _ in range(15)]

    assert seq(1) == seq(1)
    assert seq(1) != seq(2)


@pytest.mark.parametrize("steps_before", [0, 2, 3, 4, 7])
def test_sampler_state_round_trip_resumes_exactly(steps_before):
    records = _records(10)
    a = PromptSampler(records, batch_size=3, seed=11)  # 3 batches per epoch, tail of 1 dropped
    for _ in range(steps_before):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    expected = [[r.prompt_id for r in a.next_batch()] for _ in range(7)]  # crosses epoch boundaries
    b = PromptSampler(records, batch_size=3, seed=999)
    b.load_state_dict(state)
    assert [[r.prompt_id for r in b.next_batch()] for _ in range(7)] == expected


def test_sampler_validation():
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(_records(3), batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(_records(3), batch_size=0)
    s = PromptSampler(_records(10), batch_size=3)
    with pytest.raises(ValueError, match="cursor"):
        s.load_state_dict({"epoch": 0, "cursor": 4, "seed": 0})
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"epoch": 0})


def test_an_empty_prompt_is_rejected_naming_file_and_row(tmp_path):
    rows = [_row(0, "1+1?", "2"), _row(1, "   ", "4")]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    spec = _spec(tmp_path, "empty", "source: file\npath: train.jsonl\nsplit: {validation_size: 1}\n")
    with pytest.raises(DataError, match=r"train\.jsonl.*2.*no user message with text"):
        load_prompt_dataset(spec)
