"""The config schema: one dataclass per section, each field with a one-line ``help`` and the
range or choices :func:`trajflow.config.rules.validate` checks (``_f``), and lookups over it.

The sections (``model``, ``data``, ``rollout``, ``reward``, ``algorithm``, ``actor``, ``critic``,
``reference``, ``trainer``, ``resources``, ``store``, ``tracking``, ``gates``) form
:class:`TrajflowConfig`, which :func:`trajflow.config.load.load_config` turns into an OmegaConf object
in struct mode.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Optional

from trajflow.config.fields import _f, _section
from trajflow.config.judge import JudgeConfig
from trajflow.stages.names import STAGE_NAMES

DEFAULT_RECIPE = "grpo_default"


#: dtype names a mixed_precision.* or rollout.dtype key takes; ``auto`` is resolved by :func:`load_config`.
PRECISION_DTYPES = ["float32", "bfloat16", "float16", "auto"]


@dataclass
class MixedPrecisionConfig:
    """Mixed precision of one role (verl's fsdp_config.mixed_precision): fp32 master weights and
    optimizer state, forwards in param_dtype, log-probs and losses in fp32."""

    param_dtype: str = _f("float32", "compute dtype of forwards/backwards over the fp32 master weights "
                          "(torch.autocast); auto = bfloat16 where bf16 is fast (CPU amx_bf16/avx512_bf16, CUDA "
                          "with bf16), else float32", choices=PRECISION_DTYPES)
    reduce_dtype: str = _f("float32", "dtype gradients are reduced in across data-parallel ranks (DeepSpeed's "
                           "communication_data_type); the one-process backend has no reduction: float32",
                           choices=["float32", "bfloat16"])
    buffer_dtype: str = _f("float32", "dtype of the model's floating-point buffers (rotary inv_freq, ...)",
                           choices=["float32", "bfloat16"])


@dataclass
class ModelConfig:
    """The policy model."""

    path: str = _f("smollm2-135m-instruct",
                   "Hugging Face model directory, or a built-in name: 'smollm2-135m-instruct', 'gemma3-270m'")
    dtype: str = _f("float32", "storage dtype of the weights: float32 (the fp32 master weights); bf16/fp16 "
                    "compute is actor.mixed_precision.param_dtype, the sampler's is rollout.dtype",
                    choices=["float32", "bfloat16", "float16"])
    cache_dir: Optional[str] = _f(None, "where built-in models are converted to safetensors "
                                  "(default: $TRAJFLOW_CACHE or ~/.cache/trajflow)")
    attn_implementation: str = _f("sdpa", "transformers attention kernel",
                                  choices=["sdpa", "eager", "flash_attention_2"])
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    prompt_format: str = _f("auto", "how chat prompts become tokens: auto (the chat template, or 'role: "
                            "content' lines without one), plain ('role: content' lines), completion (a "
                            "few-shot document without role names, for base models)",
                            choices=["auto", "plain", "completion"])
    lora_rank: int = _f(0, "LoRA rank of the actor's adapters (Hu et al. 2021, via peft); 0 = full fine-tuning",
                        ge=0)
    lora_alpha: float = _f(16.0, "LoRA scaling numerator: adapter updates are scaled by lora_alpha / lora_rank "
                           "(lora_alpha / sqrt(lora_rank) with lora_use_rslora)", gt=0.0)
    lora_use_rslora: bool = _f(False, "rank-stabilised LoRA (Kalajdzievski 2023, rsLoRA): scale the adapters by "
                               "lora_alpha / sqrt(lora_rank), so their learning dynamics do not fade as the rank grows")
    target_modules: Any = _f("all-linear", "modules that get adapters: 'all-linear' (every linear layer but the "
                             "LM head) or a list of module names, e.g. [q_proj,v_proj]")
    lora_dropout: float = _f(0.0, "dropout on the adapters' input: must be 0, RL updates run without dropout "
                             "(as TRL's trainers do)", ge=0.0, lt=1.0)


@dataclass
class DataConfig:
    """Prompt data."""

    dataset: str = _f("basic_arithmetic", "dataset spec name under datasets/, path to a spec YAML, or a "
                      "verl-layout data file (.parquet, .jsonl)")
    train_files: Any = _f(None, "verl's key: a verl-layout .parquet/.jsonl file or a list of them (concatenated); "
                          "replaces data.dataset")
    val_files: Any = _f(None, "verl's key: held-out file(s) in the same layout, with data.train_files or a "
                        "data file as data.dataset")
    train_batch_size: int = _f(8, "prompts per iteration", ge=1)
    max_prompt_length: int = _f(512, "prompts longer than this many tokens are an error", ge=1)
    val_max_prompts: int = _f(64, "validation prompts used per evaluation (0 = all)", ge=0)
    val_batch_size: int = _f(64, "validation prompts per generation call (0 = all in one); the console's live "
                             "line advances after each", ge=0)


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-using rollouts (verl's ``actor_rollout_ref.rollout.multi_turn``)."""

    enable: bool = _f(False, "run episodes of an environment instead of one response per prompt")
    environment: str = _f("tool_calculator", "registered environment name, or 'module:factory' of your own")
    max_assistant_turns: int = _f(4, "assistant turns per episode; one more ends it with finish_reason max_turns", ge=1)
    max_user_turns: int = _f(4, "observation (tool/user) turns per episode before finish_reason max_turns", ge=0)
    max_tokens_per_turn: int = _f(0, "tokens one assistant turn may generate (0 = what is left of rollout.max_new_tokens)",
                                  ge=0)
    max_tool_response_length: int = _f(256, "characters of a tool's result shown to the model (longer is cut)", ge=1)
    tool_config_path: Optional[str] = _f(None, "YAML file naming the tools and their options (null = the "
                                         "environment's own tools)")
    format: str = _f("hermes", "how the model writes tool calls: <tool_call>{json}</tool_call>",
                     choices=["hermes"])
    tool_workers: int = _f(4, "sandbox processes running tool calls at once", ge=1)
    allow_weaker_sandbox: bool = _f(False, "run tools even where the kernel refuses part of the sandbox's "
                                    "isolation (user/network/PID/mount namespaces); see docs/multi-turn.md")
    default_env_reward: Optional[float] = _f(None, "env_reward of an episode that neither a step nor the "
                                             "environment's final_reward rewarded (null = such an episode "
                                             "is an error under reward.scorer=env)")


@dataclass
class RolloutConfig:
    """Sampling responses from the current policy."""

    engine: str = _f("hf", "rollout engine", choices=["hf", "vllm"])
    n: int = _f(4, "samples per prompt (the GRPO group size)", ge=1)
    temperature: float = _f(1.0, "sampling temperature; old log-probs use the same one", gt=0.0)
    top_p: float = _f(1.0, "nucleus sampling mass", gt=0.0, le=1.0)
    top_k: int = _f(0, "top-k sampling (0 = off)", ge=0)
    max_new_tokens: int = _f(32, "response length cap in tokens", ge=1)
    partial_chunk_tokens: int = _f(0, "trainer.partial_rollout: decode steps per chunk, the granularity at which a "
                                   "segment checks whether it has the groups its iteration needs (0 = "
                                   "max_new_tokens // 4)", ge=0)
    micro_batch_size: int = _f(32, "decode slots: most sequences per generation step (HF engine)", ge=1)
    continuous_batching: bool = _f(True, "HF engine: start the next prompts in the slots of rows that ended "
                                   "(off: each group of micro_batch_size rows decodes until its longest ends)")
    log_prob_micro_batch_size: int = _f(16, "sequences per forward when computing log-probs", ge=1)
    val_temperature: float = _f(0.0, "validation sampling temperature (0 = greedy)", ge=0.0)
    val_n: int = _f(1, "validation samples per prompt", ge=1)
    gpu_memory_utilization: float = _f(0.4, "vLLM: share of GPU memory for weights and KV cache",
                                       gt=0.0, le=1.0)
    pool: Optional[str] = _f(None, "resource pool of separate rollout workers (null = generate inside the "
                             "policy workers, sharing their weights)")
    dtype: str = _f("float32", "dtype of the weights the sampler runs: float32 shares the trained module (hf "
                    "engine); bfloat16/float16 sample from the engine's own copy in that dtype, re-synced after "
                    "every update; auto = bfloat16 where bf16 is fast, else float32", choices=PRECISION_DTYPES)
    multi_turn: MultiTurnConfig = _section(MultiTurnConfig)
    agent: Optional[str] = _f(None, "'module:function' of your own agent, called per episode as fn(task_row, "
                              "base_url, api_key) against the OpenAI-compatible endpoint the rollout serves; its "
                              "calls are recorded token-exact as multi-turn rows (docs/agents.md; command line "
                              "or your config only, never taken from a run folder)")
    agent_timeout_s: float = _f(300.0, "seconds one agent episode may run; then its calls are refused and its row "
                                "records agent_error 'timeout: ...'", gt=0.0)
    agent_concurrency: int = _f(0, "agent episodes running at once (0 = all of the batch)", ge=0)
    agent_error_reward: float = _f(0.0, "env_reward of an episode whose agent raised or timed out (the row keeps "
                                   "its sampled tokens; rollout/agent_error_frac counts them)")


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment."""

    enable: bool = _f(False, "penalise responses that enter the last `len` tokens before the cap")
    len: int = _f(8, "buffer length in tokens", ge=1)
    penalty_factor: float = _f(1.0, "maximum penalty", ge=0.0)


@dataclass
class RewardModelConfig:
    """A learned reward model, combined with the rule-based score."""

    enable: bool = _f(False, "score responses with a reward model too: score = rule_weight * rule + rm_weight * rm")
    path: Optional[str] = _f(None, "Hugging Face directory of a sequence-classification model with one label")
    rule_weight: float = _f(1.0, "weight of the rule-based (scorer) score in the combined score")
    rm_weight: float = _f(1.0, "weight of the reward model's score in the combined score")
    micro_batch_size: int = _f(8, "sequences per reward-model forward pass", ge=1)
    max_length: int = _f(2048, "prompt + response tokens scored; longer inputs keep their last tokens", ge=1)
    mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig)


@dataclass
class RewardConfig:
    """Scoring responses."""

    custom_function: Optional[str] = _f(None, "user scorer 'path/to/file.py:name' (name defaults to "
                                        "compute_score, as in verl) with verl's signature (data_source, "
                                        "solution_str, ground_truth, extra_info)")
    trust_changed_custom_function: bool = _f(False, "resume/replay even when reward.custom_function's file "
                                             "differs from the one the run recorded (command line only: "
                                             "never read from a run folder)")
    custom_function_sha256: Optional[str] = _f(None, "import reward.custom_function only if its file has this "
                                               "sha256; on resume/replay/evaluate, confirms the function the "
                                               "run's stored config names (command line only)")
    scorer: Optional[str] = _f(None, "scorer for every row, overriding the choice by data_source ('env': "
                               "a multi-turn episode's env_reward)", choices_from="scorer")
    default_scorer: Optional[str] = _f(None, "scorer for data sources with no built-in mapping")
    format_bonus: float = _f(0.1, "reasoning-gym scorer: bonus for an 'Answer:' line", ge=0.0)
    strict_format: bool = _f(True, "math_verify scorer (math and GSM8K sets): score only a stated final answer "
                             "('Answer:', '#### ', \\boxed{}); false also lets math-verify pick a number from the "
                             "whole response")
    overlong_buffer: OverlongBufferConfig = _section(OverlongBufferConfig)
    num_workers: int = _f(1, "Ray tasks that score a batch in parallel", ge=1)
    reward_model: RewardModelConfig = _section(RewardModelConfig)
    judge: JudgeConfig = _section(JudgeConfig)


@dataclass
class KLControlConfig:
    """KL-in-reward coefficient control (Ziegler et al. 2019)."""

    type: str = _f("fixed", "coefficient controller", choices=["fixed", "adaptive"])
    kl_coef: float = _f(0.001, "initial KL coefficient", ge=0.0)
    target_kl: float = _f(0.1, "adaptive: target KL per token", gt=0.0)
    horizon: int = _f(10000, "adaptive: horizon in samples", ge=1)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling."""

    enable: bool = _f(False, "drop groups whose rewards are all equal and refill the batch")
    metric: str = _f("acc", "per-response value whose spread decides: 'acc' (the scorer's accuracy, else the "
                     "score) or 'score' (the final score, after shaping)", choices=["acc", "score"])
    max_num_gen_batches: int = _f(4, "generation batches tried per iteration (0 = up to one epoch of prompts); "
                                  "when reached, train on the groups kept so far (an error if there are none)", ge=0)


@dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping."""

    adv_estimator: str = _f("grpo", "advantage estimator", choices_from="adv_estimator")
    norm_adv_by_std_in_grpo: bool = _f(True, "GRPO: divide by the group std (false = Dr. GRPO)")
    gamma: float = _f(1.0, "discount factor", ge=0.0, le=1.0)
    lam: float = _f(1.0, "GAE lambda", ge=0.0, le=1.0)
    use_kl_in_reward: bool = _f(False, "subtract kl_coef * KL(policy || reference) from token rewards")
    kl_penalty: str = _f("kl", "KL estimator for the in-reward penalty", choices_from="kl")
    kl_ctrl: KLControlConfig = _section(KLControlConfig)
    filter_groups: FilterGroupsConfig = _section(FilterGroupsConfig)
    mask_truncated_samples: bool = _f(False, "exclude responses cut at rollout.max_new_tokens (finish_reason "
                                      "'length') from the policy loss (DAPO's overlong filtering)")
    rollout_is: Optional[str] = _f(None, "rollout importance-sampling correction: weight the policy loss by "
                                   "min(pi_old / pi_rollout, threshold) per 'token' or per 'sequence'; null = off, "
                                   "except with trainer.max_staleness > 0 or a sampler with its own low-precision "
                                   "copy (rollout.dtype bfloat16/float16), where null means 'token' and 'disable' "
                                   "turns it off; 'geometric' = the geometric mean of the sequence's token ratios",
                                   choices=["token", "sequence", "geometric", "disable"])
    rollout_is_threshold: float = _f(2.0, "truncation bound C of the rollout importance weights", gt=0.0)
    opd_coef: float = _f(1.0, "adv_estimator=opd: weight lambda of the per-token reverse KL, A_t = lambda * "
                         "(log p_teacher - log p_student) (on-policy distillation)", ge=0.0)
    opd_task_coef: float = _f(0.0, "adv_estimator=opd: weight of the task reward's GRPO advantage added to every "
                              "token (0 = pure distillation; > 0 needs rollout.n >= 2)", ge=0.0)
    rollout_rs: Optional[str] = _f(None, "rollout rejection sampling: drop from the policy loss each 'token' "
                                   "(IcePop), 'sequence' (product of ratios; TRL's sequence_mask with "
                                   "rollout_rs_threshold_lower=0) or 'geometric' (geometric mean of ratios) whose "
                                   "pi_old / pi_rollout leaves [rollout_rs_threshold_lower, rollout_rs_threshold]; "
                                   "null = off", choices=["token", "sequence", "geometric"])
    rollout_rs_threshold: Optional[float] = _f(None, "upper bound of the kept rollout ratios (null = "
                                               "rollout_is_threshold)", gt=0.0)
    rollout_rs_threshold_lower: Optional[float] = _f(None, "lower bound of the kept rollout ratios (null = 1 / "
                                                     "rollout_rs_threshold)", ge=0.0)


@dataclass
class FSDPConfig:
    """FSDP2 settings of a role trained with ``strategy=fsdp2`` (verl's ``fsdp_config``)."""

    reshard_after_forward: bool = _f(True, "free each layer's gathered parameters after its forward and gather them "
                                     "again for the backward (ZeRO-3-like memory); false keeps them from forward to "
                                     "backward (ZeRO-2-like: one all-gather per layer and micro-batch less)")
    offload_params: bool = _f(False, "keep the sharded parameters, gradients and optimizer state in CPU memory "
                              "(torch CPUOffloadPolicy); the optimizer step runs on the CPU")
    fsdp_size: int = _f(-1, "ranks each parameter is sharded over; -1 = all of world_size; a divisor of "
                        "world_size gives hybrid sharding (HSDP): a 2-D mesh of world_size/fsdp_size replicas "
                        "(across nodes) x fsdp_size shards (within a node)", ge=-1)


@dataclass
class ActorConfig:
    """Policy optimisation (PPO-style)."""

    lr: float = _f(1e-5, "AdamW learning rate", gt=0.0)
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0.0)
    betas: list = _f([0.9, 0.999], "AdamW betas")
    lr_warmup_steps_ratio: float = _f(0.0, "warm the learning rate up linearly from 0 over this share of "
                                      "trainer.total_iterations (verl's optim.lr_warmup_steps_ratio)", ge=0.0, le=1.0)
    lr_warmup_steps: int = _f(-1, "warmup iterations; > 0 overrides lr_warmup_steps_ratio (verl's "
                              "optim.lr_warmup_steps)")
    warmup_style: str = _f("constant", "after the warmup: constant, or cosine decay to min_lr_ratio * lr at the "
                           "last iteration (verl's optim.warmup_style)", choices=["constant", "cosine"])
    min_lr_ratio: float = _f(0.0, "cosine's final learning rate as a share of lr (verl's optim.min_lr_ratio)",
                             ge=0.0, le=1.0)
    ppo_mini_batch_size: Optional[int] = _f(None, "prompts per optimizer step (rows = this * rollout.n); "
                                                  "unset: data.train_batch_size (one step per iteration)", ge=1)
    ppo_micro_batch_size: int = _f(8, "sequences per forward/backward (gradient accumulation)", ge=1)
    use_dynamic_bsz: bool = _f(False, "cut micro-batches by computed tokens (ppo_max_token_len_per_gpu) instead of "
                               "ppo_micro_batch_size rows")
    ppo_max_token_len_per_gpu: int = _f(16384, "with use_dynamic_bsz: most tokens a micro-batch computes (each "
                                        "distinct prompt counted once, plus every response)", ge=1)
    ppo_epochs: int = _f(1, "passes over each iteration's batch", ge=1)
    shuffle: bool = _f(False, "shuffle rows between mini-batches")
    policy_loss: str = _f("vanilla", "policy loss", choices_from="policy_loss")
    clip_ratio: float = _f(0.2, "PPO clip range (used when low/high are unset)", gt=0.0)
    clip_ratio_low: Optional[float] = _f(None, "ratio floor is 1 - clip_ratio_low (vanilla, gspo); null = the "
                                         "loss's own default (vanilla: clip_ratio, gspo: 3e-4)", ge=0.0, lt=1.0)
    clip_ratio_high: Optional[float] = _f(None, "ratio ceiling is 1 + clip_ratio_high (vanilla, gspo; cispo: the IS "
                                          "weight's); null = the loss's own default (vanilla: clip_ratio, gspo: "
                                          "4e-4, cispo: 4.0)", ge=0.0)
    clip_ratio_c: float = _f(3.0, "dual-clip bound for negative advantages", gt=1.0)
    loss_agg_mode: str = _f("token-mean", "loss aggregation",
                            choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                     "seq-mean-token-sum-norm"])
    entropy_coeff: float = _f(0.0, "entropy bonus coefficient", ge=0.0)
    kl_loss_coef: float = _f(0.0, "KL-to-reference loss coefficient (0 = no reference model)", ge=0.0)
    kl_loss_type: str = _f("low_var_kl+", "KL estimator for the loss (default: k3's value, k2's unbiased gradient; "
                           "verl's default low_var_kl has a biased gradient)", choices_from="kl")
    grad_clip: float = _f(1.0, "max global gradient norm (0 = off)", ge=0.0)
    strategy: str = _f("none", "training backend: none (one process, torch AdamW), deepspeed (ZeRO data "
                       "parallel over actor.world_size ranks) or fsdp2 (torch fully_shard over actor.world_size "
                       "ranks; actor.fsdp)", choices=["none", "deepspeed", "fsdp2"])
    zero_stage: int = _f(0, "DeepSpeed ZeRO stage: 0 (plain data parallel), 1 (optimizer states), "
                         "2 (+ gradients) or 3 (+ parameters) sharded across ranks", ge=0, le=3)
    world_size: int = _f(1, "data-parallel ranks of the policy (> 1 needs actor.strategy=deepspeed or fsdp2)", ge=1)
    pool: str = _f("default", "resource pool of the policy workers (resources.pools; 'default' = the "
                   "implicit pool when none are declared)")
    mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig)
    fsdp: FSDPConfig = _section(FSDPConfig)


