"""Helpers shared by the algorithm-family tests: a tiny reward model and a deterministic test scorer."""

from __future__ import annotations

from pathlib import Path

#: A custom reward function (verl signature) whose score is a hash bit of the response text: random-looking
#: 0/1 rewards from a random-weight policy, so groups have reward variance and advantages are not all 0.
HASH_SCORER = '''
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    bit = int(hashlib.sha256(solution_str.encode()).hexdigest(), 16) % 2
    return {"score": float(bit), "acc": float(bit)}
'''


def write_hash_scorer(directory: Path) -> str:
    """Write :data:`HASH_SCORER` and return its ``reward.custom_function`` spec."""
    path = Path(directory) / "hash_scorer.py"
    path.write_text(HASH_SCORER)
    return f"{path}:compute_score"


def make_tiny_reward_model(out: Path, seed: int = 1, num_labels: int = 1) -> Path:
    """A 2-layer Llama sequence classifier (scalar head) with SmolLM2's tokenizer and random weights."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from trajflow.models import builtin_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir("smollm2-135m-instruct"))
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         num_labels=num_labels, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():  # a visible head (the default init is tiny): scores of order 1
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
