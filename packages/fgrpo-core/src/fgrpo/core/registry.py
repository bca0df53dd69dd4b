"""Components found through entry points, one group per kind, or registered by a script.

Built-ins register exactly like third-party packages: ``[project.entry-points."fgrpo.rewards"]``
in a pyproject.toml. Listing names reads package metadata only; a component's module is imported
when it is first loaded, so one broken plugin never breaks the others. A component defined in a
script or a notebook is registered with :func:`register` and is then found, listed, checked and
built exactly like an entry point's (docs/python-api.md).
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import re
import warnings
from collections.abc import Mapping
from typing import Any

import attrs
from packaging.requirements import InvalidRequirement, Requirement

from fgrpo.core.config import ConfigError, DeprecatedKey, RecipeError, check_params
from fgrpo.core.shipped import missing_provider_hint

#: kind -> entry-point group
GROUPS: dict[str, str] = {
    "kernel": "fgrpo.kernels",
    "sampler": "fgrpo.samplers",
    "reward": "fgrpo.rewards",
    "model": "fgrpo.models",
    "objective": "fgrpo.objectives",
    "prompts": "fgrpo.prompts",
    "evaluator": "fgrpo.evaluators",
}


class ComponentError(Exception):
    """A component cannot be loaded; ``str()`` is a one-line, user-facing explanation."""


class UnknownComponent(ComponentError):
    pass


class PluginImportError(ComponentError):
    pass


class MissingExtra(ComponentError):
    pass


class AmbiguousComponent(ComponentError):
    """Two distributions register the same name."""


class BuildError(ComponentError):
    """A component rejected its (well-typed) parameters or its files while being built."""


@attrs.frozen
class Entry:
    kind: str
    name: str
    target: str  # "module:attr"
    distribution: str
    version: str
    extras: tuple[str, ...]

    @property
    def install_hint(self) -> str:
        extras = ",".join(self.extras)
        return f'pip install "{self.distribution}[{extras}]"' if extras else f"pip install {self.distribution}"


def _check_kind(kind: str) -> str:
    if kind not in GROUPS:
        raise UnknownComponent(f"unknown component kind {kind!r}; kinds: {', '.join(GROUPS)}")
    return GROUPS[kind]


@attrs.frozen
class _Registered:
    """A component registered by :func:`register`: it answers what the registry asks of an entry
    point (name, value, extras, dist, load)."""

    name: str
    obj: Any
    extras: tuple[str, ...] = ()
    dist: None = None

    @property
    def value(self) -> str:
        return f"{getattr(self.obj, '__module__', '?')}:{getattr(self.obj, '__qualname__', type(self.obj).__name__)}"

    @property
    def source(self) -> str:
        return f"registered in {getattr(self.obj, '__module__', None) or '?'}"

    def load(self) -> Any:
        return self.obj


#: kind -> name -> component registered by :func:`register` (this process only)
_registered: dict[str, dict[str, _Registered]] = {}
#: what a component name may be: what an entry point's name may be, without spaces or "="
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def register(kind: str, name: str, obj: Any = None) -> Any:
    """Make ``obj`` (a component class or factory defined in a script or a notebook) the ``kind``
    component ``name``: recipes name it, ``validate`` checks its keys, ``build`` builds it and
    ``fgrpo plugins`` lists it, exactly as an entry point's. Returns ``obj``; without ``obj`` it is a
    class decorator (``@register("reward", "redness")``).

    Refused with a :class:`ComponentError` (one line): an unknown kind, a name an entry point
    could not have, something that is not callable, or a name an installed distribution already
    registers (a recipe could not say which it means). Registering the same name again replaces
    the earlier registration (a notebook cell run twice); :func:`unregister` takes it back.
    """
    if obj is None:
        return lambda target: register(kind, name, target)
    _check_kind(kind)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ComponentError(
            f"register({kind!r}, {name!r}): a component name is letters, digits, '.', '_' and '-', starting with a "
            f"letter or digit"
        )
    if not callable(obj):
        raise ComponentError(
            f"register({kind!r}, {name!r}): expected a component class or factory, got {type(obj).__name__}"
        )
    installed = sorted({_distribution(ep) for ep in _entry_point_registrations(kind).get(name, [])})
    if installed:
        raise AmbiguousComponent(
            f"{kind} {name!r} is already registered by {' and '.join(installed)}; register yours under another name"
        )
    _registered.setdefault(kind, {})[name] = _Registered(name, obj)
    _loaded.pop((kind, name), None)
    return obj


def unregister(kind: str, name: str) -> None:
    """Take back :func:`register` (a name that was never registered is left alone)."""
    _check_kind(kind)
    _registered.get(kind, {}).pop(name, None)
    _loaded.pop((kind, name), None)


def _entry_point_registrations(kind: str) -> dict[str, list[md.EntryPoint]]:
    group = _check_kind(kind)
    found: dict[str, list[md.EntryPoint]] = {}
    for ep in md.entry_points(group=group):
        found.setdefault(ep.name, []).append(ep)
    return found


def _registrations(kind: str) -> dict[str, list[Any]]:
    """Every registration of ``kind`` by name (entry points, then :func:`register`'s): more than
    one when distributions collide."""
    found: dict[str, list[Any]] = _entry_point_registrations(kind)
    for name, item in _registered.get(kind, {}).items():
        found.setdefault(name, []).append(item)
    return found


def _entry_points(kind: str) -> dict[str, Any]:
    return {name: eps[0] for name, eps in _registrations(kind).items()}


def _distribution(ep: Any) -> str:
    if isinstance(ep, _Registered):
        return ep.source
    return ep.dist.metadata["Name"] if ep.dist is not None else "?"


def rivals(kind: str, name: str) -> list[str]:
    """The distributions that register ``name`` when more than one does (a recipe cannot say
    which it means, so fgrpo refuses to pick)."""
    found = sorted({_distribution(ep) for ep in _registrations(kind).get(name, [])})
    return found if len(found) > 1 else []


def names(kind: str) -> list[str]:
    """The registered names of ``kind``, sorted; imports no component."""
    return sorted(_entry_points(kind))


def _as_entry(kind: str, ep: Any) -> Entry:
    dist = ep.dist
    return Entry(
        kind=kind,
        name=ep.name,
        target=ep.value.split("[")[0].strip(),
        distribution=_distribution(ep),
        version=dist.version if dist is not None else "" if isinstance(ep, _Registered) else "?",
        extras=tuple(ep.extras),
    )


def entries(kind: str) -> list[Entry]:
    """Every registration of ``kind`` (a name registered by two distributions appears twice)."""
    found = _registrations(kind)
    return [_as_entry(kind, ep) for name in sorted(found) for ep in found[name]]


def entry(kind: str, name: str) -> Entry:
    eps = _entry_points(kind)
    if name not in eps:
        available = sorted(eps)
        close = difflib.get_close_matches(name, available, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        listing = ", ".join(available) or "none installed"
        provider = missing_provider_hint(kind, name)
        if provider is not None:  # a built-in name whose package is absent: say which to install
            raise UnknownComponent(f"unknown {kind} {name!r}: {provider}; available: {listing}")
        raise UnknownComponent(f"unknown {kind} {name!r}{hint}; available: {listing}")
    return _as_entry(kind, eps[name])


def missing_requirements(entry: Entry) -> list[str]:
    """Requirements of the entry point's extras (on this Python and platform) that are not installed."""
    if not entry.extras:
        return []
    try:
        requires = md.distribution(entry.distribution).requires or []
    except md.PackageNotFoundError:
        return []
    missing = []
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is None or not any(req.marker.evaluate({"extra": extra}) for extra in entry.extras):
            continue
        try:
            md.distribution(req.name)
        except md.PackageNotFoundError:
            missing.append(req.name)
    return missing


_loaded: dict[tuple[str, str], Any] = {}


def load(kind: str, name: str) -> Any:
    """The component class (or factory) registered as ``name``; raises a ComponentError."""
    if (kind, name) in RENAMED and name not in _entry_points(kind):  # the old name of a built-in
        name = RENAMED[(kind, name)]
    key = (kind, name)
    if key in _loaded:
        return _loaded[key]
    info = entry(kind, name)
    both = rivals(kind, name)
    if both:
        raise AmbiguousComponent(
            f"{kind} {name!r} is registered by {' and '.join(both)}; fgrpo will not pick one: "
            f"uninstall one of them (pip uninstall {both[-1]})"
        )
    missing = missing_requirements(info)
    if missing:
        raise MissingExtra(f"{kind} {name!r} needs {', '.join(missing)}: {info.install_hint}")
    ep = _entry_points(kind)[name]
    try:
        obj = ep.load()
    except BaseException as exc:  # a plugin's bug (even sys.exit() or KeyboardInterrupt) must not take the others down
        raise PluginImportError(
            f"{kind} {name!r} from {info.distribution} failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    undeclared = [member for member in DECLARED.get(kind, ()) if not hasattr(obj, member)]
    if undeclared:
        raise ComponentError(
            f"{kind} {name!r} from {info.distribution} does not declare {', '.join(undeclared)}: {DECLARED_HINT[kind]}"
        )
    _loaded[key] = obj
    return obj


#: the members a component class of a kind declares, read by the trainer as typed attributes
DECLARED = {"objective": ("trains_on", "needs_reference", "needs_old", "samples_from_old", "pairwise")}
DECLARED_HINT = {
    "objective": "subclass fgrpo.core.objectives.base.TransitionObjective or ForwardProcessObjective, which "
    "declare them (fgrpo.core.protocols.Objective says what each means)"
}


def status(entry_: Entry) -> tuple[str, str]:
    """('ok' | 'missing extra' | 'conflict' | 'import error', detail) without raising."""
    try:
        load(entry_.kind, entry_.name)
    except MissingExtra as exc:
        return "missing extra", str(exc)
    except AmbiguousComponent as exc:
        return "conflict", str(exc)
    except ComponentError as exc:
        return "import error", str(exc)
    return "ok", ""


def split_spec(kind: str, spec: Any, key: str = "") -> tuple[str, dict[str, Any]]:
    """A recipe spec — ``"sde"`` or ``{name: sde, eta: 0.7}`` — as (name, params)."""
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise RecipeError(
                [
                    ConfigError(
                        f"{key}.name" if key else "name",
                        f"missing required key (the {kind} to use; available: {', '.join(names(kind))})",
                    )
                ]
            )
        name = spec["name"]
        if not isinstance(name, str):
            raise RecipeError(
                [ConfigError(f"{key}.name", f"expected a string, got {name!r}; available: {', '.join(names(kind))}")]
            )
        return name, {k: v for k, v in spec.items() if k != "name"}
    raise RecipeError([ConfigError(key or kind, f"expected a {kind} name or a mapping with 'name', got {spec!r}")])


#: built-in components renamed, (kind, old name) -> new name: a recipe that names the old one gets
#: it, with one ``note:`` line (the kernel ``ode`` became ``euler``: ``ode`` is the sampler's name)
RENAMED: dict[tuple[str, str], str] = {("kernel", "ode"): "euler"}


def current_name(kind: str, name: str, key: str = "") -> str:
    """``name``, or the new name of a renamed built-in (a :class:`~fgrpo.core.config.DeprecatedKey`
    warning names it) unless a plugin registers the old name itself."""
    new = RENAMED.get((kind, name))
    if new is None or name in _entry_points(kind):
        return name
    where = f"{key}.name" if key else "name"
    warnings.warn(DeprecatedKey(f"{where}: the {kind} {name!r} is deprecated: it is now {new!r}"), stacklevel=3)
    return new


def check_spec(kind: str, spec: Any, key: str = "") -> tuple[dict[str, Any], list[ConfigError]]:
    """Validate a spec without building it: returns ({name, **params with defaults}, errors)."""
    if not isinstance(spec, (str, Mapping)):
        if _satisfies(kind, spec):
            return spec, []
    try:
        name, params = split_spec(kind, spec, key)
    except RecipeError as exc:
        return {}, exc.errors
    name = current_name(kind, name, key)
    try:
        cls = load(kind, name)
    except ComponentError as exc:
        return {"name": name, **params}, [ConfigError(f"{key}.name" if key else "name", str(exc))]
    checked, errors = check_params(cls, params, key)
    return {"name": name, **checked}, errors


def _satisfies(kind: str, obj: Any) -> bool:
    from fgrpo.core import protocols  # lazy: it imports torch, which listing names never needs

    proto = {
        "kernel": protocols.Kernel,
        "sampler": protocols.Sampler,
        "reward": protocols.Reward,
        "model": protocols.Policy,
        "objective": protocols.Objective,
        "prompts": protocols.PromptSource,
        "evaluator": protocols.Evaluator,
    }[kind]
    return isinstance(obj, proto)


def create(kind: str, name: str, **params: Any) -> Any:
    """Build the component ``name`` of ``kind`` after checking every parameter.

    Raises :class:`RecipeError` listing all bad parameters, before anything heavy is built.
    """
    return build(kind, load(kind, name), params, name)


def build(kind: str, cls: type, params: Mapping[str, Any], name: str = "") -> Any:
    """Build ``cls`` (a component class, registered or not) from recipe keys, checked as
    :func:`create` checks them."""
    checked, errors = check_params(cls, params, kind)
    if errors:
        raise RecipeError(errors)
    return construct(kind, cls, checked, name)


def construct(kind: str, cls: type, checked: Mapping[str, Any], name: str = "") -> Any:
    """Build ``cls`` from recipe keys that :func:`check_params` has checked (those of a validated
    recipe): its nested components are built from their checked specs, not checked again."""
    values = dict(checked)
    for field in attrs.fields(cls) if attrs.has(cls) else ():
        nested, spec = field.metadata.get("fgrpo_kind"), values.get(field.name)
        if nested is not None and isinstance(spec, Mapping):
            params = {k: v for k, v in spec.items() if k != "name"}
            values[field.name] = construct(nested, load(nested, spec["name"]), params, spec["name"])
    try:
        return cls(**values)
    except (ValueError, OSError, ImportError) as exc:
        raise BuildError(f"{kind} {name or cls.__name__!r} could not be built: {exc}") from exc
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        raise BuildError(
            f"{kind} {name or cls.__name__!r} could not be built: out of memory ({first}); "
            "make it smaller or use a machine with more memory"
        ) from None


def _out_of_memory(exc: BaseException) -> bool:
    """torch's allocators raise RuntimeError (CPU: "can't allocate memory") or its subclass
    OutOfMemoryError (CUDA); Python raises MemoryError."""
    text = str(exc)
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def resolve(kind: str, spec: Any) -> Any:
    """A built component from a name, a ``{name: ..., **params}`` mapping or an existing object."""
    if not isinstance(spec, (str, Mapping)):
        return spec
    name, params = split_spec(kind, spec, kind)
    return create(kind, name, **params)


def component(kind: str, default: Any = attrs.NOTHING, *, help: str = "") -> Any:
    """A recipe key holding a nested component of ``kind``: a registered name, a ``{name: ...,
    **params}`` mapping, or a built object (``kernel: Any = component("kernel", default="sde")``).
    It is checked with :func:`check_spec` and built with :func:`resolve`."""
    return attrs.field(
        default=default,
        converter=lambda value: resolve(kind, value),
        metadata={"fgrpo_kind": kind, "fgrpo_help": help, "fgrpo_check": check_spec},
    )
