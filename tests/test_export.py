"""`trajflow export RUN --checkpoint N OUT`: a one-process checkpoint of a real 2-iteration run (tiny model,
real Ray, Prefect, MLflow on SQLite) as a Hugging Face folder with the trainer's logits; bad input is one
line. The LoRA, FSDP2 and DeepSpeed layouts are exported in the tests that write them
(test_lora_train.py, test_fsdp_ranks.py, test_deepspeed_ranks.py)."""

from pathlib import Path

import pytest
import torch

from tests.algo_helpers import write_hash_scorer
from tests.conftest import tiny_overrides
from tests.test_cli_errors import run_cli

PROMPT = "What is 3 + 4? Answer:"


@pytest.fixture(scope="module")
def run(tiny_model_dir, ray_local, tmp_path_factory):
    from trajflow.flows.train import train

    root = tmp_path_factory.mktemp("export-store")
    # Hash-bit rewards and a large step: the policy moves every iteration, so checkpoints 1, 2 and the
    # base model are three different models.
    summary = train(None, tiny_overrides(tiny_model_dir, root, **{
        "reward.custom_function": write_hash_scorer(root), "rollout.n": 4, "actor.lr": 1e-2, "trainer.test_freq": 0,
        "tracking.log_model": False}))
    return summary, root


def logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits


def test_export_gives_the_trainers_logits_at_that_checkpoint(run, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    summary, root = run
    out = tmp_path / "hf"
    rc, stdout, err = run_cli("export", summary["run_id"], str(out), "--checkpoint", "2", "--store", str(root))
    assert rc == 0, err
    assert "exported checkpoint 2" in stdout and str(out) in stdout
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    ids = AutoTokenizer.from_pretrained(out)(PROMPT, return_tensors="pt")["input_ids"]
    # final/ is written by the policy worker from its live module after iteration 2: the trainer's weights.
    final = logits(Path(summary["run_dir"]) / "final", ids)
    assert torch.equal(logits(out, ids), final)
    assert not torch.allclose(logits(tiny_model_dir, ids), final)  # the policy did move
    # Checkpoint 1 is the policy one update earlier, and the newest is the default.
    rc, _, err = run_cli("export", summary["run_id"], str(tmp_path / "hf1"), "--checkpoint", "1", "--store", str(root))
    assert rc == 0, err
    assert not torch.allclose(logits(tmp_path / "hf1", ids), final)
    rc, stdout, err = run_cli("export", summary["run_id"], str(tmp_path / "newest"), "--store", str(root))
    assert rc == 0 and "exported checkpoint 2" in stdout, err
    assert torch.equal(logits(tmp_path / "newest", ids), final)


def test_bad_export_input_is_one_line_and_loses_nothing(run, tmp_path):
    summary, root = run
    rc, _, err = run_cli("export", summary["run_id"], str(tmp_path / "x"), "--checkpoint", "7", "--store", str(root))
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "no checkpoint 7" in err and "checkpoints: 1, 2" in err
    rc, _, err = run_cli("export", "nope", str(tmp_path / "x"), "--store", str(root))
    assert rc == 2 and "Traceback" not in err and "no run 'nope'" in err, err
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    rc, _, err = run_cli("export", summary["run_id"], str(kept), "--store", str(root))
    assert rc == 2 and "not an empty folder" in err and (kept / "notes.txt").read_text() == "mine", err
    assert not (tmp_path / "x").exists()


def assert_offline_export_equals(actor_dir: Path, model_cfg: dict, worker_export: Path, out: Path, fmt: str,
                                 exact: bool = True) -> None:
    """Export a sharded checkpoint's ``actor/`` offline (no Ray, no process group) and compare it with what
    the policy worker's ranks exported from their live module after loading that checkpoint (the trainer's
    weights): the same tensors and the same logits (to fp32 rounding when ``exact`` is False: a LoRA merge
    summed in another order)."""
    from transformers import AutoModelForCausalLM

    from trajflow.export import export_checkpoint

    r = export_checkpoint(actor_dir, model_cfg, out)
    assert r["format"] == fmt, r
    got = AutoModelForCausalLM.from_pretrained(out).eval()
    want = AutoModelForCausalLM.from_pretrained(worker_export).eval()
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    ids = torch.tensor([[1, 28, 50, 71, 300, 12, 9, 5]])
    with torch.no_grad():
        la, lb = got(input_ids=ids).logits, want(input_ids=ids).logits
    if exact:
        assert all(torch.equal(a[k], b[k]) for k in a) and torch.equal(la, lb)
    else:
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
        assert float((la - lb).abs().max()) < 1e-5
