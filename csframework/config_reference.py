"""The config reference, generated from the schemas: every config group with its options, every key of every
schema (the core's sections, each device type's and named backend's ``backend.*``, the installed plugins'
sections) with its type, default, allowed values and docstring, as Markdown. The docs site builds its
"Config reference" page from this (``docs/hooks.py``), so the schema dataclasses stay the one place a key
is documented.

A field's docstring is the string literal after it in its class body (read from the source with ``ast``:
Python keeps no attribute docstrings at run time)."""
from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from omegaconf import MISSING

from .config import RunConfig

#: The config groups and what each picks; their options come from the config search path.
GROUPS = {
    "device": "the device type (and with it the default backend)",
    "backend": "the backend and its settings; defaults to the `device` choice",
    "optimizer": "the optimizer and its learning-rate schedule",
    "precision": "the numeric precision policy",
    "model": "the model: any `_target_` building a `torch.nn.Module`",
    "data": "the datasets and their loaders",
}


@dataclass(frozen=True)
class Key:
    """One config key of a schema, as the reference lists it."""

    path: str
    """Its dotted path (``optimizer.schedule.warmup_steps``)."""
    type: str
    default: str
    allowed: tuple[str, ...]
    """The values it takes, when the schema closes them (an enum); empty otherwise."""
    doc: str


