"""A service's settings loader, generated from its frozen config dataclass.

Sources, later wins: the dataclass defaults → a TOML or JSON file (``--config PATH`` or
``CORTEX_<SERVICE>_CONFIG``) → environment variables ``CORTEX_<SERVICE>_<PATH>`` → flags
``--<path>``. A setting's *path* is its field names from the top, e.g.
``forwarder.queue_max_updates``: the file key is that dotted path (nested tables), the
variable ``CORTEX_INGEST_FORWARDER_QUEUE_MAX_UPDATES``, the flag
``--forwarder-queue-max-updates``. A flag's help is the field's docstring.

Unknown file keys and unknown ``CORTEX_<SERVICE>_*`` variables are errors naming the key (a
Kubernetes service link — ``CORTEX_INDEX_PORT=tcp://…`` — gets one naming the fix).
Deprecated aliases (old variable → path) still work and log a warning naming the new name.
Every error is a :class:`~cortex.edge.convert.SettingsError` naming the key and its source.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import logging
import re
import textwrap
import tomllib
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

from cortex.edge.convert import Converters, SettingsError, build, convert, unwrap_optional

__all__ = ["Setting", "SettingsError", "SettingsSpec"]

log = logging.getLogger(__name__)

_MISSING: Any = dataclasses.MISSING
_LINK = re.compile(r"(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_\w+)?)?)")
_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Setting:
    """One leaf of a config dataclass: its path, type, default (``dataclasses.MISSING``
    when required), help text, and its variable and flag names."""

    path: tuple[str, ...]
    hint: Any
    default: Any
    help: str
    env: str
    flag: str

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def sized(self) -> bool:
        return self.path[-1].endswith("_bytes")

    @property
    def required(self) -> bool:
        return self.default is _MISSING


class SettingsSpec:
    """The settings of ``config`` (a frozen dataclass) for the service ``service``.

    ``aliases``: deprecated variable names → dotted path. ``flag_names``: dotted path →
    extra option strings of its flag (today's short spellings, e.g. ``--redis``).
    ``converters``: extra conversions by type. Construction fails (``TypeError``) when two
    paths — or an alias and a path — map to one variable or flag name.
    """

    def __init__(self, config: type[Any], service: str, *,
                 aliases: Mapping[str, str] | None = None,
                 flag_names: Mapping[str, Sequence[str]] | None = None,
                 converters: Converters | None = None,
                 reserved: Iterable[str] = ("CONFIG", "LOG_LEVEL", "LOG_FORMAT")) -> None:
        self.config = config
        self.service = service
        self.prefix = f"CORTEX_{service.upper().replace('-', '_')}_"
        self.converters = converters
        self.reserved = frozenset(self.prefix + name for name in reserved)
        self.settings: dict[str, Setting] = {}
        self._by_env: dict[str, Setting] = {}
        for setting in _leaves(config, (), self.prefix):
            other = self._by_env.get(setting.env)
            if other is not None:
                raise TypeError(f"settings {other.dotted} and {setting.dotted} both map to "
                                f"{setting.env}")
            self.settings[setting.dotted] = setting
            self._by_env[setting.env] = setting
        self.aliases: dict[str, Setting] = {}
        for old, dotted in (aliases or {}).items():
            if old in self._by_env or old in self.reserved:
                raise TypeError(f"alias {old} is already the name of a setting")
            self.aliases[old] = self.settings[dotted]
        self.flag_names = {self.settings[d].dotted: tuple(names)
                           for d, names in (flag_names or {}).items()}

    def __repr__(self) -> str:
        return f"SettingsSpec({self.config.__name__}, {self.service!r}, " \
               f"{len(self.settings)} settings)"

    # ---- the command line ----

    def add_arguments(self, parser: argparse.ArgumentParser,
                      only: Iterable[str] | None = None) -> None:
        """``--config`` and one flag per setting (or per dotted path in ``only``). Flags
        default to "not given"; :meth:`load` reads them from the parsed namespace."""
        parser.add_argument("--config", metavar="PATH", dest="config",
                            help=f"settings file (.toml or .json) [env {self.prefix}CONFIG]")
        chosen = self.settings.values() if only is None else [self.settings[d] for d in only]
        for setting in chosen:
            names = [setting.flag, *self.flag_names.get(setting.dotted, ())]
            text = f"{setting.help} [env {setting.env}" + (
                "]" if setting.required else f", default {_show(setting.default)}]")
            kwargs: dict[str, Any] = {"dest": _dest(setting), "default": None,
                                      "help": text.replace("%", "%%")}
            kind, _ = unwrap_optional(setting.hint)
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif get_origin(kind) is tuple:
                kwargs.update(action="append", metavar=_metavar(setting))
            else:
                kwargs["metavar"] = _metavar(setting)
            parser.add_argument(*names, **kwargs)

    # ---- reading ----

    def collect(self, args: argparse.Namespace | None = None,
                env: Mapping[str, str] | None = None,
                path: Path | str | None = None) -> dict[str, Any]:
        """Every source merged into nested plain data (converted leaves) for :meth:`build`;
        ``path`` (else ``args.config``, else ``$CORTEX_<SERVICE>_CONFIG``) names
        the file. Raises :class:`SettingsError`."""
        env = {} if env is None else env
        data: dict[str, Any] = {}
        if path is None and args is not None:
            path = getattr(args, "config", None)
        if path is None:
            path = env.get(self.prefix + "CONFIG") or None
        if path is not None:
            self._from_file(Path(path), data)
        self._from_env(env, data)
        if args is not None:
            self._from_flags(args, data)
        return data

    def build(self, data: Mapping[str, Any]) -> Any:
        """The config object of :meth:`collect`'s data; a required setting that no source
        gave is an error naming its variable."""
        missing = [s for s in self.settings.values() if s.required and _get(data, s) is _MISSING]
        if missing:
            raise SettingsError(missing[0].env, f"required ({missing[0].flag} or "
                                                f"{missing[0].dotted} in the file)")
        return build(self.config, data, converters=self.converters)

    def load(self, args: argparse.Namespace | None = None,
             env: Mapping[str, str] | None = None, path: Path | str | None = None) -> Any:
        """:meth:`collect` then :meth:`build`."""
        return self.build(self.collect(args, env, path))

    def _from_file(self, path: Path, data: dict[str, Any]) -> None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SettingsError(str(path), f"cannot read config file: {exc.strerror}") from None
        try:
            raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except ValueError as exc:
            raise SettingsError(str(path), str(exc)) from None
        if not isinstance(raw, dict):
            raise SettingsError(str(path), "must hold a table/object")
        self._walk(raw, (), path, data)

    def _walk(self, raw: Mapping[str, Any], prefix: tuple[str, ...], file: Path,
              data: dict[str, Any]) -> None:
        for key, value in raw.items():
            path = (*prefix, str(key))
            dotted = ".".join(path)
            setting = self.settings.get(dotted)
            if setting is not None:
                _put(data, setting, self._convert(value, setting, f"{file}: {dotted}"))
            elif any(s.path[:len(path)] == path for s in self.settings.values()):
                if not isinstance(value, Mapping):
                    raise SettingsError(f"{file}: {dotted}", "must be a table/object")
                self._walk(value, path, file, data)
            else:
                raise SettingsError(f"{file}: {dotted}", "unknown key")

    def _from_env(self, env: Mapping[str, str], data: dict[str, Any]) -> None:
        for var in sorted(env, key=lambda v: (v not in self.aliases, v)):  # new names win
            if not var.startswith(self.prefix) and var not in self.aliases:
                continue
            text = env[var]
            setting = self._by_env.get(var)
            if setting is None and var in self.aliases:
                setting = self.aliases[var]
                log.warning("%s is deprecated: set %s instead", var, setting.env)
            elif setting is None:
                if var.startswith(self.prefix) and var not in self.reserved:
                    raise self._unknown(var, text)
                continue
            if text == "" and setting.hint is not str:
                continue  # an empty variable is unset (compose's ${VAR:-}), but for text
            try:
                value = self._convert(text, setting, var)
            except SettingsError:
                if _LINK_VALUE.match(text):
                    raise self._link(var) from None
                raise
            _put(data, setting, value)

    def _unknown(self, var: str, text: str) -> SettingsError:
        if _LINK.fullmatch(var[len(self.prefix):]) or _LINK_VALUE.match(text):
            return self._link(var)
        return SettingsError(var, "unknown setting")

    def _link(self, var: str) -> SettingsError:
        service = self.prefix[len("CORTEX_"):-1].lower().replace("_", "-")
        return SettingsError(var, f"unknown setting; this looks like a Kubernetes service "
                                  f"link (a Service named cortex-{service}): set "
                                  f"enableServiceLinks: false in the pod spec")

    def _from_flags(self, args: argparse.Namespace, data: dict[str, Any]) -> None:
        for setting in self.settings.values():
            value = getattr(args, _dest(setting), None)
            if value is None:
                continue
            if isinstance(value, list):  # a repeatable flag: each may be a comma list
                value = [v.strip() for item in value for v in item.split(",") if v.strip()]
            _put(data, setting, self._convert(value, setting, setting.flag))

    def _convert(self, value: Any, setting: Setting, where: str) -> Any:
        return convert(value, setting.hint, where, sized=setting.sized,
                       converters=self.converters)


def _leaves(cls: type[Any], prefix: tuple[str, ...], env_prefix: str) -> Iterable[Setting]:
    hints = typing.get_type_hints(cls)
    docs = _docstrings(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        path = (*prefix, field.name)
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type) \
                and not hasattr(hint, "parse"):
            yield from _leaves(hint, path, env_prefix)
            continue
        default = field.default
        factory: Any = field.default_factory
        if default is _MISSING and factory is not _MISSING:
            default = factory()
        yield Setting(path, hint, default, docs.get(field.name, field.name.replace("_", " ")),
                      env_prefix + "_".join(path).upper(), "--" + "-".join(path).replace("_", "-"))


def _docstrings(cls: type[Any]) -> dict[str, str]:
    """Each field's docstring (the string literal right after it in the class body)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _dest(setting: Setting) -> str:
    return "setting:" + setting.dotted


def _metavar(setting: Setting) -> str:
    kind, _ = unwrap_optional(setting.hint)
    if get_origin(kind) is tuple:
        kind = get_args(kind)[0]
    if setting.sized:
        return "SIZE"
    if kind is int:
        return "N"
    if kind is float:
        return "S" if setting.path[-1].endswith("_s") else "X"
    if kind is Path or setting.path[-1].endswith(("_file", "_path")):
        return "PATH"
    return "TEXT"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "none"
    if value is None:
        return "off"
    return str(value)


def _put(data: dict[str, Any], setting: Setting, value: Any) -> None:
    table = data
    for name in setting.path[:-1]:
        table = table.setdefault(name, {})
    table[setting.path[-1]] = value


def _get(data: Mapping[str, Any], setting: Setting) -> Any:
    table: Any = data
    for name in setting.path:
        if not isinstance(table, Mapping) or name not in table:
            return _MISSING
        table = table[name]
    return table