@dataclass
class CriticConfig:
    """Value model (used by estimators that need values, e.g. GAE)."""

    path: Optional[str] = _f(None, "causal-LM directory whose transformer body, plus a new value head, is the "
                             "critic (default: the policy's model.path)")
    lr: float = _f(1e-5, "critic AdamW learning rate", gt=0.0)
    cliprange_value: float = _f(0.5, "value clipping range", gt=0.0)
    ppo_epochs: int = _f(1, "critic passes per iteration", ge=1)
    ppo_micro_batch_size: int = _f(8, "sequences per critic forward/backward", ge=1)
    grad_clip: float = _f(1.0, "critic max gradient norm (0 = off)", ge=0.0)
    pool: Optional[str] = _f(None, "resource pool of the critic (null = the actor's pool)")
    strategy: str = _f("none", "training backend: none (one process) or fsdp2 (torch fully_shard over one rank per "
                       "slot of the critic's pool; critic.fsdp)", choices=["none", "fsdp2"])
    mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig)
    fsdp: FSDPConfig = _section(FSDPConfig)


@dataclass
class ReferenceConfig:
    """Frozen reference policy for KL."""

    path: Optional[str] = _f(None, "reference model (default: model.path)")
    pool: Optional[str] = _f(None, "resource pool of the reference workers (null = the actor's pool)")
    strategy: str = _f("none", "how each reference worker holds the model: none (a whole copy per worker) or fsdp2 "
                       "(torch fully_shard over one rank per slot of the reference's pool; reference.fsdp)",
                       choices=["none", "fsdp2"])
    fsdp: FSDPConfig = _section(FSDPConfig)
    mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig)