def field_docs(schema: type) -> dict[str, str]:
    """The docstring of each field of the dataclass ``schema`` (its bases' fields included), by name: the
    string literal that follows the field's annotation in the class body."""
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if not dataclasses.is_dataclass(cls) or cls.__module__ == "builtins":
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        except (OSError, TypeError, IndexError):  # a class made at run time (make_dataclass) has no source
            continue
        statements = body.body if isinstance(body, ast.ClassDef) else []
        for here, after in zip(statements, statements[1:]):
            if (isinstance(here, ast.AnnAssign) and isinstance(here.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[here.target.id] = inspect.cleandoc(after.value.value)
    return docs


def schema_keys(schema: type, prefix: str) -> Iterator[Key]:
    """Every key of the dataclass ``schema`` under ``prefix`` (``optimizer``), nested dataclasses expanded
    into their own keys, in the order the schema declares them."""
    hints = typing.get_type_hints(schema)
    docs = field_docs(schema)
    for item in dataclasses.fields(schema):
        path = f"{prefix}.{item.name}" if prefix else item.name
        kind = hints.get(item.name, Any)
        nested = _dataclass_of(kind)
        if nested is not None:
            yield Key(path, "section", "", (), docs.get(item.name, ""))
            yield from schema_keys(nested, path)
            continue
        yield Key(path, _type_name(kind), _default(item), _allowed(kind), docs.get(item.name, ""))


def _dataclass_of(kind: Any) -> type | None:
    return kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None


def _type_name(kind: Any) -> str:
    """A type as a config user reads it: ``int``, ``float | null``, ``list[str]``, ``one of ...``."""
    if kind is Any:
        return "any"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "str"
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names + (["null"] if type(None) in args else []))
    if origin in (list, tuple):
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "dict"
    return getattr(kind, "__name__", str(kind))


def _allowed(kind: Any) -> tuple[str, ...]:
    for arg in (kind, *typing.get_args(kind)):
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return tuple(str(member.value) for member in arg)
    return ()


def _default(item: dataclasses.Field) -> str:
    if item.default is not dataclasses.MISSING:
        value = item.default
    elif item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
    else:
        return "required"
    return "required" if value == MISSING else yaml_value(value)


def yaml_value(value: Any) -> str:
    """``value`` as it is written in a YAML file or an override: ``null``, ``true``, ``[a, b]``."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


# -- what the plugins and the config search path contribute ---------------------------------------------------
@dataclass
class Sources:
    """What the reference is made of, as composition finds it (``csf.compose``'s plugins)."""

    backends: dict[str, type]
    """Each device type's ``backend`` schema."""
    named_backends: dict[str, tuple[str, type]]
    """Each named backend's device type and schema."""
    sections: dict[str, type]
    """The installed plugins' config sections."""
    options: dict[str, dict[str, dict[str, Any]]]
    """Each group's options: name -> the values its file sets."""
    defaults: dict[str, str]
    """The option of each group that ``python -m csframework`` composes with no overrides."""
    root_settings: dict[str, Any]
    """What the primary config (``conf/config.yaml``) sets below its defaults list, flattened."""


def gather(plugins: Iterable[Any] = ()) -> Sources:
    """The schemas, group options and defaults of this installation (the entry-point plugins, and
    ``plugins`` besides them, as ``csf.compose(plugins=...)`` takes them)."""
    from . import hydra_session
    from .api import composition

    found = composition(plugins)
    cfg = hydra_session.compose_dict(config_files=found.config_files, sections=found.sections)
    defaults = {group: str(cfg.hydra.runtime.choices[group]) for group in GROUPS}
    primary, written = hydra_session.written_configs(GROUPS)
    options = {group: {name: _plain(node) for name, node in by_name.items()} for group, by_name in written.items()}
    root = {key: value for key, value in _flatten(_plain(primary)).items() if not key.startswith("hydra.")}
    return Sources(found.schemas, found.named, found.sections, options, defaults, root)


def _plain(node: Any) -> dict[str, Any]:
    """A config file's settings as plain data, its defaults list left out."""
    from omegaconf import OmegaConf

    value = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    return {str(k): v for k, v in value.items() if k != "defaults"} if isinstance(value, dict) else {}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}`` (an empty dict stays a value)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# -- Markdown -------------------------------------------------------------------------------------------------
def markdown(sources: Sources | None = None) -> str:
    """The whole reference (headings from level 2 down), for ``sources`` or this installation's."""
    src = sources or gather()
    hints = typing.get_type_hints(RunConfig)
    root_docs = field_docs(RunConfig)
    parts = [_overview(src)]
    for group in GROUPS:
        parts.append(f"## `{group}`\n\n{root_docs.get(group, '')}\n\n{_options(group, src)}")
        if group == "backend":
            parts.append(_backends(src))
        elif _dataclass_of(hints[group]) is not None:
            parts.append(_table(schema_keys(hints[group], group)))
    for name in (f.name for f in dataclasses.fields(RunConfig)):
        if name in GROUPS:
            continue
        schema = _dataclass_of(hints[name])
        body = _table(schema_keys(schema, name)) if schema else _table(
            key for key in schema_keys(RunConfig, "") if key.path == name)
        parts.append(f"## `{name}`\n\n{root_docs.get(name, '')}\n\n{body}")
    parts.append(_plugin_sections(src))
    return "\n\n".join(part.strip() for part in parts if part.strip()) + "\n"


def _overview(src: Sources) -> str:
    """What the default run composes, and the groups at a glance."""
    choices = " ".join(f"`{group}={option}`" for group, option in src.defaults.items())
    settings = ", ".join(f"`{key}={yaml_value(value)}`" for key, value in src.root_settings.items())
    rows = "\n".join(f"| [`{group}`](#{group}) | {what} | "
                     f"{', '.join(f'`{o}`' for o in src.options[group]) or '(none built in)'} | "
                     f"`{src.defaults[group]}` |" for group, what in GROUPS.items())
    return (f"`python -m csframework` with no overrides composes {choices}, and its primary config "
            f"(`conf/config.yaml`) sets {settings}.\n\n"
            f"| group | picks | options | default |\n| --- | --- | --- | --- |\n{rows}")


def _options(group: str, src: Sources) -> str:
    """Each option of ``group`` with what its file sets."""
    lines = [f"- `{group}={name}`: " + (", ".join(f"`{key}={yaml_value(value)}`"
                                                   for key, value in _flatten(values).items()) or "no settings")
             for name, values in src.options[group].items()]
    return f"Options (default `{src.defaults[group]}`):\n\n" + "\n".join(lines) if lines else ""


def _backends(src: Sources) -> str:
    """``backend.*`` of each device type's backend and of each named backend."""
    titled = [(f"on device type `{device_type}`", schema) for device_type, schema in src.backends.items()]
    titled += [(f"of `backend={name}` (device type `{device_type}`)", schema)
               for name, (device_type, schema) in src.named_backends.items()]
    return "\n\n".join(f"### `backend.*` {title}\n\nSchema `{schema.__module__}.{schema.__qualname__}`.\n\n"
                       f"{_table(schema_keys(schema, 'backend'))}" for title, schema in titled)


def _plugin_sections(src: Sources) -> str:
    """Each installed plugin's section: its schema's docstring and keys."""
    if not src.sections:
        return "## Plugin sections\n\nNo installed plugin declares a config section."
    parts = ["## Plugin sections\n\nDeclared by the installed plugins (`csframework_config_sections`); each is a "
             "top-level key, set and checked like the built-in ones."]
    for name, schema in sorted(src.sections.items()):
        doc = inspect.cleandoc(schema.__doc__ or "") if schema.__doc__ and not schema.__doc__.startswith(
            f"{schema.__name__}(") else ""
        parts.append(f"### `{name}`\n\nSchema `{schema.__module__}.{schema.__qualname__}`"
                     f"{': ' + _cell(doc) if doc else ''}.\n\n{_table(schema_keys(schema, name))}")
    return "\n\n".join(parts)


def _table(keys: Iterable[Key]) -> str:
    """The keys as one table: key, type, default, allowed values, description."""
    rows = [f"| `{key.path}` | `{key.type}` | {'' if key.type == 'section' else f'`{key.default}`'} | "
            f"{', '.join(f'`{v}`' for v in key.allowed)} | {_cell(key.doc)} |" for key in keys]
    return "| key | type | default | allowed values | description |\n| --- | --- | --- | --- | --- |\n" + "\n".join(rows)


def _cell(text: str) -> str:
    """``text`` on one line of a Markdown table: reST's double backticks as code, no line breaks, and pipes
    escaped outside code spans (inside one, a table keeps them as they are)."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.replace("``", "`").split()))
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


if __name__ == "__main__":  # `python -m csframework.config_reference`: the reference without building the site
    print(markdown(), end="")
