"""Command-line flags generated from the engine config dataclasses, plus server flags.

Every field of :class:`~fastdeploy.config.EngineConfig` becomes a flag
(``max_num_seqs`` → ``--max-num-seqs``) whose help text is the field's
docstring, so a new config field is a new flag with no CLI code to write.
``--config FILE.yaml`` takes the same keys (dashes or underscores); values
given on the command line win over the file, which wins over the defaults.

Flag defaults are ``argparse.SUPPRESS``: the parsed namespace holds only what
the user typed, which is what lets :func:`resolve_args` layer defaults, file
and command line in the right order.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

import yaml

from fastdeploy import envs
from fastdeploy.config import MULTI_VALUE_FLAGS, EngineConfig, ServerConfig, field_docs


class ConfigFileError(ValueError):
    """The ``--config`` file is unreadable or has an unknown key or a bad value."""


@dataclass(frozen=True)
class FlagSpec:
    """One option: its key (``max_num_seqs``), default, parser of a string value and help."""

    key: str
    default: Any
    parse: Any
    """str -> value; None for bool flags."""
    help: str
    kind: str
    """bool, json, or value."""
    choices: tuple[Any, ...] | None = None
    section: str = "server"
    optional: bool = False
    """Whether None is a valid value (``none``/``null`` on the command line)."""

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def _optional_inner(tp: Any) -> tuple[Any, bool]:
    """``int | None`` → ``(int, True)``; ``int`` → ``(int, False)``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _value_parser(tp: Any, optional: bool) -> Any:
    """A ``str -> value`` converter for a scalar type; ``none``/``null`` give None when optional."""

    def parse(text: str) -> Any:
        if optional and text.strip().lower() in ("none", "null"):
            return None
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        return text

    parse.__name__ = getattr(tp, "__name__", "value")  # argparse shows it in "invalid int value"
    return parse


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


_json_object.__name__ = "JSON object"


def _string_list(text: str) -> list[str]:
    """A JSON array of strings (``'["a", "b"]'``, vLLM's form) or comma-separated words."""
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON array of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


_string_list.__name__ = "list of strings"


def engine_flag_specs() -> list[FlagSpec]:
    """A :class:`FlagSpec` per engine config field, in declaration order."""
    return _flag_specs(EngineConfig.flat_fields())


def _flag_specs(fields: list[tuple[type, dataclasses.Field]]) -> list[FlagSpec]:
    """A :class:`FlagSpec` per (config class, field), in the order given."""
    specs = []
    for section_cls, field in fields:
        hints = typing.get_type_hints(section_cls)
        tp, optional = _optional_inner(hints[field.name])
        doc = field_docs(section_cls).get(field.name, "")
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = None
        section = section_cls.__name__.removesuffix("Config").lower()
        origin = typing.get_origin(tp)
        common = {"section": section, "optional": optional}
        if tp is bool:
            specs.append(FlagSpec(field.name, default, None, doc, "bool", **common))
        elif tp is dict or origin is dict:
            specs.append(FlagSpec(field.name, default, _json_object, doc, "json", **common))
        elif origin is list:
            specs.append(FlagSpec(field.name, default, _string_list, doc, "list", **common))
        elif origin is Literal:
            choices = typing.get_args(tp)
            parse = _value_parser(type(choices[0]), optional)
            specs.append(FlagSpec(field.name, default, parse, doc, "value", choices=choices, **common))
        elif tp in (int, float, str):
            specs.append(FlagSpec(field.name, default, _value_parser(tp, optional), doc, "value", **common))
        else:
            raise TypeError(f"cannot make a CLI flag for {section_cls.__name__}.{field.name}: {tp!r}")
    return specs


SERVER_FLAGS: tuple[FlagSpec, ...] = tuple(
    _flag_specs([(ServerConfig, f) for f in dataclasses.fields(ServerConfig)])
)
"""Options of the HTTP server itself (:class:`~fastdeploy.config.ServerConfig`, not part of the engine)."""


def server_config_from_args(ns: argparse.Namespace) -> ServerConfig:
    """The :class:`ServerConfig` described by parsed ``serve`` arguments (file and defaults merged in)."""
    resolved = vars(resolve_args(ns))
    config = ServerConfig(**{spec.key: resolved[spec.key] for spec in SERVER_FLAGS})
    if not config.api_key and envs.FD_API_KEY:
        config.api_key = [envs.FD_API_KEY]
    return config


def all_flag_specs() -> list[FlagSpec]:
    """Engine flags then server flags; a key defined twice is a programming error."""
    specs = engine_flag_specs() + list(SERVER_FLAGS)
    seen: set[str] = set()
    for spec in specs:
        if spec.key in seen or spec.key == "config":
            raise ValueError(f"flag --{spec.key} is defined twice")
        seen.add(spec.key)
    return specs