@dataclass
class TeacherConfig:
    """Teacher policy for on-policy distillation (algorithm.adv_estimator=opd)."""

    path: Optional[str] = _f(None, "teacher model (a Hugging Face directory or a known model name); needs the "
                             "policy's tokenizer")
    pool: Optional[str] = _f(None, "resource pool of the teacher workers (null = the actor's pool)")
    mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig)


@dataclass
class TrainerConfig:
    """The training loop."""

    total_iterations: int = _f(20, "iterations to train (each: rollout, reward, advantage, update)", ge=1)
    save_freq: int = _f(10, "checkpoint every this many iterations and after the last (0 = never: ~1.6 GB less "
                        "per checkpoint of SmolLM2-135M, but the run cannot be resumed or continued and a replay "
                        "has no checkpoint to start from; final/ still holds the trained model)", ge=0)
    test_freq: int = _f(5, "validate every this many iterations (0 = no validation)", ge=0)
    val_before_train: bool = _f(True, "validate before the first iteration (when test_freq > 0)")
    seed: int = _f(42, "seed for data order, sampling and initialisation", ge=0, le=2**32 - 1)
    max_checkpoints: int = _f(1, "checkpoints kept (0 = keep all); the newest is never deleted (what resume "
                              "needs); a replay of iteration N needs checkpoint N-1, so keep more for runs you "
                              "mean to replay", ge=0)
    keep_best: Optional[str] = _f(None, "also keep the best checkpoint by this validation metric (e.g. "
                                  "val-core/reasoning_gym/basic_arithmetic/acc/mean_at_1; verl's @ is read as _at_), scored by the "
                                  "validation of "
                                  "its own iteration (save_freq a multiple of test_freq); its iteration is "
                                  "run.json's best_checkpoint")
    keep_best_mode: str = _f("max", "whether a higher (max) or lower (min) keep_best metric is better",
                             choices=["max", "min"])
    max_nonfinite_steps: int = _f(3, "stop after this many optimizer steps in a row skipped for a non-finite "
                                     "gradient norm", ge=1)
    resume: str = _f("disable", "resume a run with the same run_id", choices=["disable", "auto"])
    run_id: Optional[str] = _f(None, "run id (default: generated from time and recipe)")
    device: str = _f("cpu", "torch device for workers", choices=["cpu", "cuda", "npu"])
    num_threads: int = _f(0, "torch threads per worker (0 = the worker's CPUs)", ge=0)
    project_name: Optional[str] = _f(None, "MLflow experiment the run is filed under, as verl's trainer.project_name "
                                     "(default: trajflow/<recipe>)")
    experiment_name: Optional[str] = _f(None, "MLflow run name, as verl's trainer.experiment_name (default: the "
                                        "trajflow run id; the run is also tagged trajflow.run_id)")
    logger: Any = _f(["console", "mlflow"], "where metrics go, as verl's trainer.logger: console (the step:N line "
                     "per step), mlflow (the run's record, which resume, compare, evaluate and the dashboard "
                     "read: required), tensorboard (scalars in <run>/tensorboard, or $TENSORBOARD_DIR) and wandb "
                     "(W&B, offline unless $WANDB_MODE says otherwise, in <run>/wandb, or $WANDB_DIR); both "
                     "need pip install 'trajflow[loggers]'; a single name is read as a list of one")
    log_samples: int = _f(4, "sample generations logged per iteration", ge=0)
    log_val_generations: int = _f(8, "validation generations (prompt, response, ground truth, score) logged "
                                  "to MLflow each time validation runs (verl's name)", ge=0)
    progress: bool = _f(True, "live progress line per iteration")
    stage_retries: int = _f(2, "retries of a stage task after a transient failure (a Ray worker died, "
                            "a stage timed out); dead workers are recreated from the newest checkpoint", ge=0)
    stage_retry_delay_s: float = _f(5.0, "seconds between a failed stage attempt and its retry", ge=0.0)
    stage_timeout_s: float = _f(3600.0, "wall-clock limit of one stage attempt in seconds (0 = none)", ge=0.0)
    precision_auto: Optional[str] = _f(None, "recorded, not an input: how the 'auto' dtypes were resolved when the "
                                       "run started (set by trajflow)")
    max_staleness: int = _f(0, "policy versions a rollout may lag behind the trainer: 0 = synchronous (rollout, "
                            "then update); N >= 1 = the rollouts of iterations k+1..k+N are queued on the rollout "
                            "workers (rollout.pool) while iteration k updates, each generated N policy versions "
                            "behind the update that uses it (docs/overlap.md)", ge=0)
    partial_rollout: bool = _f(False, "partial rollouts (needs max_staleness >= 1): the rollout workers keep a pool "
                               "of groups in flight across weight updates; each iteration takes the oldest "
                               "completed groups it needs and unfinished rows continue under the next weights "
                               "(max_staleness bounds each row's oldest token; docs/partial_rollout.md)")
    device_peak_tflops: Optional[float] = _f(None, "peak dense TFLOP/s of one training device, the denominator of "
                                             "perf/mfu/actor; null = a known GPU's bf16 peak (H100 989, A100 "
                                             "312, ...), none on CPU (then no perf/mfu/actor)", gt=0.0)
    stage_timeouts: dict = _f({}, "per-stage limits in seconds overriding stage_timeout_s, e.g. "
                              "{update_actor: 1800}; stages: " + ", ".join(STAGE_NAMES))


