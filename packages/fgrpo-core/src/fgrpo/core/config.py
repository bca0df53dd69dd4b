"""Declaring the recipe keys of a component, and checking values against them without building it.

A component is an attrs class; each recipe key is a field declared with :func:`param` (a default,
bounds, allowed choices and a help line) or :func:`fgrpo.core.registry.component` (a nested
component such as a sampler's kernel, resolved through the registry). :func:`check_params` reports
every problem of a mapping of keys at once, before anything heavy is constructed; the registry and
the recipe loader both use it. This module knows nothing of the registry: a nested component's
field carries the function that checks it.
"""

from __future__ import annotations

import difflib
import math
import os
import reprlib
import stat
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

_MISSING = attrs.NOTHING


#: the longest error message shown (values echoed in it are shortened by :func:`shown` first)
MAX_MESSAGE = 500


def _capped(message: str) -> str:
    message = str(message)
    if len(message) <= MAX_MESSAGE:
        return message
    return f"{message[:MAX_MESSAGE]}... ({len(message) - MAX_MESSAGE} more characters)"


#: how much of an exception's message an error line quotes (:func:`first_line`)
QUOTED_LENGTH = 200


def first_line(exc: BaseException, limit: int = QUOTED_LENGTH) -> str:
    """The first non-blank line of ``exc``'s message, cut to ``limit`` characters: what a one-line
    error quotes of the exception behind it (the exception's type name when the message is empty)."""
    line = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return line[:limit] or type(exc).__name__


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxlevel = 3


def shown(value: Any) -> str:
    """``repr(value)`` cut short: long strings, long or deeply nested lists and mappings are
    elided (``...``), so echoing a value in an error costs little whatever its size."""
    return _SHORT.repr(value)


@attrs.frozen
class ConfigError:
    """One problem in a recipe: the dotted key path, the bad value, what is allowed."""

    key: str
    message: str = attrs.field(converter=_capped)

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class RecipeError(Exception):
    """Every problem found in a recipe (or in a component's parameters), all at once."""

    def __init__(self, errors: Sequence[ConfigError]):
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


