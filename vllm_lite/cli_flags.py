"""argparse flags generated from a dataclass's fields, so each knob has one name, one default, one help.

A field's flag is its name with dashes (``max_model_len`` -> ``--max-model-len``). Its
``field(metadata=...)`` may carry ``help`` (required for a documented flag), ``aliases``
(extra spellings such as ``-tp``), ``choices`` (a fixed set of values), ``type`` (a parser
for the text, when the annotation's type is not enough) and ``metavar``. Types come from
the annotation: ``bool`` becomes ``--x/--no-x`` (``Optional[bool]`` too, None when absent), ``Optional[T]``
parses ``T`` and defaults to None, ``Literal[...]`` gives the choices. Only the standard library is imported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Iterable, Literal, Optional, Union

_MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """How one dataclass field appears on the command line."""

    name: str
    flags: tuple[str, ...]
    kwargs: dict[str, Any]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def field_default(f: dataclasses.Field) -> Any:
    """The field's default value (calling its default_factory), or MISSING for a required field."""
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return _MISSING


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for Optional[T]; (tp, False) otherwise."""
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _flag_kwargs(f: dataclasses.Field, tp: Any) -> dict[str, Any]:
    """argparse keyword arguments for one field (annotation resolved to `tp`)."""
    meta = f.metadata
    base, optional = _unwrap_optional(tp)
    default = field_default(f)
    kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help", "")}
    kwargs["default"] = None if default is _MISSING else default
    if base is bool:  # Optional[bool]: absent leaves None (the field's "decide for me"), as vLLM's tri-state flags
        kwargs["action"] = argparse.BooleanOptionalAction
        return kwargs
    choices: Optional[Iterable[Any]] = meta.get("choices")
    if typing.get_origin(base) is Literal:
        choices = choices or typing.get_args(base)
        base = type(typing.get_args(base)[0])
    parse: Optional[Callable[[str], Any]] = meta.get("type")
    if parse is None:
        if base not in (int, float, str):
            raise TypeError(f"field {f.name!r}: type {tp!r} needs a 'type' parser in its metadata.")
        parse = base
    kwargs["type"] = parse
    if choices is not None:
        kwargs["choices"] = list(choices)
    if "metavar" in meta:
        kwargs["metavar"] = meta["metavar"]
    if "nargs" in meta:
        kwargs["nargs"] = meta["nargs"]
    return kwargs


def flag_specs(cls: type) -> list[FlagSpec]:
    """One FlagSpec per field of the dataclass `cls`, in field order."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        flags = (flag_name(f.name), *f.metadata.get("aliases", ()))
        specs.append(FlagSpec(f.name, flags, _flag_kwargs(f, hints[f.name])))
    return specs


def add_dataclass_args(
    group: Union[argparse.ArgumentParser, "argparse._ArgumentGroup"],
    cls: type,
    *,
    exclude: Iterable[str] = (),
    only: Optional[Iterable[str]] = None,
    positional: Iterable[str] = (),
) -> list[FlagSpec]:
    """Add a flag for each field of `cls` to `group`; returns the specs added.

    `exclude`: fields the caller defines itself (or does not want); `only`: just these;
    `positional`: fields taken as an optional positional argument instead of a flag.
    """
    skip, keep, pos = set(exclude), None if only is None else set(only), set(positional)
    added = []
    for spec in flag_specs(cls):
        if spec.name in skip or (keep is not None and spec.name not in keep):
            continue
        kwargs = dict(spec.kwargs)
        if spec.name in pos:
            dest = kwargs.pop("dest")
            group.add_argument(dest, nargs="?", **kwargs)
        else:
            group.add_argument(*spec.flags, **kwargs)
        added.append(spec)
    return added


def dataclass_kwargs_from(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """Keyword arguments for `cls` from the fields `namespace` has (absent ones keep their defaults)."""
    return {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)}


# ---------------------------------------------------------------------------- nested configs (vLLM's dotted flags)
def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_subconfig_args(
    group: Union[argparse.ArgumentParser, "argparse._ArgumentGroup"],
    field_name: str,
    cls: type,
    aliases: Optional[dict[str, tuple[str, ...]]] = None,
) -> None:
    """``--field-name.sub VALUE`` for each field of the nested dataclass `cls`, as vLLM's dotted JSON flags.

    Underscores and dashes are both accepted after the dot; a bool takes an optional true/false. Values
    land on the namespace as ``field_name.sub`` (absent unless given); `subconfig_overrides` collects them.
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spellings = {f"{flag_name(field_name)}.{f.name}", f"{flag_name(field_name)}.{f.name.replace('_', '-')}"}
        flags = sorted(spellings) + list((aliases or {}).get(f.name, ()))
        kwargs: dict[str, Any] = {"dest": f"{field_name}.{f.name}", "default": argparse.SUPPRESS}
        base, _ = _unwrap_optional(hints[f.name])
        if base is bool:
            kwargs.update(nargs="?", const=True, type=parse_bool, metavar="{true,false}")
        else:
            kwargs["type"] = base if base in (int, float, str) else str
        kwargs["help"] = f"Set {field_name}'s {f.name} alone (see --{field_name.replace('_', '-')})."
        group.add_argument(*flags, **kwargs)


def subconfig_overrides(namespace: argparse.Namespace, field_name: str) -> dict[str, Any]:
    """The nested fields given as ``--field-name.sub`` flags, by sub-field name."""
    prefix = field_name + "."
    return {k[len(prefix) :]: v for k, v in vars(namespace).items() if k.startswith(prefix)}