FLAG_ALIASES: dict[str, tuple[str, ...]] = {"hf_config_overrides": ("--hf-overrides",)}
"""Other names a flag answers to (vLLM's spelling of the same option)."""


def _help(spec: FlagSpec) -> str:
    text = spec.help.replace("%", "%%")
    if spec.kind == "json":
        text += " Value: a JSON object."
    if spec.default is not None and spec.default != {}:
        shown = json.dumps(spec.default) if spec.kind == "json" else spec.default
        text += f" [default: {shown}]"
    return text


def add_engine_and_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every engine flag (grouped by config section), the server flags and ``--config``."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="Model path, the same as --model.",
    )
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="FILE.yaml",
        help="YAML file with the same keys as these flags (dashes or underscores); flags given on the "
        "command line override it.",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in all_flag_specs():
        if spec.section not in groups:
            groups[spec.section] = parser.add_argument_group(f"{spec.section} options")
        group = groups[spec.section]
        kwargs: dict[str, Any] = {"dest": spec.key, "default": argparse.SUPPRESS, "help": _help(spec)}
        names = (spec.flag, *FLAG_ALIASES.get(spec.key, ()))
        if spec.key in MULTI_VALUE_FLAGS:  # --api-key k1 k2, as vLLM's
            group.add_argument(*names, nargs="+", metavar=spec.key.upper(), **kwargs)
        elif spec.kind == "bool":
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            if spec.choices:
                kwargs["choices"] = spec.choices
            group.add_argument(*names, type=spec.parse, metavar=spec.key.upper(), **kwargs)
    return parser


def _convert_file_value(spec: FlagSpec, value: Any, where: str) -> Any:
    """Check (and convert, for strings) a value read from YAML, like the CLI would."""
    try:
        if spec.kind == "bool":
            if isinstance(value, bool):
                return value
            raise ValueError("expected true or false")
        if spec.kind == "json":
            if isinstance(value, dict):
                return value
            if isinstance(value, str):
                return _json_object(value)
            raise ValueError("expected a mapping")
        if spec.kind == "list":
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return value
            if isinstance(value, str):
                return _string_list(value)
            raise ValueError("expected a list of strings")
        if value is None:
            if spec.optional:
                return None
            raise ValueError("a value is required")
        if isinstance(value, (bool, list, dict)):
            raise ValueError("expected a single value")
        result = spec.parse(str(value))
        if spec.choices and result not in spec.choices:
            raise ValueError(f"expected one of {', '.join(map(str, spec.choices))}")
        return result
    except (ValueError, argparse.ArgumentTypeError, json.JSONDecodeError) as exc:
        raise ConfigFileError(
            f"{where}: bad value {value!r} for '{spec.key.replace('_', '-')}': {exc}"
        ) from None


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML config: ``{key_with_underscores: value}``; unknown keys are an error."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path} must be a mapping of option names to values")
    specs = {s.key: s for s in all_flag_specs()}
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).strip().lstrip("-").replace("-", "_")
        if key not in specs:
            valid = sorted(k.replace("_", "-") for k in specs)
            close = difflib.get_close_matches(key.replace("_", "-"), valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigFileError(
                f"config file {path}: unknown key '{raw_key}'{hint}. Valid keys: {', '.join(valid)}"
            )
        out[key] = _convert_file_value(specs[key], value, f"config file {path}")
    return out


def resolve_args(ns: argparse.Namespace) -> argparse.Namespace:
    """A namespace with every option set: defaults, then the ``--config`` file, then the command line.

    Idempotent: a namespace already resolved is returned as is. Raises
    :class:`ConfigFileError` for a bad config file or a conflicting positional model.
    """
    if getattr(ns, "_resolved", False):
        return ns
    given = dict(vars(ns))
    merged: dict[str, Any] = {spec.key: spec.default for spec in all_flag_specs()}
    if given.get("config"):
        merged.update(load_config_file(given["config"]))
    model_tag = given.pop("model_tag", None)
    if model_tag is not None:
        if given.get("model") not in (None, model_tag):
            raise ConfigFileError(
                f"model given twice: positional {model_tag!r} and --model {given['model']!r}"
            )
        given["model"] = model_tag
    merged.update(given)
    merged.setdefault("config", None)
    out = argparse.Namespace(**merged)
    out._resolved = True
    return out


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` described by parsed ``serve`` arguments (file and defaults merged in)."""
    resolved = vars(resolve_args(ns))
    engine_keys = [spec.key for spec in engine_flag_specs()]
    return EngineConfig.from_kwargs(**{key: resolved[key] for key in engine_keys})
