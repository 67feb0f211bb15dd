"""Rollout with vLLM on a GPU (optional ``gpu`` extra: ``pip install 'trajflow[gpu]'``).

vLLM is imported only when an engine is built, so this module imports on any machine; building
an engine without vLLM raises :class:`trajflow.errors.DeviceError` with the install hint.
Written against **vLLM 0.32.0** (the last release pinning torch 2.13.0, which trajflow pins);
:class:`VLLMRolloutEngine` lists the vLLM APIs used and where they are documented.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from stages.rollout import SamplingParams
from trajflow.config import ModelConfig, RolloutConfig
from trajflow.engines.base import GenerationOutput


class TrajflowWorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``); reached through ``LLM.collective_rpc``."""

    def trajflow_load_weights(self, weights: Sequence[tuple[str, Any]]) -> int:
        """Load ``(name, tensor)`` pairs (Hugging Face names) into the running model; returns how many."""
        import torch

        device = self.device  # type: ignore[attr-defined]
        model = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights(weights=[(name, t.to(device, non_blocking=True)) for name, t in weights])
        try:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading
        except ImportError:  # older layouts: nothing to post-process for dense bf16/fp16 weights
            process_weights_after_loading = None
        if process_weights_after_loading is not None:
            process_weights_after_loading(model, self.model_config, device)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        return len(weights)


