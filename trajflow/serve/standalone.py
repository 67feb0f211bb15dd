"""A model served on its own behind trajflow's OpenAI-compatible endpoint, outside any training run:
for instance the LLM judge of ``reward.judge`` on a machine without another inference server.

    python -m trajflow.serve.standalone MODEL [--port 8000] [--token-env JUDGE_KEY] [--max-new-tokens 512]

``MODEL`` is anything ``model.path`` takes (a Hugging Face directory or a built-in name such as
``smollm2-135m-instruct``). The server listens on 127.0.0.1 only; requests must carry the bearer token
(the value of ``--token-env``'s variable, else a random one printed at start). Calls need no session:
each is served on its own (chat and text completions, ``n``, ``stop``, ``logprobs``, ``top_logprobs``,
``stream``), sampled with the request's ``temperature``/``top_p`` by the HF engine's decode loop;
greedy (``temperature: 0``) replies are deterministic. Concurrent calls are batched into one
``generate`` (the same :class:`~trajflow.serve.batching.GenerationQueue` as in training).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading
from typing import Sequence

import torch


class ModelServer:
    """A causal LM served by :class:`~trajflow.serve.app.AgentServer` from background threads.

    Args:
        model_dir: a Hugging Face model directory.
        token: the bearer token (default: a random one).
        max_new_tokens: most tokens one call samples.
        micro_batch_size: decode slots of the HF engine.
        seed: base seed of the engine calls.
        threads: torch threads (0 = leave torch's setting).

    Attributes:
        server: the :class:`~trajflow.serve.app.AgentServer` (``base_url``, ``token``) once started.
    """

    def __init__(self, model_dir: str, token: str | None = None, max_new_tokens: int = 512, micro_batch_size: int = 8,
                 seed: int = 0, threads: int = 0) -> None:
        self.model_dir = str(model_dir)
        self.token = token or secrets.token_urlsafe(32)
        self.max_new_tokens = int(max_new_tokens)
        self.micro_batch_size = int(micro_batch_size)
        self.seed = int(seed)
        self.threads = int(threads)
        self.server = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, port: int = 0) -> "ModelServer":
        """Load the model and serve it on 127.0.0.1:``port`` (0 = a free port); returns once it accepts calls."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trajflow.engines.hf import HFRolloutEngine
        from trajflow.serve.app import AgentServer
        from trajflow.serve.batching import GenerationQueue
        from trajflow.serve.top_logprobs import teacher_forced_top_logprobs

        if self.threads:
            torch.set_num_threads(self.threads)
        tok = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = [tok.eos_token_id]
        engine = HFRolloutEngine(model, pad, eos, micro_batch_size=self.micro_batch_size)
        queue = GenerationQueue(engine.generate, seed=self.seed, window_s=0.02,
                                top_logprobs=lambda *a: teacher_forced_top_logprobs(model, *a))
        self.server = AgentServer(tok, eos, open_budget=self.max_new_tokens)
        self.server.token = self.token
        self.server.start(port)
        self.server.attach(queue, None)  # each request's own sampling settings
        self._thread = threading.Thread(target=lambda: torch.no_grad()(queue.serve)(self._stop.is_set, lambda: 1),
                                        daemon=True, name="trajflow-model-server")
        self._thread.start()
        return self

    @property
    def base_url(self) -> str:
        """The OpenAI ``base_url`` (``http://127.0.0.1:<port>/v1``)."""
        return f"{self.server.base_url}/v1"

    def stop(self) -> None:
        """Stop serving (the engine thread ends once its batch is done)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.server is not None:
            self.server.detach()
            self.server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trajflow.serve.standalone", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a Hugging Face model directory or a built-in model name (model.path)")
    ap.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0 = a free one)")
    ap.add_argument("--token-env", default=None, help="environment variable holding the bearer token "
                                                      "(default: a random token, printed)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    from trajflow.models import resolve_model_path

    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            print(f"error: --token-env {args.token_env}: the environment variable is not set", file=sys.stderr)
            return 2
    path = resolve_model_path(args.model)
    s = ModelServer(str(path), token, args.max_new_tokens, args.micro_batch_size, threads=args.threads).start(args.port)
    print(f"serving {args.model} at {s.base_url}" + ("" if token else f" (token {s.token})"), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