@dataclass
class ResourcesConfig:
    """Where the Ray workers run."""

    ray_address: Optional[str] = _f(None, "existing Ray cluster address (default: start a local Ray)")
    num_cpus: Optional[int] = _f(None, "CPUs for a local Ray (default: all)", ge=1)
    actor_num_cpus: float = _f(1.0, "CPUs reserved by the policy worker", gt=0.0)
    placement: str = _f("colocated", "colocated: all roles share the actor's pool (bundles split between "
                        "them); split: each role on its own pool", choices=["colocated", "split"])
    pools: dict = _f({}, "resource pools: name -> {nodes, devices_per_node, device: cpu|gpu|<custom Ray "
                     "resource, e.g. NPU>, num_cpus_per_worker}; empty = one local pool")
    placement_timeout_s: float = _f(300.0, "seconds to wait for a pool's placement groups before failing", gt=0.0)
    allocator: str = _f("auto", "memory allocator preloaded into the Ray workers: auto (tcmalloc if the system "
                        "has it, else the system's), system, or the path of a shared library "
                        "(see trajflow/infra/allocator.py)")
    release_memory: str = _f("auto", "whether the policy worker hands its freed heap back to the OS after each "
                             "rollout and update: always, never, or auto (when other model workers, a critic, "
                             "reference, reward model or rollout pool, hold memory in the phases between)",
                             choices=["auto", "always", "never"])
    ray_system_config: dict = _f({}, "Ray's RayConfig settings for a local Ray, over trajflow's (no workers prestarted, "
                                 "reward.num_workers idle workers kept; trajflow/infra/ray_cluster.py)")


