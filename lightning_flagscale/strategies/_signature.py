"""The strategy's keyword list, read from ``ParallelConfig``: one source of truth for the layout keywords.

``FlagScaleStrategy.__init__`` takes the layout as ``**layout`` and hands it to ``ParallelConfig``; LightningCLI
(jsonargparse), ``help()`` and ``inspect`` need real parameters, so :func:`with_config_keywords` shows the config's
fields (names, defaults, types) as keyword-only parameters of ``__init__``. A new ``ParallelConfig`` field is then a
strategy keyword with nothing else to edit.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["check_options", "with_config_keywords"]

F = TypeVar("F", bound=Callable[..., Any])


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def with_config_keywords(config_cls: type, after: str) -> Callable[[F], F]:
    """Show ``config_cls``'s init fields as keyword-only parameters of the decorated ``__init__`` (which collects
    them in its ``**`` parameter), right after its parameter ``after``; its own annotations are resolved too."""
    hints = typing.get_type_hints(config_cls)
    fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f), annotation=hints[f.name])
        for f in dataclasses.fields(config_cls)
        if f.init
    ]

    def decorate(init: F) -> F:
        own_hints = typing.get_type_hints(init)
        own = [
            p.replace(annotation=own_hints.get(p.name, p.annotation))
            for p in inspect.signature(init).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        at = next(i for i, p in enumerate(own) if p.name == after) + 1
        params = [*own[:at], *fields, *own[at:]]
        init.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        init.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty}
        init.__annotations__["return"] = None
        return init

    return decorate


def check_options(resume: str | None, watchdog_timeout: float | None) -> None:
    """Refuse the strategy's own keywords that cannot work, naming the fix (the layout checks itself)."""
    if resume not in (None, "auto"):
        raise ValueError(f"resume={resume!r} is unknown; use 'auto' (newest complete checkpoint) or None.")
    if watchdog_timeout is not None and watchdog_timeout <= 0:
        raise ValueError(f"watchdog_timeout={watchdog_timeout} must be > 0 seconds, or None to disable it.")
