"""Server-mode rollout: the rollout engine behind an OpenAI-compatible endpoint, for agents written
against the OpenAI API (``rollout.agent``), with every call recorded token-exact.

- :mod:`trajflow.serve.chat`: OpenAI messages <-> the chat template's text; tool calls; stop strings.
- :mod:`trajflow.serve.sessions`: the tokens fed and sampled per episode, and the row built from them.
- :mod:`trajflow.serve.batching`: requests of many episodes batched into the engine's ``generate``.
- :mod:`trajflow.serve.app`: the HTTP endpoint (FastAPI on uvicorn, loopback, bearer token).
- :mod:`trajflow.serve.agents`: ``rollout.agent=module:function`` episodes: threads, timeouts, errors.
"""
