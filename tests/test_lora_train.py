"""`train` with LoRA on the actor, end to end (tiny model, real Ray, Prefect, MLflow on SQLite):
KL on without a reference worker, adapter-only checkpoints, a resumed run ending with the same
weights as an uninterrupted one, and ``final/`` loadable by transformers and by peft."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.algo_helpers import write_hash_scorer
from tests.conftest import tiny_overrides

LORA = {"model.lora_rank": 4, "model.lora_alpha": 8, "actor.lr": 1e-3, "trainer.test_freq": 0,
        "tracking.log_model": False}
KL = {"actor.kl_loss_coef": 0.1}


def _train(model_dir, root, **extra):
    from trajflow.flows.train import train

    # Hash-bit rewards: groups have reward variance, so the adapters get non-zero gradients.
    scorer = {"reward.custom_function": write_hash_scorer(root), "rollout.n": 4}
    return train(None, tiny_overrides(model_dir, root, **{**LORA, **scorer, **extra}))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-store")
    full = _train(tiny_model_dir, root, **KL, **{"trainer.run_id": "full"})
    _train(tiny_model_dir, root, **KL, **{"trainer.run_id": "cut", "trainer.total_iterations": 1})
    resumed = _train(tiny_model_dir, root, **KL, **{"trainer.run_id": "cut", "trainer.resume": "auto"})
    no_kl = _train(tiny_model_dir, root, **{"trainer.run_id": "nokl", "trainer.total_iterations": 1})
    from trajflow.flows.replay import replay

    # Iteration 2 again from checkpoint 1: reference log-probs from the reloaded adapter's base, then the update.
    named = f"reward.custom_function={root / 'hash_scorer.py'}:compute_score"  # a stored function is named again
    replayed = replay("full", "reward", iteration=2, overrides=[f"store.root={root}", named], run_id="full-replay")
    return {"full": full, "resumed": resumed, "no_kl": no_kl, "replay": replayed}


def test_kl_uses_the_actor_with_adapters_off_and_no_reference_worker(runs):
    import pyarrow.parquet as pq

    run_dir = Path(runs["full"]["run_dir"])
    meta = json.loads((run_dir / "run.json").read_text())
    assert "reference" not in meta["worker_nodes"] and "actor" in meta["worker_nodes"]
    reward = pq.read_table(run_dir / "iterations" / "000001" / "reward.parquet")
    assert "ref_logprobs" in reward.column_names
    update = json.loads((run_dir / "iterations" / "000002" / "update.json").read_text())
    assert update["actor/kl_loss"] > 0  # iteration 2's policy has moved off the base
    no_kl = pq.read_table(Path(runs["no_kl"]["run_dir"]) / "iterations" / "000001" / "reward.parquet")
    assert "ref_logprobs" not in no_kl.column_names


def test_checkpoints_hold_only_the_adapter_and_are_in_the_manifest(runs, tiny_model_dir):
    from trajflow.checkpoint import _file_hashes

    ck = Path(runs["full"]["run_dir"]) / "checkpoints" / "000002"
    files = json.loads((ck / "manifest.json").read_text())["files"]
    assert "actor/adapter.safetensors" in files and "actor/model.safetensors" not in files
    assert files == _file_hashes(ck)  # sha256 and size of every file
    with safe_open(str(ck / "actor" / "adapter.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)
    actor_bytes = sum(v["bytes"] for k, v in files.items() if k.startswith("actor/"))
    base_bytes = (Path(tiny_model_dir) / "model.safetensors").stat().st_size
    assert actor_bytes < base_bytes / 4


def test_resume_ends_with_the_weights_of_an_uninterrupted_run(runs):
    full, resumed = Path(runs["full"]["run_dir"]), Path(runs["resumed"]["run_dir"])
    assert runs["resumed"]["trained_iterations"] == [2]
    for rel in ("final/model.safetensors", "final/adapter/adapter_model.safetensors",
                "checkpoints/000002/actor/adapter.safetensors"):
        a, b = load_file(str(full / rel)), load_file(str(resumed / rel))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), rel


def test_replay_from_a_lora_checkpoint_reproduces_the_stored_iteration(runs):
    import pyarrow.parquet as pq

    parent, child = Path(runs["full"]["run_dir"]), Path(runs["replay"]["run_dir"])
    it = "iterations/000002"
    for name in ("reward.parquet", "advantage.parquet"):
        assert pq.read_table(child / it / name).equals(pq.read_table(parent / it / name)), name
    a = load_file(str(parent / "checkpoints/000002/actor/adapter.safetensors"))
    b = load_file(str(child / "checkpoints/000002/actor/adapter.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("which", ["full", "no_kl"])
def test_final_loads_with_transformers_and_the_adapter_with_peft(runs, tiny_model_dir, which):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = Path(runs[which]["run_dir"]) / "final"
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final / "adapter").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[1, 28, 50, 71, 300, 12, 9, 5]])
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-4  # it trained


def test_export_of_a_lora_checkpoint_is_the_merged_model_and_the_peft_adapter(runs, tiny_model_dir, tmp_path):
    """`trajflow export` of checkpoint 2 (the adapter alone on disk): OUT is W + s B A (merged), OUT/adapter
    is peft's folder; both give the logits of final/, which the policy worker wrote from its live module."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trajflow.export import export_run

    root = Path(runs["full"]["run_dir"]).parent
    r = export_run(root, "full", 2, tmp_path / "both")
    assert r["format"] == "lora" and r["lora"] == "both"
    assert "adapter/adapter_model.safetensors" in r["files"] and "model.safetensors" in r["files"]
    files = export_run(root, "full", 2, tmp_path / "adapter", lora="adapter")["files"]
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(files)
    assert "model.safetensors" not in files
    ids = torch.tensor([[1, 28, 50, 71, 300, 12, 9, 5]])
    final = Path(runs["full"]["run_dir"]) / "final"
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(final).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "both").eval()(input_ids=ids).logits
        assert torch.equal(merged, want)
        for adapter in (tmp_path / "both" / "adapter", tmp_path / "adapter"):
            peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter).eval()
            assert torch.allclose(peft(input_ids=ids).logits, want, atol=1e-5, rtol=0)
