"""Name -> function registries for the open-ended algorithm families.

Advantage estimators, policy losses and KL estimators are each selected in config by a string
name (``algorithm.adv_estimator: grpo``, ``actor.policy_loss.loss_mode: vanilla``, ...). A
:class:`Registry` maps those names to plain functions; a decorator registers a function under its
config name, and looking up an unknown name fails with a message that lists what is registered
and suggests the closest spelling.

A registration may also carry metadata: facts about the entry that other layers need without
running it (``@ADV_ESTIMATORS.register("gae", needs_values=True)``: the estimator needs a critic).
Each registry declares its metadata as a frozen dataclass whose defaults apply to entries that do
not set a field; :meth:`Registry.meta` reads it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class NoMeta:
    """The metadata of a registry that declares none (registrations may not pass any)."""


class Registry:
    """A registry of functions keyed by the name used in config.

    Args:
        kind: what the registry holds, in words (``"advantage estimator"``, ``"policy loss"``);
            used in error messages.
        meta: a frozen dataclass whose fields are the metadata a registration may carry; every
            field needs a default (used when a registration does not set it).

    Example:
        >>> LOSSES = Registry("policy loss")
        >>> @LOSSES.register("vanilla")
        ... def vanilla(*args): ...
        >>> LOSSES.get("vanilla") is vanilla
        True
    """

    def __init__(self, kind: str, meta: type = NoMeta) -> None:
        self.kind = kind
        self._meta_type = meta
        self._meta_fields = tuple(f.name for f in dataclasses.fields(meta))
        self._entries: dict[str, Callable[..., Any]] = {}
        self._meta: dict[str, Any] = {}

    def register(self, name: str, **meta: Any) -> Callable[[F], F]:
        """Decorator that registers the decorated function under ``name``.

        Decorators can be stacked to register aliases of the same function; each alias carries
        the metadata given with it.

        Args:
            name: the config name (a non-empty string).
            **meta: metadata of this entry: fields of the registry's ``meta`` dataclass.

        Returns:
            A decorator that registers its argument and returns it unchanged.

        Raises:
            ValueError: ``name`` is empty or not a string, already registered to a different
                function, or ``meta`` names a field the registry does not declare.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        unknown = sorted(set(meta) - set(self._meta_fields))
        if unknown:
            allowed = ", ".join(self._meta_fields) or "none"
            raise ValueError(f"{self.kind} {name!r}: unknown metadata {', '.join(unknown)}; allowed: {allowed}")
        entry_meta = self._meta_type(**meta)

        def decorator(fn: F) -> F:
            existing = self._entries.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered to {existing.__module__}."
                    f"{existing.__qualname__}; refusing to replace it with {fn.__module__}.{fn.__qualname__}"
                )
            self._entries[name] = fn
            self._meta[name] = entry_meta
            return fn

        return decorator

    def get(self, name: str) -> Callable[..., Any]:
        """Return the function registered under ``name``.

        Raises:
            ValueError: ``name`` is not registered; the message names the kind, the bad name, the
                closest registered name (difflib) when there is one, and all registered names sorted.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise self._unknown(name) from None

    def meta(self, name: str) -> Any:
        """Return the metadata registered with ``name`` (an instance of the registry's ``meta`` dataclass).

        Raises:
            ValueError: ``name`` is not registered (the same message as :meth:`get`).
        """
        try:
            return self._meta[name]
        except (KeyError, TypeError):
            raise self._unknown(name) from None

    def _unknown(self, name: object) -> ValueError:
        registered = self.names()
        close = difflib.get_close_matches(str(name), registered, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return ValueError(f"Unknown {self.kind} {name!r}.{hint} Registered {self.kind}s: {registered}")

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
