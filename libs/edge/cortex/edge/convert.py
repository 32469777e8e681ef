"""Plain data (a decoded file, an environment string, a flag) -> typed values and frozen
dataclasses; every error names the key it is about.

The one builder of every service's config object (:func:`build`), and the conversions the
settings loader applies to each value (:func:`convert`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union, get_args, get_origin

__all__ = ["Converters", "SettingsError", "build", "convert", "parse_size", "unwrap_optional"]

Converters = Mapping[type, Callable[[Any], Any]]
"""Extra conversions by target type (e.g. a spec class built from a mapping); each raises
``ValueError`` on a bad value."""

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
NONE = ("off", "none")
"""How ``None`` is spelled in the environment and on the command line (any case); an
``int | None`` setting also takes ``-1``."""


class SettingsError(ValueError):
    """A setting cannot be read or is invalid. The message starts with where the value came
    from (``file.toml: server.port``, ``CORTEX_INDEX_PORT``, ``--port``): the operator fixes
    it; each service maps it onto its own configuration error."""

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}" if where else detail)
        self.where = where
        self.detail = detail


_SIZE = re.compile(r"\s*(\d+)\s*([KMG])?(i?B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864; ``K`` / ``M`` / ``G``, with or without ``iB`` / ``B``, are
    binary; a bare number is bytes."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (e.g. 65536, 64KiB, 32MiB, 1GiB)")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").upper()]


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(hint, False)``."""
    if get_origin(hint) in (Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        return options[0], len(options) < len(get_args(hint))
    return hint, False


def convert(value: Any, hint: Any, where: str, *, sized: bool = False,
            converters: Converters | None = None) -> Any:
    """``value`` as the type ``hint``. Strings (environment, flags) are parsed; values of the
    right type pass. ``sized``: an ``int`` that also takes ``64KiB`` / ``32MiB`` / ``1GiB``.
    Raises :class:`SettingsError` naming ``where``."""
    hint, optional = unwrap_optional(hint)
    if optional:
        if value is None:
            return None
        if isinstance(value, str) and hint is not str and (
                value.strip().lower() in NONE or (hint is int and value.strip() == "-1")):
            return None
    extra = (converters or {}).get(hint)
    if extra is not None:
        if isinstance(hint, type) and isinstance(value, hint):
            return value
        try:
            return extra(value)
        except (TypeError, ValueError) as exc:
            raise SettingsError(where, str(exc)) from None
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if isinstance(value, str) and hasattr(hint, "parse"):
            return _parse(hint, value, where)
        if not isinstance(value, Mapping):
            raise SettingsError(where, "must be a table/object")
        return build(hint, value, where, converters=converters)
    origin = get_origin(hint)
    if origin is tuple:
        item = get_args(hint)[0]
        if isinstance(value, str):
            value = _text_list(value, item, where)
        if not isinstance(value, list | tuple):
            raise SettingsError(where, "must be a list")
        return tuple(convert(v, item, f"{where}[{i}]", sized=sized, converters=converters)
                     for i, v in enumerate(value))
    if origin in (Mapping, dict) or hint is Mapping:
        if isinstance(value, str):
            value = _json(value, where)
        if not isinstance(value, Mapping):
            raise SettingsError(where, "must be a table/object")
        value_hint = get_args(hint)[1]
        return {str(k): convert(v, value_hint, f"{where}.{k}", converters=converters)
                for k, v in value.items()}
    if hint is bool:
        if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
            return value.strip().lower() in TRUE
        if not isinstance(value, bool):
            raise SettingsError(where, f"must be true or false, got {value!r}")
        return value
    if hint is int or hint is float:
        return _number(value, hint, where, sized)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return value
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in hint)
            raise SettingsError(where, f"must be one of {choices}, got {value!r}") from None
    if hint is str or hint is Path:
        if isinstance(value, hint):
            return value
        if not isinstance(value, str):
            raise SettingsError(where, f"must be a string, got {value!r}")
        return hint(value)
    if isinstance(hint, type) and hasattr(hint, "parse"):
        if isinstance(value, hint):
            return value
        if not isinstance(value, str):
            raise SettingsError(where, f"must be a string, got {value!r}")
        return _parse(hint, value, where)
    return value


def _parse(hint: type, text: str, where: str) -> Any:
    try:
        return hint.parse(text)  # type: ignore[attr-defined]
    except (TypeError, ValueError) as exc:
        raise SettingsError(where, str(exc)) from None


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SettingsError(where, f"not valid JSON: {exc}") from None


def _text_list(text: str, item: Any, where: str) -> list[Any]:
    """A tuple from text: a JSON list when its items are tables (models, workers), else a
    comma list."""
    if (dataclasses.is_dataclass(item) and not hasattr(item, "parse")) or \
            text.lstrip().startswith("["):
        data = _json(text, where)
        if not isinstance(data, list):
            raise SettingsError(where, "must be a JSON list")
        return data
    return [v.strip() for v in text.split(",") if v.strip()]


def _number(value: Any, hint: type, where: str, sized: bool) -> Any:
    if isinstance(value, bool):
        raise SettingsError(where, f"must be a number, got {value!r}")
    if sized and isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise SettingsError(where, str(exc)) from None
    try:
        number = hint(value)
    except (TypeError, ValueError):
        kind = "an integer" if hint is int else "a number"
        raise SettingsError(where, f"must be {kind}, got {value!r}") from None
    if hint is int and isinstance(value, float) and number != value:
        raise SettingsError(where, f"must be an integer, got {value!r}")
    return number


def build(cls: type[Any], data: Mapping[str, Any], where: str = "", *,
          converters: Converters | None = None) -> Any:
    """The dataclass ``cls`` from ``data`` (nested tables for nested dataclasses). Unknown
    keys are errors naming them. The class's own validation (``__post_init__``): a plain
    ``ValueError`` / ``TypeError`` becomes a :class:`SettingsError` naming ``where``; its
    own error classes (a service's ``ConfigError``) pass unchanged.
    ``where`` prefixes every key named in an error (``"server"``, ``"gw.toml: models[0]"``).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise SettingsError(where or "config", f"unknown key(s) {', '.join(unknown)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = convert(value, hints[name], key, sized=name.endswith("_bytes"),
                               converters=converters)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if type(exc) not in (TypeError, ValueError):
            raise  # the class's own error (a service's ConfigError) names its key itself
        raise SettingsError(where or "config", str(exc)) from exc
