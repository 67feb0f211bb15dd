"""The reward-model worker: scores (prompt, response) pairs with a sequence-classification model.

Only created when ``reward.reward_model.enable`` is true; the reward stage combines its scores with
the rule-based ones (``rule_weight * rule + rm_weight * rm``). :class:`RewardModelWorker` says what
the model must be and how a response is scored.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from trajflow.config import ModelConfig, RewardModelConfig
from trajflow.errors import ModelLoadError
from trajflow.modeling.packing import micro_batch_slices
from trajflow.modeling.precision import autocast, cast_buffers, section_dtype
from trajflow.models import _DTYPES, load_tokenizer
from trajflow.workers.base import Worker


def chat_token_ids(tokenizer: Any, messages: Sequence[dict], response: str, max_length: int) -> list[int]:
    """Token ids of ``messages + [assistant: response]``, keeping the last ``max_length`` tokens.

    Uses the tokenizer's chat template; a tokenizer without one gets the message contents and the
    response joined by newlines.
    """
    chat = list(messages) + [{"role": "assistant", "content": response}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=False)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
    else:
        ids = tokenizer("\n".join(str(m.get("content", "")) for m in chat), add_special_tokens=True)["input_ids"]
    ids = [int(x) for x in ids]
    return ids[-max_length:]


class RewardModelWorker(Worker):
    """A frozen sequence-classification reward model (a Ray actor in the pipeline).

    The model at ``reward.reward_model.path`` is loaded with ``AutoModelForSequenceClassification``
    and must have one label (a scalar reward head, as trained by TRL's ``RewardTrainer`` or
    OpenRLHF). Each response is scored as a chat: the prompt's messages plus an ``assistant`` turn
    holding the response text, rendered with the reward model's own chat template (its tokenizer
    may differ from the policy's), without a generation prompt. The score is the head's output at
    the last non-padding token (transformers' own pooling, the one the reward model was trained with).

    Args:
        model_path: Hugging Face directory of the reward model.
        rm_cfg: the ``reward.reward_model`` config section (``micro_batch_size``, ``max_length``,
            ``mixed_precision``).
        model_cfg: the ``model`` config section (``dtype``, ``attn_implementation``).
        device: torch device.
        num_threads: torch threads (0 = all CPUs).

    Raises:
        ModelLoadError: the directory is not loadable as a sequence-classification model, or its
            head does not have exactly one label.
    """

    def __init__(self, model_path: str, rm_cfg: RewardModelConfig, model_cfg: ModelConfig, device: str = "cpu",
                 num_threads: int = 0) -> None:
        from transformers import AutoModelForSequenceClassification

        self._start(device, num_threads)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(model_path), dtype=getattr(torch, _DTYPES[model_cfg.dtype]),
                attn_implementation=model_cfg.attn_implementation)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"reward.reward_model.path={str(model_path)!r}: transformers could not load it "
                                 f"as a sequence-classification model: {str(e).splitlines()[0]}") from None
        if int(model.config.num_labels) != 1:
            raise ModelLoadError(f"reward.reward_model.path={str(model_path)!r}: the classification head has "
                                 f"{model.config.num_labels} labels; a reward model needs exactly 1")
        self.tokenizer = load_tokenizer(model_path)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = int(self.tokenizer.pad_token_id)
        self.pad_id = int(model.config.pad_token_id)
        self.model = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # fp32 weights, forwards in reward.reward_model.mixed_precision.param_dtype, scores read as float32.
        self.param_dtype = section_dtype(rm_cfg)
        cast_buffers(self.model, str(getattr(getattr(rm_cfg, "mixed_precision", None), "buffer_dtype", "float32")))
        self.micro_batch_size = int(rm_cfg.micro_batch_size)
        self.max_length = int(rm_cfg.max_length)

    @torch.no_grad()
    def compute_rm_score(self, messages_list: Sequence[Sequence[dict]], responses: Sequence[str]) -> np.ndarray:
        """Reward-model score of each (prompt messages, response text) pair.

        Args:
            messages_list: the chat prompt of each row (list of ``{"role", "content"}``).
            responses: the response text of each row (special tokens removed).

        Returns:
            ``(rows,)`` float32 scores.

        Raises:
            ValueError: the two lists differ in length.
        """
        if len(messages_list) != len(responses):
            raise ValueError(f"compute_rm_score: {len(messages_list)} prompts but {len(responses)} responses")
        ids = [chat_token_ids(self.tokenizer, m, r, self.max_length) for m, r in zip(messages_list, responses)]
        out = np.zeros(len(ids), dtype=np.float32)
        for sl in micro_batch_slices(len(ids), self.micro_batch_size):
            rows = ids[sl]
            width = max(len(r) for r in rows)
            x = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            for j, r in enumerate(rows):  # right padding: the last real token is found by the model
                x[j, :len(r)] = torch.tensor(r)
                attn[j, :len(r)] = 1
            with autocast(self.param_dtype, self.device):
                logits = self.model(input_ids=x.to(self.device), attention_mask=attn.to(self.device)).logits
            out[sl] = logits[:, 0].float().cpu().numpy()
        return out