def open_regular(path: str | os.PathLike, *, follow: bool = True, devices: bool = False) -> int:
    """A read-only descriptor of ``path`` once it is known to be a regular file (or, with
    ``devices``, a character device such as /dev/zero). It is opened without blocking, so a FIFO
    is refused instead of waited on; ``follow=False`` refuses a link as well. Raises OSError, or
    ValueError with one line saying what ``path`` is."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode) or (devices and stat.S_ISCHR(mode)):
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    kind = (
        "a folder"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
    )
    raise ValueError(f"{path}: is {kind}, not a regular file")


def read_text_file(path: str | Path, *, limit: int, what: str) -> str:
    """The text of the UTF-8 file ``path``, read in chunks up to ``limit`` bytes; ValueError with
    one line when it is larger, holds NUL bytes (``/dev/zero``, a binary file), is not UTF-8 or is
    not a file at all (a FIFO, a folder)."""
    path = Path(path)
    chunks, size = [], 0
    with open(open_regular(path, devices=True), "rb") as fh:  # a FIFO would block until a writer came
        while chunk := fh.read(1 << 20):
            if b"\0" in chunk:
                raise ValueError(f"{path}: holds NUL bytes; {what} is a text file")
            size += len(chunk)
            if size > limit:
                raise ValueError(f"{path}: larger than {limit >> 20} MiB; {what} is not that large")
            chunks.append(chunk)
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None


def _bounds_validator(ge=None, gt=None, le=None, lt=None, choices=None):
    def check_number(value, where=""):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"got {shown(value)}{where}; must be a finite number")
        for bound, ok in (
            (ge, lambda v, b: v >= b),
            (gt, lambda v, b: v > b),
            (le, lambda v, b: v <= b),
            (lt, lambda v, b: v < b),
        ):
            if bound is not None and not ok(value, bound):
                raise ValueError(f"got {shown(value)}{where}; allowed: {allowed_text(ge, gt, le, lt)}")

    def check(_instance, attribute, value):
        if value is None:
            return
        if choices is not None and value not in choices:
            raise ValueError(f"got {shown(value)}; allowed: {', '.join(map(repr, choices))}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            check_number(value)
        elif isinstance(value, (list, tuple)):  # a list of numbers: every item is checked
            for i, item in enumerate(value):
                if isinstance(item, (int, float)) and not isinstance(item, bool):
                    check_number(item, f" at item {i} of {shown(value)}")

    return check


def allowed_text(ge=None, gt=None, le=None, lt=None) -> str:
    lower = f">= {ge}" if ge is not None else f"> {gt}" if gt is not None else ""
    upper = f"<= {le}" if le is not None else f"< {lt}" if lt is not None else ""
    return " and ".join(part for part in (lower, upper) if part) or "any number"


def param(
    default: Any = _MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    factory: Callable[[], Any] | None = None,
    converter: Callable[[Any], Any] | None = None,
    validator: Callable[[Any, Any, Any], None] | None = None,
    help: str = "",
) -> Any:
    """A recipe key: ``eta: float = param(0.7, ge=0, help="noise level")``."""
    validators = [_bounds_validator(ge, gt, le, lt, tuple(choices) if choices else None)]
    if validator is not None:
        validators.append(validator)
    bounds = " ".join(f"{op} {v:g}" for op, v in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if v is not None)
    metadata = {"fgrpo_help": help, "fgrpo_choices": tuple(choices) if choices else None, "fgrpo_bounds": bounds}
    if factory is not None:
        default = attrs.Factory(factory)
    return attrs.field(
        default=default,
        validator=validators,
        converter=converter,
        metadata=metadata,
    )


# --- checking values against annotations -------------------------------------------------------

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _type_name(tp: Any) -> str:
    if tp in _TYPE_WORDS:
        return _TYPE_WORDS[tp]
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, Sequence, tuple) or tp in (list, tuple):
        return "a list"
    if origin in (dict, Mapping) or tp in (dict,):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any) -> Any:
    """Return ``value`` as type ``tp`` or raise ``TypeError`` saying what was expected.

    Only lossless conversions: an int where a float is expected, a numeric string such as "1e-4"
    (YAML 1.1 reads it as a string) where a number is expected.
    """
    if tp is Any or tp is typing.Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except TypeError:
                continue
        raise TypeError(f"expected {_type_name(tp)}, got {shown(value)}")
    if origin is typing.Literal:
        args = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads a bare no/off/yes/on as a boolean
            words = ("no", "off", "false") if value is False else ("yes", "on", "true")
            value = next((w for w in words if w in args), value)
        if value in args:
            return value
        raise TypeError(f"got {shown(value)}; allowed: {', '.join(map(repr, typing.get_args(tp)))}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"expected true or false, got {shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError(f"expected an integer, got {shown(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError(f"expected a number, got {shown(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"expected a string, got {shown(value)}")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {shown(value)}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise TypeError(f"expected a list of {len(args)} items, got {shown(value)}")
            return tuple(coerce(v, a) for v, a in zip(value, args, strict=True))
        item = args[0] if args else Any
        out = [coerce(v, item) for v in value]
        return tuple(out) if origin is tuple or tp is tuple else out
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a mapping, got {shown(value)}")
        return dict(value)
    return value  # an annotation we do not check (a protocol, a tensor ...)


def _field_types(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: leave those values unchecked
        return {}


#: the class of attrs.Factory(...) defaults (attrs' stubs present Factory as a function returning the
#: default's type, so that field defaults type-check)
_FACTORY: Any = type(attrs.Factory(list))


def default_value(default: Any) -> Any:
    """A field's default as a value: a factory default's product, else the default itself."""
    return default.factory() if isinstance(default, _FACTORY) else default


class DeprecatedKey(FutureWarning):
    """A recipe key given under its old name: accepted as the new one, with one line naming it.
    A component declares its renamed keys as ``renamed_keys: ClassVar[dict[str, str]]`` (old ->
    new); ``fgrpo`` prints the warning as ``note: ...``."""


def renamed_keys(cls: type, params: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], list[ConfigError]]:
    """``params`` with the keys ``cls`` renamed under their new names (a :class:`DeprecatedKey`
    warning for each), or an error where a key is given under both names."""
    renames: Mapping[str, str] = getattr(cls, "renamed_keys", {})
    out, errors = dict(params), []
    for old, new in renames.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out:
            errors.append(
                ConfigError(
                    dotted(prefix, old), f"the old name of {dotted(prefix, new)}, which is given too: keep {new}"
                )
            )
            continue
        out[new] = value
        warnings.warn(
            DeprecatedKey(f"{dotted(prefix, old)} is deprecated: it is now {dotted(prefix, new)} (the value is used)"),
            stacklevel=3,
        )
    return out, errors


def public_fields(cls: type) -> list[attrs.Attribute]:
    return [f for f in attrs.fields(cls) if f.init and not f.name.startswith("_")]


def dotted(prefix: str, name: str) -> str:
    """A recipe key's dotted path: ``name`` under ``prefix`` (the section), or ``name`` at the top."""
    return f"{prefix}.{name}" if prefix else name