class VLLMRolloutEngine:
    """A vLLM engine (tensor parallel 1) on this process's GPU, behind the rollout-engine interface.

    What is used of vLLM 0.32.0 (the ``gpu`` extra pins it), and where it is documented:

    - ``LLM(model=..., dtype=..., gpu_memory_utilization=..., seed=..., enable_sleep_mode=...,
      logprobs_mode="processed_logprobs", worker_extension_cls=...)`` and ``LLM.generate(prompts,
      sampling_params)`` with token-id prompts (``{"prompt_token_ids": [...]}``) and one
      ``SamplingParams(n, temperature, top_p, top_k, max_tokens, logprobs=0, seed,
      stop_token_ids)`` per prompt. ``logprobs=0`` returns the sampled token's log-prob only;
      ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2) makes it the log-prob under the
      distribution sampling drew from (after temperature / top-k / top-p) rather than the raw
      logits', which is what the rollout importance-sampling correction needs.
    - Weight updates follow vLLM's RLHF examples (``examples/offline_inference/rlhf_utils.py``,
      ``ColocateWorkerExtension``): a *worker extension class* named by ``worker_extension_cls``
      is mixed into vLLM's GPU worker, and ``LLM.collective_rpc(method, args=...)`` calls its
      method on every worker, which runs ``self.model_runner.model.load_weights(weights=[(name,
      tensor), ...])`` and then ``process_weights_after_loading(model, model_config, device)``. The
      engine runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and tensor parallel size 1, so the
      engine core and its one worker live in this process and ``collective_rpc`` hands the tensors
      over by reference (no CUDA IPC or NCCL group needed for the colocated case). vLLM 0.16+ also
      has a native weight-transfer API (``WeightTransferConfig``, ``init_weight_transfer_engine`` /
      ``update_weights``); it is built around trainer/engine processes exchanging NCCL or CUDA-IPC
      handles, which this in-process engine does not need.
    - Sleep mode (docs "Sleep Mode"): with ``enable_sleep_mode=True``, ``LLM.sleep(level=1)``
      offloads the weights to CPU and drops the KV cache; ``LLM.wake_up(tags=["weights"])``
      restores the weights only (so the update can load new ones without the KV cache taking
      memory), then ``wake_up(tags=["kv_cache"])``. ``LLM.reset_prefix_cache()`` drops cached
      prefixes computed with the old weights.

    - LoRA (``model.lora_rank > 0``; docs "LoRA Adapters"): ``LLM(..., enable_lora=True,
      max_lora_rank=r, max_loras=1)`` serves the frozen base weights, and every generation passes
      ``lora_request=LoRARequest(name, int_id, path)``, ``path`` a peft-format directory
      (``adapter_config.json`` + ``adapter_model.safetensors``). After an update the policy writes
      the new adapter under a new id (:meth:`update_adapter`); vLLM loads it on the next request
      and evicts the old one (``max_loras=1``). The adapter, not merged weights, is what syncs:
      megabytes per update instead of the whole model, and the base in vLLM is never rewritten.

    Not verified on a GPU in this repository's CI (there is none); ``benchmarks/gpu_check.sh`` runs
    it on one GPU machine.

    Args:
        model_path: Hugging Face directory of the initial policy.
        rollout: the ``rollout`` config section (``gpu_memory_utilization``).
        model_cfg: the ``model`` config section (``dtype``).
        eos_ids: token ids that end a response (vLLM stops on all of them).
        seed: engine seed; each prompt's sampling seed is ``params.seed + prompt index``.
        colocated: the engine shares its GPU with training: it sleeps between rollouts.
        lora_rank: ``model.lora_rank``; > 0 turns on vLLM's LoRA support for :meth:`update_adapter`.

    Raises:
        trajflow.errors.DeviceError: vLLM is not installed, or no CUDA GPU is visible.
    """

    rank0_push = False

    def __init__(self, model_path: str, rollout: RolloutConfig, model_cfg: ModelConfig, eos_ids: Sequence[int],
                 seed: int = 0, colocated: bool = True, lora_rank: int = 0) -> None:
        from trajflow.infra.devices import require_device, require_vllm

        require_vllm()
        require_device("cuda", "this Ray worker's node (the vLLM engine)")
        # One in-process engine core: collective_rpc passes tensors by reference (see the module doc).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.eos_ids = [int(e) for e in eos_ids]
        self.colocated = colocated
        self.asleep = False
        self.lora_request = None  # None: the base model (B = 0 at start, so also the initial policy)
        self._lora_dir = None
        lora_kw = {"enable_lora": True, "max_lora_rank": int(lora_rank), "max_loras": 1} if lora_rank > 0 else {}
        dtype = str(getattr(rollout, "dtype", model_cfg.dtype))  # rollout.dtype: the sampler's own precision
        self.llm = LLM(**lora_kw, model=str(model_path), tokenizer=str(model_path), dtype=dtype,
                       gpu_memory_utilization=float(rollout.gpu_memory_utilization),
                       seed=int(seed), enable_sleep_mode=colocated, tensor_parallel_size=1,
                       logprobs_mode="processed_logprobs",
                       worker_extension_cls=f"{__name__}.TrajflowWorkerExtension", disable_log_stats=True)

    # ---------------------------------------------------------------- memory
    def sleep(self) -> None:
        """Release the GPU memory (level 1: weights to CPU, KV cache dropped) until the next use."""
        if self.colocated and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ---------------------------------------------------------------- interface
    def update_weights(self, named_tensors: Any) -> None:
        """Load the policy's weights ``{name: tensor}`` (any device) into the engine."""
        items = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # weights back, KV cache still released
        self.llm.collective_rpc("trajflow_load_weights", args=(items,))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def update_adapter(self, adapter: dict, peft_config: Any, version: int) -> None:
        """Serve the LoRA adapter ``adapter`` (peft's tensor names, any device) from now on.

        Args:
            adapter: :func:`trajflow.modeling.lora.adapter_state` of the policy.
            peft_config: the policy's ``peft.LoraConfig`` (written as ``adapter_config.json``).
            version: the policy version; a new LoRA id per version, so vLLM never reuses the old adapter.
        """
        import tempfile
        from pathlib import Path

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self._lora_dir is None:
            self._lora_dir = tempfile.TemporaryDirectory(prefix="trajflow-lora-")
        path = Path(self._lora_dir.name) / f"v{int(version):06d}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, str(path / "adapter_model.safetensors"))
        peft_config.save_pretrained(str(path))
        old = self.lora_request
        self.lora_request = LoRARequest(f"policy-v{int(version)}", int(version) + 1, str(path))
        if old is not None:
            import shutil

            shutil.rmtree(old.lora_path, ignore_errors=True)  # vLLM read it when it was first used
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old adapter

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Sample ``params.n`` responses per prompt (prompt-major), with the sampled tokens' log-probs."""
        from vllm import SamplingParams as VSamplingParams

        self.wake_up()
        greedy = params.greedy
        sps = [VSamplingParams(n=params.n, temperature=0.0 if greedy else float(params.temperature),
                               top_p=1.0 if greedy else float(params.top_p),
                               top_k=-1 if greedy or not params.top_k else int(params.top_k),
                               max_tokens=int(params.max_new_tokens), logprobs=0,
                               seed=int(params.seed) + i, stop_token_ids=self.eos_ids)
               for i in range(len(prompt_ids))]
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_ids]
        outputs = self.llm.generate(prompts, sps, use_tqdm=False,
                                    **({"lora_request": self.lora_request} if self.lora_request is not None else {}))
        responses, finish, logprobs = [], [], []
        for request in outputs:
            for completion in sorted(request.outputs, key=lambda c: c.index):
                ids = [int(t) for t in completion.token_ids]
                responses.append(ids)
                finish.append("stop" if completion.finish_reason == "stop" else "length")
                lps = completion.logprobs or []
                logprobs.append([float(step[tok].logprob) for step, tok in zip(lps, ids)])
        return GenerationOutput(response_ids=responses, finish_reason=finish, logprobs=logprobs)