@dataclass
class StoreConfig:
    """The run store (Parquet stage outputs, manifests, checkpoints)."""

    root: str = _f("runs", "directory holding one folder per run")


@dataclass
class TrackingConfig:
    """MLflow."""

    uri: Optional[str] = _f(None, "MLflow tracking URI (default: sqlite:///<store.root>/mlflow.db)")
    ui_url: Optional[str] = _f(None, "MLflow UI base URL for links in Prefect artifacts, e.g. "
                               "http://mlflow.internal:5000 (default: no link, the MLflow run id only)")
    system_metrics: bool = _f(True, "log MLflow's system metrics (system/cpu_utilization_percentage, memory, disk, "
                              "network, GPU) for the driver's machine")
    system_metrics_interval_s: float = _f(10.0, "seconds between system-metric samples", gt=0.0)
    log_model: bool = _f(True, "record the final model in MLflow as a LoggedModel of the run, linked to its metrics")
    model_copy: bool = _f(False, "also copy the final model's weights into MLflow's artifact store as a "
                          "transformers-flavour model (mlflow.transformers.load_model reads it; ~0.5 GB for "
                          "SmolLM2-135M); false: the LoggedModel points at the run's final/ folder, no second copy")
    register_model: Optional[str] = _f(None, "register the final model under this name in the MLflow model "
                                       "registry (a new version per run); needs tracking.log_model and "
                                       "tracking.model_copy (the registry serves copies)")


