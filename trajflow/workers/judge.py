"""The judge worker: the LLM judge of ``reward.judge.model_path``, served for the whole run.

Only created when ``reward.judge.enable`` is true and ``reward.judge.model_path`` names the judge
model (instead of ``reward.judge.base_url``, an endpoint the user runs). The actor loads the model
and serves it with trajflow's OpenAI-compatible endpoint (:class:`trajflow.serve.standalone.ModelServer`:
the same :class:`~trajflow.serve.app.AgentServer` and HF decode loop as the rollout's endpoint) on
``127.0.0.1`` with the run's own bearer token; the reward stage's judge scorer
(:func:`trajflow.stages.judge.judge_scores`) calls it with the real ``openai`` client. The worker is
stopped with the run's other workers. It runs on the driver's Ray node (the scorer calls loopback)
and on the CPU.
"""

from __future__ import annotations

from trajflow.workers.base import Worker


class JudgeWorker(Worker):
    """A generative judge model behind an OpenAI-compatible endpoint on loopback (a Ray actor).

    Args:
        model_dir: Hugging Face directory of the judge model (a causal LM with a chat template).
        token: the bearer token every request must carry (a fresh random value per run, made by the
            driver; never written to the run folder).
        max_new_tokens: most tokens one judge reply samples (``reward.judge.max_tokens``).
        num_threads: torch threads (0 = all CPUs).
        seed: base seed of the engine's calls (requests also carry ``reward.judge.seed``).

    Raises:
        trajflow.errors.ModelLoadError: the directory does not load as a causal LM.
    """

    def __init__(self, model_dir: str, token: str, max_new_tokens: int, num_threads: int = 0, seed: int = 0) -> None:
        from trajflow.errors import ModelLoadError
        from trajflow.serve.standalone import ModelServer

        self._start("cpu", num_threads)  # the standalone server's HF engine runs the model on the CPU
        try:
            self.server = ModelServer(model_dir, token, max_new_tokens, seed=seed).start(0)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"reward.judge.model_path: {model_dir} does not load as a causal language model "
                                 f"({type(e).__name__}: {e})") from None

    def base_url(self) -> str:
        """The endpoint's OpenAI ``base_url`` (``http://127.0.0.1:<port>/v1``), reachable from this node only."""
        return self.server.base_url

    def stop(self) -> None:
        """Stop serving (the run's end; killing the actor does the same)."""
        self.server.stop()
