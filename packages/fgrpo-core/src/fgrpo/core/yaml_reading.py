"""Bounded YAML for recipes and everything else fgrpo reads as YAML: plain data only (no tags), no
duplicate keys, aliases bounded (an alias bomb stops at :data:`MAX_ALIAS_EXPANSION` values), and
``--set KEY=VALUE`` overrides applied to the parsed mapping. Every problem is a
:class:`~fgrpo.core.config.ConfigError` naming the file, line and column."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import yaml

from fgrpo.core.config import ConfigError, RecipeError, first_line, shown


def _yaml_error(source: str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
    problem = getattr(exc, "problem", None) or first_line(exc)
    if isinstance(exc, yaml.constructor.ConstructorError) and "tag" in str(problem):
        tag = problem.split("tag", 1)[1].strip().strip("'")
        return ConfigError(where, f"the YAML tag {tag} is not allowed: recipes are plain data (yaml.safe_load)")
    return ConfigError(where, f"malformed YAML: {problem}")


#: how many values YAML aliases (``*name``) may add to a document: a recipe needs a handful; an
#: alias bomb (a kilobyte that expands to hundreds of millions of values) stops here
MAX_ALIAS_EXPANSION = 100_000


MERGE_TAG = "tag:yaml.org,2002:merge"


def _children(node: yaml.Node) -> list[tuple[str | None, yaml.Node]]:
    """(key text or None, child) pairs: a mapping's keys and values, a sequence's items."""
    if isinstance(node, yaml.MappingNode):
        out: list[tuple[str | None, yaml.Node]] = []
        for key, value in node.value:
            out += [(None, key), (key.value if isinstance(key, yaml.ScalarNode) else None, value)]
        return out
    if isinstance(node, yaml.SequenceNode):
        return [(str(i), item) for i, item in enumerate(node.value)]
    return []


def _node_errors(root: yaml.Node, source: str) -> tuple[ConfigError | None, list[ConfigError]]:
    """(an alias that refers to itself or expands the document by more than MAX_ALIAS_EXPANSION
    values, the duplicate keys YAML would silently drop): one pass over the distinct nodes."""
    errors: list[ConfigError] = []
    size: dict[int, int] = {}  # values under a node, aliases expanded
    path: dict[int, str] = {id(root): ""}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        ident = id(node)
        if finished:
            on_path.discard(ident)
            size[ident] = 1 + sum(size[id(child)] for _, child in _children(node))
            continue
        if ident in size:
            continue
        if ident in on_path:
            line = node.start_mark.line + 1
            return ConfigError(f"{source}:{line}", "a YAML alias refers to a value that contains it (a cycle)"), errors
        on_path.add(ident)
        stack.append((node, True))
        if isinstance(node, yaml.MappingNode):
            errors += _duplicates(node, path[ident], source)
        for key, child in _children(node):
            if key is not None:
                path.setdefault(id(child), f"{path[ident]}.{key}" if path[ident] else key)
            stack.append((child, False))
    distinct = len(size)
    if size[id(root)] - distinct > MAX_ALIAS_EXPANSION:
        return ConfigError(
            source,
            f"YAML aliases (*name) expand it by more than {MAX_ALIAS_EXPANSION} values; a recipe needs far fewer",
        ), errors
    return None, errors


def _duplicates(node: yaml.MappingNode, where: str, source: str) -> list[ConfigError]:
    first: dict[str, int] = {}
    errors = []
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE_TAG:
            continue
        line = key.start_mark.line + 1
        if key.value in first:
            name = f"{where}.{key.value}" if where else key.value
            what = "section" if not where else "key"
            errors.append(
                ConfigError(
                    name, f"duplicate {what} ({source}:{line}, first at line {first[key.value]}); write it once"
                )
            )
        else:
            first[key.value] = line
    return errors


def load_yaml(text: str, source: str = "recipe") -> tuple[Any, list[ConfigError]]:
    """The data of a YAML document (``yaml.safe_load``) and its duplicate keys; raises RecipeError
    when it is malformed or its aliases expand it too far."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        fatal, duplicates = _node_errors(node, source)
        if fatal is not None:
            raise RecipeError([fatal])
        return loader.construct_document(node), duplicates
    except yaml.YAMLError as exc:
        raise RecipeError([_yaml_error(source, exc)]) from None
    except RecursionError:
        raise RecipeError([ConfigError(source, "nested too deeply to be a recipe")]) from None
    finally:
        loader.dispose()


def read_yaml(text: str, source: str = "recipe") -> Any:
    data, errors = load_yaml(text, source)
    if errors:
        raise RecipeError(errors)
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML; typed later by the schema)."""
    if "=" not in item:
        raise RecipeError([ConfigError("--set", f"expected KEY=VALUE (e.g. train.lr=1e-4), got {shown(item)}")])
    key, raw = item.split("=", 1)
    path = [part for part in key.strip().split(".")]
    if not all(path):
        raise RecipeError([ConfigError("--set", f"bad key {shown(key)}: expected dotted keys like train.lr")])
    return path, read_yaml(raw, f"--set {key}") if raw.strip() else ""


def apply_overrides(data: Any, overrides: Sequence[str]) -> tuple[Any, list[ConfigError]]:
    errors: list[ConfigError] = []
    data = copy.deepcopy(data)
    for item in overrides:
        try:
            path, value = parse_override(item)
        except RecipeError as exc:
            errors.extend(exc.errors)
            continue
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = _child(node, part)
            if nxt is None:
                if isinstance(node, dict):
                    node[part] = nxt = {}
                else:
                    errors.append(ConfigError(".".join(path[: i + 1]), "cannot set a key inside a non-mapping"))
                    break
            node = nxt
        else:
            last = path[-1]
            if isinstance(node, list) and last.isdigit() and int(last) < len(node):
                node[int(last)] = value
            elif isinstance(node, dict):
                node[last] = value
            else:
                errors.append(ConfigError(".".join(path), "cannot set a key inside a non-mapping"))
    return data, errors


def _child(node: Any, part: str) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    return None