@dataclass
class GatesConfig:
    """Data-quality gates on reward outputs (Great Expectations)."""

    enabled: bool = _f(True, "validate each iteration's rewards before the policy update")
    suite: Optional[str] = _f(None, "expectation suite file (default: datasets/expectations/)")
    score_min: float = _f(-10.0, "lowest allowed score")
    score_max: float = _f(10.0, "highest allowed score")
    max_equal_group_frac: float = _f(0.9, "max share of groups whose rewards are all equal", ge=0.0, le=1.0)
    max_truncated_frac: float = _f(0.5, "max share of responses cut at max_new_tokens", ge=0.0, le=1.0)
    max_error_rate: float = _f(0.5, "max share of rows whose scorer raised", ge=0.0, le=1.0)
    drift_band: float = _f(1.0, "max |mean score - mean of previous iterations|", ge=0.0)
    drift_window: int = _f(5, "previous iterations averaged for the drift check", ge=1)
    policies: dict = _f({}, "expectation name -> fail|warn|quarantine (overrides the defaults)")
    data_docs: str = _f("on_failure", "write Great Expectations' HTML data docs (~4 MB) beside an iteration's "
                        "gate.json: when its gate fails, also when one only warns, or never (gate.json holds the "
                        "same results)", choices=["on_failure", "on_warning", "never"])


