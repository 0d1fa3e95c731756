"""Typed dataclass configs: YAML file plus command-line flags, unknown keys refused.

A config class is a dataclass whose fields carry `help` (and optionally
`choices`) in their metadata; `__post_init__` validates and raises
ConfigError naming the key. Used by `pipeline` and `train` alike.
"""
import argparse
import dataclasses
import os
import typing

import yaml

from .errors import ConfigError


def field(default, help, choices=None, repeat=False, **kw):  # noqa: A002 - mirrors argparse's name
    """repeat: the flag may be given several times (`--cache A --cache B`); one value stays a string, several
    make a list (in YAML: a string or a list)."""
    meta = {"help": help, "choices": choices, "repeat": repeat}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


def validate(cfg, required=(), checks=()):
    """Refuse empty required keys and failed (key, ok, why) checks, naming the key and its value."""
    for key in required:
        if not getattr(cfg, key):
            raise ConfigError(f"{key}: required (set it in the config file or with --{key.replace('_', '-')})")
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"{key}: {getattr(cfg, key)!r} {why}")


def run_command(prog, description, cls, run, argv=None, extra_args=None):
    """The shared shape of `kdcache precompute/train`: --config YAML + one flag per field, then run(cfg).

    Errors propagate as KdcacheError; the `kdcache` dispatcher prints them and exits 2.
    """
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", help="YAML file with any of the settings below; flags override it")
    add_flags(p, cls)
    if extra_args:
        extra_args(p)
    args = p.parse_args(argv)
    return run(load(cls, args.config, overrides_from(args, cls))) or 0


def _base_type(tp):
    """(python type, optional) of an annotation like `int`, `float | None`, `list`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = type(None) in typing.get_args(tp)
    if args and typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return args[0], optional
    return (typing.get_origin(tp) or tp), optional


def coerce(cls, name, value):
    hints = typing.get_type_hints(cls)
    tp, optional = _base_type(hints[name])
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}[name]
    if meta.get("repeat") and isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{name}: expected one or more non-empty strings, got {value!r}")
        return value[0] if len(value) == 1 else list(value)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name}: null is not allowed (expected {tp.__name__})")
    try:
        if tp is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if tp in (list, dict):
            if not isinstance(value, tp):
                raise ValueError(value)
            return value
        return tp(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}") from None


def load(cls, path=None, overrides=None):
    """Build cls from defaults <- YAML file <- overrides (flags). Unknown keys are refused."""
    values = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path} does not exist")
        with open(path) as f:
            data = yaml.safe_load(f) or {}     # safe_load: a config never executes code
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
        values.update(data)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = f" in {path}" if path else ""
        raise ConfigError(f"unknown config key(s){where}: {', '.join(unknown)}; valid keys: {', '.join(sorted(names))}")
    for f in dataclasses.fields(cls):
        choices = f.metadata.get("choices")
        if f.name in values:
            values[f.name] = coerce(cls, f.name, values[f.name])
            if choices and values[f.name] not in choices:
                raise ConfigError(f"{f.name}: {values[f.name]!r} is not one of {list(choices)}")
    return cls(**values)


def add_flags(parser: argparse.ArgumentParser, cls, skip=()):
    """One --flag per field (underscores become dashes); defaults stay None so the YAML wins."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, _ = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_ = f"{f.metadata.get('help', '')} (default: {default!r})"
        if tp is bool:
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_)
        elif f.metadata.get("repeat"):
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), action="append",
                                help=help_ + "; repeat the flag for several")
        elif tp in (list, dict):
            continue   # YAML only
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                                choices=f.metadata.get("choices"), help=help_)
    return parser


def overrides_from(args, cls):
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def to_dict(cfg):
    return dataclasses.asdict(cfg)


def dumps(cfg):
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def dump(cfg, path):
    """Save the resolved config next to an output (atomic, so a crash leaves no half file)."""
    from .atomic import atomic_write_bytes
    atomic_write_bytes(path, dumps(cfg).encode())
