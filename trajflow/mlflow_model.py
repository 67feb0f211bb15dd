"""The run's policy as an MLflow 3 LoggedModel: created when the MLflow run starts (every metric is
logged with its ``model_id``, so the model's page lists the run's metrics), finalised when the
run ends, by reference or as a copy.

By reference (the default, ``tracking.model_copy=false``) the LoggedModel holds no weights: its
tags ``trajflow.model_path`` (the run's ``final/``, a Hugging Face model directory) and
``trajflow.run_id`` say where the model is, so the ~0.5 GB of SmolLM2-135M is on disk once.
With ``tracking.model_copy=true`` the final model is also saved in MLflow's transformers flavour
into the LoggedModel's artifacts (``mlflow.transformers.load_model("models:/<model_id>")`` loads
it back), which the model registry (``tracking.register_model``) needs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

#: The LoggedModel's name (one per trajflow run; its tags name the run).
MODEL_NAME = "policy"
#: Run tag holding the LoggedModel's id, so a resumed session keeps logging to the same model.
TAG_MODEL_ID = "trajflow.model_id"
#: LoggedModel tag: the folder that holds the final model (by reference).
TAG_MODEL_PATH = "trajflow.model_path"
#: LoggedModel tag of a finished run's final model once the run trains further: the newer model's id.
TAG_SUPERSEDED_BY = "trajflow.superseded_by"


def create_policy_model(client: Any, experiment_id: str, mlflow_run_id: str, run_id: str, cfg: Any) -> str:
    """Create the run's LoggedModel (status PENDING until :func:`finalize_policy_model`).

    Args:
        client: an ``MlflowClient``.
        experiment_id, mlflow_run_id: where the run is.
        run_id: the trajflow run id.
        cfg: the run config (its model, recipe and algorithm become the model's params).

    Returns:
        The LoggedModel's id (``m-<hex>``).
    """
    params = {"base_model": str(cfg.model.path), "recipe": str(cfg.recipe),
              "adv_estimator": str(cfg.algorithm.adv_estimator), "lora_rank": str(cfg.model.lora_rank)}
    model = client.create_logged_model(experiment_id, name=MODEL_NAME, source_run_id=mlflow_run_id,
                                       tags={"trajflow.run_id": run_id}, params=params, model_type="text-generation")
    return model.model_id


def model_is_final(client: Any, model_id: str) -> bool:
    """Whether the LoggedModel ``model_id`` was finalised READY (an earlier session ended the run with
    it); False for a PENDING one or one MLflow no longer has."""
    from mlflow.entities import LoggedModelStatus

    try:
        return client.get_logged_model(model_id).status == LoggedModelStatus.READY
    except Exception:  # deleted or unreadable: the session starts a new model rather than fail
        return False


def finalize_policy_model(client: Any, mlflow_run_id: str, model_id: str, model_dir: str | Path, step: int, *,
                          copy: bool, description: str = "") -> str:
    """Point the LoggedModel at ``model_dir`` (or copy the model into it), mark it READY and record
    it as the run's output at ``step``.

    Args:
        client: an ``MlflowClient``.
        mlflow_run_id: the run whose output the model is.
        model_id: from :func:`create_policy_model`.
        model_dir: the exported Hugging Face model directory (the run's ``final/``).
        step: the iteration the model is the policy after.
        copy: also save the model in MLflow's transformers flavour into the model's artifacts.
        description: the model card's text (copy only).

    Returns:
        ``models:/<model_id>``.
    """
    from mlflow.entities import LoggedModelOutput

    client.set_logged_model_tags(model_id, {TAG_MODEL_PATH: str(Path(model_dir).resolve()),
                                            "trajflow.stored": "copy" if copy else "reference"})
    if copy:
        with tempfile.TemporaryDirectory(prefix="trajflow-mlflow-model-") as tmp:
            out = Path(tmp) / "model"
            save_transformers_model(model_dir, out, description)
            client.log_model_artifacts(model_id, str(out))
    client.finalize_logged_model(model_id, "READY")
    client.log_outputs(mlflow_run_id, [LoggedModelOutput(model_id, int(step))])
    return f"models:/{model_id}"


def fail_policy_model(client: Any, model_id: str) -> None:
    """Mark the LoggedModel FAILED (the run ended without a final model)."""
    client.finalize_logged_model(model_id, "FAILED")


def save_transformers_model(model_dir: str | Path, out: Path, description: str = "") -> None:
    """Save ``model_dir`` as an MLflow transformers-flavour model (task ``text-generation``) in ``out``.

    The model is loaded here (on the CPU, in its stored dtype) because MLflow's local-checkpoint
    path does not support this transformers version; call this after the workers have released
    their memory. An explicit card and requirements: MLflow would otherwise ask the Hub for a card
    and import-trace the model in a subprocess to infer requirements.
    """
    import mlflow.transformers
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the console shows the run, not transformers' load/save bars
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        mlflow.transformers.save_model({"model": model, "tokenizer": tokenizer}, str(out), task="text-generation",
                                       pip_requirements=_model_requirements(),
                                       model_card=ModelCard(f"---\nlicense: other\n---\n{description}\n"))
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def register_policy_model(client: Any, mlflow_run_id: str, model_id: str, name: str, description: str = "") -> str:
    """Register a copied LoggedModel under ``name`` (a new version per call).

    Returns:
        ``models:/<name>/<version>``.
    """
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = client.get_logged_model(model_id).artifact_location
    version = client.create_model_version(name, source, run_id=mlflow_run_id, model_id=model_id,
                                          description=description or None)
    client.set_tag(mlflow_run_id, "trajflow.registered_model", f"{name}/{version.version}")
    return f"models:/{name}/{version.version}"


def _model_requirements() -> list[str]:
    from importlib.metadata import version

    out = []
    for dist in ("torch", "transformers", "safetensors", "tokenizers"):
        try:
            out.append(f"{dist}=={version(dist)}")
        except Exception:
            out.append(dist)
    return out
