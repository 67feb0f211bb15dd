"""verl's data as it is: its Parquet layout via data.dataset or data.train_files/val_files, the
scorer picked from each row's data_source, and prompts/extra_info stored as Arrow lists and structs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajflow.stages.reward import score_rows
from trajflow.stages.scorers import select_scorer
from trajflow.config import load_config
from trajflow.errors import ConfigError
from trajflow.prompts import DataError, data_spec, load_prompt_dataset

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]
GSM8K_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'
MATH_SOURCES = ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]


def gsm8k_row(i: int, split: str = "train") -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    q = f"Tom has {i + 2} apples and buys {i + 3} more. How many apples does he have?"
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{q} {GSM8K_SUFFIX}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 5)},
            "extra_info": {"split": split, "index": i, "answer": f"{i + 2} + {i + 3} = {2 * i + 5}\n#### {2 * i + 5}",
                           "question": q}}


def math_row(i: int, source: str) -> dict:
    return {"data_source": source,
            "prompt": [{"role": "system", "content": "Put the final answer in \\boxed{}."},
                       {"role": "user", "content": f"Simplify \\frac{{{2 * (i + 1)}}}{{4}}."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": f"\\frac{{{i + 1}}}{{2}}"},
            "extra_info": {"split": "train", "index": 100 + i, "answer": "", "question": f"q{i}"}}


def write_verl_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def verl_files(tmp_path):
    train = write_verl_parquet(tmp_path / "train.parquet",
                               [gsm8k_row(i) for i in range(4)] + [math_row(i, s) for i, s in enumerate(MATH_SOURCES)])
    more = write_verl_parquet(tmp_path / "more.parquet", [gsm8k_row(10)])
    test = write_verl_parquet(tmp_path / "test.parquet", [gsm8k_row(20, "test"), math_row(5, "lighteval/MATH")])
    return train, more, test


def test_verl_parquet_loads_as_records(verl_files):
    train, _, _ = verl_files
    assert pq.read_schema(train).field("prompt").type.value_type == pa.struct(
        [("role", pa.string()), ("content", pa.string())])  # verl's layout, as datasets writes it
    data = load_prompt_dataset(data_spec({"dataset": str(train), "train_files": None, "val_files": None}))
    assert len(data.train) == 7 and data.validation == []
    first = data.train[0]
    assert first.data_source == "openai/gsm8k"
    assert first.messages == [{"role": "user", "content": gsm8k_row(0)["prompt"][0]["content"]}]
    assert first.ground_truth == "5"
    assert first.extra_info == {"split": "train", "index": 0, "answer": "2 + 3 = 5\n#### 5",
                                "question": gsm8k_row(0)["extra_info"]["question"], "reward_style": "rule"}
    maths = data.train[4:]
    assert [r.data_source for r in maths] == MATH_SOURCES
    assert [m["role"] for m in maths[0].messages] == ["system", "user"]
    assert [r.ground_truth for r in maths] == ["\\frac{1}{2}", "\\frac{2}{2}", "\\frac{3}{2}"]
    assert data.origins["lighteval/MATH"] == f"{train}: row index 4 (0-based)"


def test_train_files_list_is_concatenated_and_val_files_held_out(verl_files):
    train, more, test = verl_files
    cfg = load_config("smoke", [f"data.train_files=[{train},{more}]", f"data.val_files={test}"])
    data = load_prompt_dataset(data_spec(cfg.data))
    assert [r.extra_info["index"] for r in data.train] == [0, 1, 2, 3, 100, 101, 102, 10]
    assert [r.extra_info["split"] for r in data.validation] == ["validation", "validation"]
    assert [r.ground_truth for r in data.validation] == ["45", "\\frac{6}{2}"]
    assert len({r.prompt_id for r in data.train + data.validation}) == 10


def test_scorer_is_chosen_from_data_source_as_verl_does():
    for source in ["openai/gsm8k", *MATH_SOURCES, "math_dapo", "aime24", "numina_olympiads", "hiyouga/geometry3k"]:
        assert select_scorer(source) == "math_verify", source
    assert select_scorer("reasoning_gym/basic_arithmetic") == "reasoning_gym"
    assert select_scorer("openai/gsm8k", override="exact_match") == "exact_match"  # reward.scorer wins
    with pytest.raises(ValueError, match="'codecontests'.*reward.scorer"):
        select_scorer("codecontests")
    cfg = {"scorer": "exact_match"}
    # "\frac{1}{2}" vs "0.5": equal for math_verify (the mapping), not for exact_match (the override)
    mapped = score_rows(["lighteval/MATH"], ["\\boxed{0.5}"], ["\\frac{1}{2}"], [{"index": 1}], {})
    forced = score_rows(["lighteval/MATH"], ["\\boxed{0.5}"], ["\\frac{1}{2}"], [{"index": 1}], cfg)
    assert (mapped.scores[0], forced.scores[0]) == (1.0, 0.0)
    # a rollout stored before extra_info was a struct: JSON text is still read
    old = score_rows(["openai/gsm8k"], ["#### 7"], ["7"], [json.dumps({"index": 1})], {})
    assert old.scores[0] == 1.0 and old.num_errors == 0


def test_reward_scorer_must_be_registered():
    with pytest.raises(ConfigError, match="reward.scorer='exact'.*exact_match"):
        load_config("smoke", ["reward.scorer=exact"])


@pytest.mark.parametrize("case, needles", [
    ("no_prompt_column", ["bad.parquet", "no 'prompt' column", "columns:"]),
    ("prompt_not_messages", ["bad.parquet", "row index 1 (0-based)", "'prompt[0]'"]),
    ("no_ground_truth", ["bad.parquet", "row index 2 (0-based)", "reward_model.ground_truth"]),
])
def test_bad_verl_file_names_file_and_row_or_column(tmp_path, case, needles):
    rows = [gsm8k_row(i) for i in range(3)]
    if case == "no_prompt_column":
        for r in rows:
            r["question"] = r.pop("prompt")
    elif case == "prompt_not_messages":
        rows[1]["prompt"] = [{"role": "user", "text": "the key is not 'content'"}]
    else:
        rows[2]["reward_model"]["ground_truth"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError) as err:
        load_prompt_dataset(str(tmp_path / "bad.parquet"))
    msg = str(err.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_a_data_file_with_a_spec_suffix_is_one_line(tmp_path):
    parquet = write_verl_parquet(tmp_path / "t.parquet", [gsm8k_row(0)])
    (tmp_path / "train.yaml").write_bytes(parquet.read_bytes())
    with pytest.raises(DataError, match=r"train.yaml: a dataset spec must be YAML text"):
        load_prompt_dataset(str(tmp_path / "train.yaml"))


def run_cli(*args, cwd=None, timeout=120):
    p = subprocess.run(TRAJFLOW + list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


def test_unmapped_data_source_fails_in_preflight(tmp_path, tiny_model_dir, verl_files):
    train, _, _ = verl_files
    odd = write_verl_parquet(tmp_path / "odd.parquet", [gsm8k_row(1), {**gsm8k_row(2), "data_source": "acme/riddles"}])
    rc, out, err = run_cli("train", "-c", "smoke", f"data.train_files=[{train},{odd}]",
                           f"model.path={tiny_model_dir}", f"store.root={tmp_path / 'runs'}",
                           f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in ["'acme/riddles'", f"{odd}: row index 1 (0-based)", "reward.scorer", "reward.custom_function"]:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()
    assert "Starting temporary server" not in out + err  # found before Prefect, Ray or the model


def test_verl_parquet_trains_end_to_end_with_struct_columns(tmp_path, tiny_model_dir, verl_files):
    train, _, test = verl_files
    root = tmp_path / "runs"
    rc, out, err = run_cli("train", "-c", "smoke", f"data.dataset={train}", f"data.val_files={test}",
                           f"model.path={tiny_model_dir}", f"store.root={root}", "rollout.max_new_tokens=4",
                           f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "trainer.progress=false",
                           cwd=tmp_path, timeout=600)
    assert rc == 0, out[-2000:] + err[-4000:]
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    rollout = pq.read_table(run_dir / "iterations" / "000002" / "rollout.parquet")
    prompt_type = rollout.schema.field("prompt").type
    assert pa.types.is_list(prompt_type) and prompt_type.value_type == pa.struct(
        [("role", pa.string()), ("content", pa.string())])
    info_type = rollout.schema.field("extra_info").type
    assert pa.types.is_struct(info_type)
    assert {info_type.field(i).name for i in range(info_type.num_fields)} == {
        "answer", "index", "question", "reward_style", "split"}
    assert info_type.field("index").type == pa.int64()
    rows = rollout.to_pylist()
    assert {r["data_source"] for r in rows} <= {"openai/gsm8k", *MATH_SOURCES}
    for r in rows:
        index = r["extra_info"]["index"]
        want = (gsm8k_row(index) if index < 100 else math_row(index - 100, MATH_SOURCES[index - 100]))
        assert r["prompt"] == want["prompt"] and r["ground_truth"] == want["reward_model"]["ground_truth"]
    # the run's scores came from the scorer of each data source, without errors
    reward = pq.read_table(run_dir / "iterations" / "000002" / "reward.parquet")
    assert reward.column("reward_error").null_count == reward.num_rows
    # the audit table, and the dashboard's Parquet reader without it, show the struct prompts as text
    from trajflow.dashboards.data import find_trajectories, trajectory_source
    from trajflow.audit import query_audit

    audited = query_audit(root, run_dir.name, limit=1000).to_pylist()
    assert {r["sample_id"]: r["prompt_text"] for r in audited if r["iteration"] == 2} == {
        r["sample_id"]: "\n".join(f"{m['role']}: {m['content']}" for m in r["prompt"]) for r in rows}
    (run_dir / "audit.lance").rename(tmp_path / "audit.lance")
    assert trajectory_source(root, run_dir.name) == "parquet"
    scanned = find_trajectories(root, run_dir.name, limit=1000).to_pylist()
    assert sorted((r["sample_id"], r["prompt_text"]) for r in scanned) == sorted(
        (r["sample_id"], r["prompt_text"]) for r in audited)
    # pandas gets dicts and lists, no JSON to parse
    frame = rollout.to_pandas()
    assert frame["extra_info"].map(lambda x: x["index"]).tolist() == [r["extra_info"]["index"] for r in rows]
    assert [list(p)[-1]["content"] for p in frame["prompt"]] == [r["prompt"][-1]["content"] for r in rows]


def test_nested_columns_round_trip_and_old_json_still_reads(tmp_path):
    from trajflow.dashboards.data import prompt_text as dashboard_prompt_text
    from trajflow.audit import prompt_text as audit_prompt_text
    from trajflow.batch import decode_nested, nested_column, nested_type

    infos = [{"index": 1, "meta": {"a": [1, 2]}, "cfg": {}}, {"index": 2, "extra": "x"}]
    col = nested_column(infos, nested_type(infos))
    assert pa.types.is_struct(col.type)
    pq.write_table(pa.table({"extra_info": col}), tmp_path / "t.parquet")  # an empty dict is storable
    back = [decode_nested(v) for v in pq.read_table(tmp_path / "t.parquet").column("extra_info").to_pylist()]
    assert back == [{"index": 1, "meta": {"a": [1, 2]}}, {"index": 2, "extra": "x"}]
    # values that fit no one Arrow type stay JSON text, read back the same way
    clash = [{"k": 1}, {"k": "one"}]
    assert nested_type(clash) == pa.string() and pa.types.is_string(nested_column(clash).type)
    assert [decode_nested(v) for v in nested_column(clash).to_pylist()] == clash
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    for stored in (messages, json.dumps(messages)):  # this format, and the JSON of older runs
        assert audit_prompt_text(stored) == dashboard_prompt_text(stored) == "system: Be brief.\nuser: 2+2?"


def test_every_batch_of_a_dataset_gets_one_rollout_schema(tmp_path):
    """Batches whose rows lack different extra_info keys still concatenate (dynamic sampling) and
    read as one dataset across iterations: the type comes from the whole dataset."""
    from trajflow.stages.rollout import Generation, rollout_table

    rows = [gsm8k_row(0), {**gsm8k_row(1), "extra_info": {"index": 1, "hint": "add"}}, math_row(0, "lighteval/MATH")]
    data = load_prompt_dataset(str(write_verl_parquet(tmp_path / "mixed.parquet", rows)))
    tables = []
    for k, prompts in enumerate([data.train[:1], data.train[1:2], data.train[2:]]):
        gen = Generation(response_ids=[[1, 2]], response_text=["#### 5"], finish_reason=["stop"],
                         rollout_logprobs=[[-0.1, -0.2]], policy_version=0)
        tables.append(rollout_table(1, prompts, [[7, 8]], gen, 1, offset=k,
                                    extra_info_type=data.extra_info_type))
    assert len({t.schema for t in tables}) == 1
    assert pa.concat_tables(tables).column("extra_info").to_pylist()[1]["hint"] == "add"