@dataclass
class TrajflowConfig:
    """A whole run."""

    recipe: str = _f(DEFAULT_RECIPE, "recipe name (set from the recipe file)")
    model: ModelConfig = _section(ModelConfig)
    data: DataConfig = _section(DataConfig)
    rollout: RolloutConfig = _section(RolloutConfig)
    reward: RewardConfig = _section(RewardConfig)
    algorithm: AlgorithmConfig = _section(AlgorithmConfig)
    actor: ActorConfig = _section(ActorConfig)
    critic: CriticConfig = _section(CriticConfig)
    reference: ReferenceConfig = _section(ReferenceConfig)
    teacher: TeacherConfig = _section(TeacherConfig)
    trainer: TrainerConfig = _section(TrainerConfig)
    resources: ResourcesConfig = _section(ResourcesConfig)
    store: StoreConfig = _section(StoreConfig)
    tracking: TrackingConfig = _section(TrackingConfig)
    gates: GatesConfig = _section(GatesConfig)



#: The config sections with a ``mixed_precision`` sub-section (full key prefixes).
PRECISION_SECTIONS = ("actor", "critic", "reference", "teacher", "reward.reward_model")


def _all_keys(cls: type = TrajflowConfig, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        keys.append(path)
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            keys.extend(_all_keys(f.default_factory, path + "."))
    return keys


def _closest(key: str) -> str:
    keys = _all_keys()
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not match:
        leaf = key.rsplit(".", 1)[-1]
        match = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    return f" (did you mean '{match[0]}'?)" if match else ""


def _field_for(key: str) -> dataclasses.Field | None:
    cls: Any = TrajflowConfig
    f = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        f = {x.name: x for x in dataclasses.fields(cls)}.get(part)
        if f is None:
            return None
        cls = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if not dataclasses.is_dataclass(cls):
            cls = None
    return f


def _expected_type(key: str) -> str:
    f = _field_for(key)
    if f is None:
        return "value"
    t = str(f.type)
    for name in ("bool", "int", "float", "str", "list", "dict"):
        if name in t:
            return {"str": "string"}.get(name, name)
    return t



def key_help(cls: Any = TrajflowConfig, prefix: str = "") -> list[str]:
    """One line per config key, in schema order: ``key (type, default value): help`` plus its range or
    choices (``trajflow config --help-keys``)."""
    lines = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            lines += key_help(sub, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else (sub() if sub else None)
        meta = f.metadata
        limits = [f"{sym} {meta[k]}" for k, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                  if meta.get(k) is not None]
        if meta.get("choices"):
            limits.append("one of " + ", ".join(map(str, meta["choices"])))
        if meta.get("choices_from"):
            limits.append(f"a registered {meta['choices_from']}")
        extra = f" [{'; '.join(limits)}]" if limits else ""
        lines.append(f"{prefix}{f.name} ({_expected_type(prefix + f.name)}, default {default!r}): "
                     f"{meta.get('help', '')}{extra}")
    return lines
