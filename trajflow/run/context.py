"""The driver's live run: config, store, workers and typed state, looked up by run id from the tasks.

Prefect tasks receive only a run id and small references; they find the live objects here
(:func:`get_context`), so no actor handle or tensor is ever hashed, serialised or persisted by Prefect.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trajflow.store import RunStore


@dataclass(slots=True)
class IterationState:
    """What one iteration's stages hand each other inside the driver; created by
    :func:`trajflow.run.iteration.begin_iteration` and dropped when the iteration is recorded.

    Attributes:
        iteration: the iteration number.
        prompts: the prompt records drawn for it (``PromptRecord``).
        started: ``time.perf_counter()`` when it began (``timing_s/step``).
        sampler_before_rollout: the data cursor before the rollout drew anything, so that every
            attempt of the rollout (first, retry) draws the same extra batches.
        timing: ``timing_s/*`` of its stages, seconds.
        prescored: ``sample_id -> (rule score, reward extra, reward-model score)`` computed by dynamic
            sampling; the reward stage reuses them instead of scoring again.
        rollout_metrics: metrics of the rollout stage (dynamic sampling's ``batch/*``).
        reward_metrics: metrics of the reward stage (``critic/kl``, overlong shaping, scorer errors).
        gate_score_mean: the gate's mean of finite scores (the drift check's history), or None.
        critic_update: the critic update's metrics once it ran (a retried update must not update the
            critic twice), else None.
        behaviour_version: ``trainer.max_staleness`` > 0: the policy version the rollout must be
            generated with (fixed when the rollout is submitted, while the trainer moves on); None:
            the trainer's current version (synchronous).
        behaviour_weights: the ``ObjectRef`` of that version's weights (a snapshot taken when the
            rollout was submitted), which the rollout loads into the rollout workers before it
            generates; None when they will hold that version already.
        use_version: ``trainer.partial_rollout``: the trainer's version at the update that will use the
            iteration's rows (fixed by the schedule when the rollout is submitted); None otherwise.
    """

    iteration: int
    prompts: list
    started: float
    sampler_before_rollout: dict | None = None
    timing: dict[str, float] = field(default_factory=dict)
    prescored: dict[str, tuple] = field(default_factory=dict)
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    reward_metrics: dict[str, float] = field(default_factory=dict)
    gate_score_mean: float | None = None
    critic_update: dict[str, float] | None = None
    behaviour_version: int | None = None
    behaviour_weights: Any = None
    use_version: int | None = None


@dataclass(slots=True)
class RunState:
    """What lives for the whole run besides the workers.

    Attributes:
        policy_source: the checkpoint id the live policy descends from (``initial``,
            ``checkpoint-000010``, or ``<parent run>/checkpoint-…`` in a replay); recorded with each rollout.
        start_iteration: the first iteration this process trains.
        last_iteration: the last one (``trainer.total_iterations``, or a replay's last).
        trained_iterations, skipped_iterations: what this process trained, and skipped as gated.
        nothing_to_do: the run had already finished every iteration.
        last_metrics: the metrics of the newest recorded iteration.
        initial_checkpoint: an actor checkpoint folder a derived run (replay) starts from: a recreated
            policy worker loads it before re-applying this run's stored updates.
        policy_only: only the policy worker is needed (evaluation): no reference, critic or reward model.
        deadline: ``time.monotonic()`` by which the running stage attempt must finish, or None; per
            thread, since an overlapped rollout (``trainer.max_staleness`` > 0) runs next to the update.
        workers_lost: roles dropped after a failed stage attempt, to be recreated by the retry.
        progress: the console progress line (:class:`trajflow.run.progress.Progress`), or None.
        gate_thresholds_logged: the gate's expectations and thresholds are on the MLflow run as tags.
        gate_outcomes: each expectation's worst outcome in the run so far (``passed``, ``warned``,
            ``quarantined``, ``failed``), as its MLflow tag says; None until read from the run.
    """

    policy_source: str = "initial"
    start_iteration: int = 1
    last_iteration: int = 0
    trained_iterations: list[int] = field(default_factory=list)
    skipped_iterations: list[int] = field(default_factory=list)
    nothing_to_do: bool = False
    last_metrics: dict[str, float] = field(default_factory=dict)
    initial_checkpoint: str | None = None
    policy_only: bool = False
    _deadlines: Any = field(default_factory=threading.local, repr=False)
    workers_lost: list[str] = field(default_factory=list)
    progress: Any = None
    gate_thresholds_logged: bool = False
    gate_outcomes: dict[str, str] | None = None

    @property
    def deadline(self) -> float | None:
        return getattr(self._deadlines, "value", None)

    @deadline.setter
    def deadline(self, value: float | None) -> None:
        self._deadlines.value = value


@dataclass(slots=True)
class RunContext:
    """Everything a running flow needs between tasks: inputs, live workers, typed state.

    The worker attributes are :class:`~trajflow.workers.group.WorkerGroup` s (called like one Ray
    actor handle) or plain Ray actor handles, ``None`` while not running.
    """

    cfg: DictConfig
    store: RunStore
    model_path: str
    actor: Any = None            # WorkerGroup of PolicyWorker ranks (actor + rollout)
    reference: Any = None        # WorkerGroup of ReferenceWorker ranks (None without KL)
    critic: Any = None           # CriticWorker (None unless the estimator needs values)
    reward_model: Any = None     # RewardModelWorker (None unless reward.reward_model.enable)
    judge: Any = None            # JudgeWorker (None unless reward.judge.model_path and the judge is on)
    judge_endpoint: Any = None   # (base_url, token) of the judge worker's endpoint while it runs
    rollout: Any = None          # WorkerGroup of RolloutWorker ranks (rollout.pool set), else None
    teacher: Any = None          # WorkerGroup of ReferenceWorker ranks serving the teacher (adv_estimator=opd)
    placement: Any = None        # trajflow placement of roles on resource pools, made on first use
    tracker: Any = None          # trajflow.tracking.Tracker
    sampler: Any = None          # trajflow.prompts.PromptSampler (the data cursor)
    datasets: Any = None         # trajflow.prompts.PromptDatasets
    kl_ctrl: Any = None          # trajflow.stages.kl controller (KL in reward)
    score_history: list[float] = field(default_factory=list)
    policy_version: int = 0
    started_ray: bool = False
    state: RunState = field(default_factory=RunState)
    iterations: dict[int, IterationState] = field(default_factory=dict)
    context_id: str | None = None  # what tasks look the context up by; None = the run id

    @property
    def run_id(self) -> str:
        return self.store.run_id

    @property
    def key(self) -> str:
        """The registry key: the run id, or the context's own id (an evaluation of a run that may be
        training in the same process)."""
        return self.context_id or self.run_id

    def iteration(self, iteration: int) -> IterationState:
        """The live state of ``iteration``.

        Raises:
            RuntimeError: the iteration was not begun in this process (a task called out of order).
        """
        try:
            return self.iterations[iteration]
        except KeyError:
            raise RuntimeError(f"run {self.run_id}: iteration {iteration} was not begun in this process "
                               f"(live: {sorted(self.iterations) or 'none'})") from None

    def plain(self, section: str) -> dict:
        """A config section as a plain dict (what pure stage functions and cache keys receive)."""
        return OmegaConf.to_container(self.cfg[section], resolve=True)  # type: ignore[return-value]

    def reward_settings(self) -> dict:
        """The ``reward`` section as the scorers receive it: a dataset spec may name the scorer of its
        data sources (e.g. a custom file dataset), used when ``reward.default_scorer`` is unset."""
        out = self.plain("reward")
        out.pop("trust_changed_custom_function", None)  # says whether to run, not how to score
        if out.get("scorer") is None:  # unset: the digests of runs stored before the key existed still match
            out.pop("scorer", None)
        if not (out.get("judge") or {}).get("enable"):  # likewise for runs stored before reward.judge existed
            out.pop("judge", None)
        if not out.get("default_scorer") and self.datasets is not None:
            out["default_scorer"] = self.datasets.spec.get("scorer")
        return out

    def needs_reference(self) -> bool:
        """A KL term (in the loss or in the reward) needs the reference policy's log-probs."""
        return self.cfg.actor.kl_loss_coef > 0 or bool(self.cfg.algorithm.use_kl_in_reward)

    def reference_in_actor(self) -> bool:
        """Under LoRA the policy with its adapters disabled is the reference (verl's ``ref_in_actor``):
        no reference worker, unless ``reference.path`` names another model."""
        return self.needs_reference() and self.cfg.model.lora_rank > 0 and not self.cfg.reference.path

    def needs_reference_worker(self) -> bool:
        from trajflow.infra.placement import role_enabled

        return role_enabled(self.cfg, "reference")

    def needs_critic(self) -> bool:
        """The advantage estimator needs a critic's values (registry metadata of the estimator)."""
        from trajflow.stages.advantage import needs_values

        return needs_values(self.cfg.algorithm.adv_estimator)

    def needs_greedy_baseline(self) -> bool:
        """The estimator needs a greedy rollout's reward as a per-prompt baseline (ReMax)."""
        from trajflow.stages.advantage import needs_greedy_baseline

        return needs_greedy_baseline(self.cfg.algorithm.adv_estimator)

    def needs_teacher(self) -> bool:
        """On-policy distillation (``algorithm.adv_estimator=opd``) scores the samples with a teacher."""
        from trajflow.infra.placement import role_enabled

        return role_enabled(self.cfg, "teacher")

    def needs_reward_model(self) -> bool:
        return bool(self.cfg.reward.reward_model.enable)

    def needs_judge_worker(self) -> bool:
        """The LLM judge is on and trajflow serves it (``reward.judge.model_path``)."""
        judge = self.cfg.reward.judge
        return bool(judge.enable and judge.get("model_path"))

    def release_memory(self) -> bool:
        """Whether the policy worker returns its freed heap to the OS between phases
        (``resources.release_memory``; ``auto``: when another model worker holds memory meanwhile).

        Releasing does not lower the policy worker's own peak (an update allocates the same pages
        again, zero-filled: ~0.5 s of a 4 s bf16 update on 2 CPU cores); it lowers what the worker
        holds while a critic, a reference, a reward model or rollout workers run, which is when their
        peaks fall. With none of them the default GRPO recipe keeps its pages.
        """
        setting = str(self.cfg.resources.get("release_memory", "auto"))
        if setting != "auto":
            return setting == "always"
        return bool(self.needs_critic() or self.needs_reference_worker() or self.needs_reward_model() or self.needs_teacher()
                    or self.cfg.rollout.pool is not None)


_CONTEXTS: dict[str, RunContext] = {}


def register(ctx: RunContext) -> None:
    """Make ``ctx`` findable by its key (:attr:`RunContext.key`) from the tasks of this process."""
    _CONTEXTS[ctx.key] = ctx


def get_context(key: str) -> RunContext:
    """The live context registered under ``key`` (a run id, or an evaluation's id).

    Raises:
        RuntimeError: nothing is live under ``key`` in this process.
    """
    try:
        return _CONTEXTS[key]
    except KeyError:
        raise RuntimeError(f"no live run context for run {key!r} in this process") from None


def unregister(ctx: RunContext) -> None:
    _CONTEXTS.pop(ctx.key, None)