#: what other toolkits (diffusers' scripts, flow_grpo, TRL) call a key fgrpo names otherwise: an
#: unknown key that is one of these suggests fgrpo's name (where the component has that key)
SYNONYMS = {
    "learning_rate": "lr",
    "lr_scheduler": "lr_schedule",
    "scheduler": "lr_schedule",
    "warmup": "warmup_iterations",
    "warmup_steps": "warmup_iterations",
    "lr_warmup_steps": "warmup_iterations",
    "num_iterations": "iterations",
    "max_steps": "iterations",
    "num_epochs": "iterations",
    "epochs": "iterations",
    "num_inference_steps": "steps",
    "num_steps": "steps",
    "sample_steps": "steps",
    "guidance": "guidance_scale",
    "cfg": "guidance_scale",
    "cfg_scale": "guidance_scale",
    "max_grad": "max_grad_norm",
    "grad_clip": "max_grad_norm",
    "clip_grad_norm": "max_grad_norm",
    "ema": "ema_decay",
    "num_generations": "group_size",
    "num_image_per_prompt": "group_size",
    "clip_epsilon": "clip_range",
    "epsilon": "clip_range",
    "beta": "kl_beta",
    "kl_coef": "kl_beta",
    "init_kl_coef": "kl_beta",
    "model_path": "path",
    "pretrained_model": "path",
    "pretrained_model_name_or_path": "path",
    "noise_level": "eta",
    "lora_rank": "lora",
}


def check_params(cls: type, params: Mapping[str, Any], prefix: str = "") -> tuple[dict, list]:
    """Check ``params`` against the attrs fields of ``cls``.

    Returns the coerced parameters (defaults filled in, nested components as validated
    mappings) and the list of :class:`ConfigError`. Nothing is constructed. A nested component's
    field names its kind (``fgrpo_kind``) and the function that checks its spec (``fgrpo_check``,
    ``(kind, spec, key) -> (checked, errors)``) in its metadata.
    """

    def key(name: str) -> str:
        return dotted(prefix, name)

    errors: list[ConfigError] = []
    out: dict[str, Any] = {}
    if not attrs.has(cls):
        return dict(params), errors
    params, errors = renamed_keys(cls, params, prefix)
    fields = {f.name: f for f in public_fields(cls)}
    hints = _field_types(cls)
    for name in params:
        if name not in fields:
            synonym = [SYNONYMS[name]] if SYNONYMS.get(name) in fields else []
            close = synonym or difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            allowed = ", ".join(sorted(fields)) or "none"
            errors.append(ConfigError(key(str(name)), f"unknown key{hint}; allowed keys: {allowed}"))
    for name, field in fields.items():
        if name not in params:
            if field.default is attrs.NOTHING:
                errors.append(ConfigError(key(name), "missing required key"))
            else:
                out[name] = default_value(field.default)
                if field.metadata.get("fgrpo_kind") and isinstance(out[name], (str, Mapping)):
                    out[name], errs = field.metadata["fgrpo_check"](field.metadata["fgrpo_kind"], out[name], key(name))
                    errors.extend(errs)
            continue
        value = params[name]
        kind = field.metadata.get("fgrpo_kind")
        if kind is not None:
            out[name], errs = field.metadata["fgrpo_check"](kind, value, key(name))
            errors.extend(errs)
            continue
        try:
            if name in hints:
                value = coerce(value, hints[name])
            if field.converter is not None:
                # param() takes plain one-argument converters; attrs' stubs type this as its Converter class
                value = field.converter(value)  # type: ignore[operator]
            validators = field.validator
            for validator in getattr(validators, "_validators", None) or ([validators] if validators else []):
                validator(None, field, value)
        except (TypeError, ValueError) as exc:
            errors.append(ConfigError(key(name), _clean(str(exc), value)))
            continue
        out[name] = value
    # rules that involve several keys: a component may declare them as a classmethod
    cross = getattr(cls, "check_keys", None)
    if cross is not None and not errors:
        errors.extend(e for e in cross(out, prefix) if e is not None)
    return out, errors


def _clean(message: str, value: Any) -> str:
    # attrs' own validators say "'x' must be ..."; ours already say "got ...; allowed ...".
    if "got" in message or "expected" in message:
        return message
    return f"got {shown(value)}; {message}"


def help_lines(cls: type) -> list[tuple[str, str, str]]:
    """(key, default, help) for every recipe key of ``cls``: used by ``fgrpo plugins --keys``."""
    return [(row["key"], row["default"], row["help"]) for row in key_rows(cls)]


def key_rows(cls: type) -> list[dict[str, str]]:
    """Every recipe key of ``cls``: its name, type, default, bounds (or choices) and help, as
    ``fgrpo keys`` prints them."""
    hints = _field_types(cls)
    rows = []
    for field in public_fields(cls):
        choices = field.metadata.get("fgrpo_choices")
        allowed = ("one of " + ", ".join(map(repr, choices))) if choices else field.metadata.get("fgrpo_bounds", "")
        kind = field.metadata.get("fgrpo_kind")
        typed = f"a {kind}" if kind else _type_name(hints[field.name]) if field.name in hints else ""
        rows.append(
            {
                "key": field.name,
                "type": typed,
                "default": "required" if field.default is attrs.NOTHING else repr(default_value(field.default)),
                "allowed": "" if allowed == typed else allowed or "",
                "help": field.metadata.get("fgrpo_help", ""),
            }
        )
    return rows
