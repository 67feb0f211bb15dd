"""Prompt datasets: specs under ``datasets/`` (:mod:`.spec`), loading (:mod:`.loading`) and the
epoch-based data cursor (:mod:`.sampler`)."""

from trajflow.errors import DataError
from trajflow.prompts.loading import load_prompt_dataset
from trajflow.prompts.sampler import PromptSampler
from trajflow.prompts.spec import (DATASETS_DIR, PromptDatasets, PromptRecord, data_spec, list_dataset_specs,
                                   load_spec, resolve_spec_path)

__all__ = ["DATASETS_DIR", "DataError", "PromptDatasets", "PromptRecord", "PromptSampler", "data_spec",
           "list_dataset_specs",
           "load_prompt_dataset", "load_spec", "resolve_spec_path"]
