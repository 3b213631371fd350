"""What the config names by ``_target_`` (the model, the datasets, a ``collate_fn``, an optimizer or schedule
class), found and built here, and the one line that says why when that fails (``target_error``):

- a module that is not there (a typo): ``model._target_: brokenmd.MLP: no module named 'brokenmd' (did you
  mean 'brokenmod'?); ...``, and likewise a name the module does not have;
- a module that is there but raises while it is imported (an import of its own that fails, a syntax
  error): ``model._target_: importing brokenmod.MLP failed: ModuleNotFoundError: No module named 'x'
  (brokenmod.py:2); run with debug=true for the traceback``;
- a constructor (or function) that raises: ``model: initmod.MLP(...) raised ValueError: ... (initmod.py:6);
  run with debug=true for the traceback``.

The file and line are the innermost frame of the error's traceback that is the user's code (not Python's,
Hydra's, OmegaConf's, torch's or csframework's machinery), or a syntax error's own place.
"""
from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .config.describe import closest
from .errors import ConfigError, one_line

DEBUG_HINT = "run with debug=true for the traceback"


# -- finding and building ---------------------------------------------------------------------------------
def find_target(path: str, key: str) -> Any:
    """The object at the dotted ``path`` (its module imported), or a ``ConfigError`` naming ``key``."""
    from .hydra_session import import_object

    try:
        return import_object(path)
    except Exception as e:  # noqa: BLE001 - whatever the user's module raised, explained in one line
        raise target_error(key, path, e) from e


def build(node: Any, key: str) -> Any:
    """``node`` (a ``_target_`` and its arguments, nested ``_target_``\\ s too) built as Hydra's
    ``instantiate(node, _convert_="all")`` builds it, or a ``ConfigError`` naming the (nested) key."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    named = dict(_targets(plain, key))
    for sub_key, path in named.items():  # each found first: a failure names its own key
        find_target(path, f"{sub_key}._target_")
    try:
        return instantiate(node, _convert_="all")
    except Exception as e:  # noqa: BLE001
        raise target_error(key, named.get(key), e, named=named) from e


def call(key: str, path: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` (what ``path`` named), or a ``ConfigError`` naming ``key``."""
    try:
        return function(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise target_error(key, path, e, calling=True) from e


def _targets(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """``(key, dotted path)`` of every ``_target_`` string in ``node`` that Hydra would build, outermost first
    (not below ``_recursive_: false``: the target builds those itself, if at all)."""
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            yield key, node["_target_"]
            if node.get("_recursive_") is False:
                return
        for name, value in node.items():
            yield from _targets(value, f"{key}.{name}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{key}[{i}]")


# -- the one line -----------------------------------------------------------------------------------------
def target_error(key: str, target: str | None, error: BaseException, calling: bool = False,
                 named: dict[str, str] | None = None) -> ConfigError:
    """The ``ConfigError`` for ``error``, raised finding (importing) ``target`` or, with ``calling``, calling
    it, as configured at ``key``. A Hydra ``InstantiationException`` says itself which it was, and which
    nested key (its ``full_key``); ``named``: the dotted paths by key, as the config spells them."""
    message = str(error)
    found = re.search(r"Error (locating|in call to) target '([^']+)'", message)
    if found:
        calling, target = found.group(1) != "locating", found.group(2)
        full_key = re.search(r"full_key: (\S+)", message)
        if full_key:
            key = _absolute(key, full_key.group(1))
            target = (named or {}).get(key, target)
    cause = _cause(error)
    what = target or "the target"
    if calling:
        unknown = _unknown_argument(key, target, cause)
        return ConfigError(unknown or f"{key}: {what}(...) raised {describe(cause)}; {DEBUG_HINT}")
    key = key if key.endswith("._target_") else f"{key}._target_"
    missing = _missing(what, cause)
    if missing is not None:
        return ConfigError(f"{key}: {what}: {missing}")
    return ConfigError(f"{key}: importing {what} failed: {describe(cause)}; {DEBUG_HINT}")


def _unknown_argument(key: str, target: str | None, error: BaseException) -> str | None:
    """``model.hiden: my_models.Net takes no argument 'hiden' (did you mean 'hidden'?), set in
    conf/model/my_model.yaml; ...``: when ``error`` is the call of ``target`` itself refusing a keyword the
    config gave it (not a call inside the user's constructor), naming the file or command line that set it."""
    found = re.match(r"(\S+)\(\) got an unexpected keyword argument '([^']+)'", str(error))
    if target is None or not isinstance(error, TypeError) or found is None:
        return None
    from .config.source import where_set
    from .hydra_session import import_object

    try:
        obj = import_object(target)
        called = getattr(obj, "__init__") if isinstance(obj, type) else obj  # (a class: its constructor)
        accepted = list(inspect.signature(called).parameters)
    except Exception:  # noqa: BLE001 - no signature to read: the general line
        return None
    if found.group(1).split(".")[-2:] != getattr(called, "__qualname__", "").split(".")[-2:]:
        return None
    name = found.group(2)
    where = where_set(f"{key}.{name}")
    arguments = [a for a in accepted if a not in ("self", "args", "kwargs")]
    return (f"{key}.{name}: {target} takes no argument '{name}'{_hint(name, arguments)}"
            + (f", set in {shown_path(str(where))}" if isinstance(where, Path) else f", set {where}" if where else "")
            + f"; remove it or use one of its arguments ({', '.join(arguments) or 'none'})")


def describe(error: BaseException) -> str:
    """``Type: message (file:line)``: the error, and where in the user's code it was raised, if there."""
    if isinstance(error, SyntaxError):
        text = f"{type(error).__name__}: {error.msg}"
        return text + (f" ({shown_path(error.filename)}:{error.lineno})" if error.filename and error.lineno else "")
    where = raised_at(error)
    return f"{type(error).__name__}: {one_line(error)}" + (f" ({where})" if where else "")


def raised_at(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s traceback in the user's code: outside Python's
    library, Hydra, OmegaConf, torch and csframework (its bundled models count as the user's), preferring
    one outside ``site-packages``; ``None`` when there is none."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not internal_file(f.filename)]
    own = [f for f in frames if "-packages" + os.sep not in f.filename]
    if not frames:
        return None
    frame = (own or frames)[-1]
    return f"{shown_path(frame.filename)}:{frame.lineno}"


def _cause(error: BaseException) -> BaseException:
    """The user's exception inside Hydra's wrappers (``InstantiationException``, ``_locate``'s ``ImportError``)."""
    from hydra.errors import InstantiationException

    while error.__cause__ is not None and (isinstance(error, InstantiationException) or (
            type(error) is ImportError and str(error).startswith("Error loading '"))):
        error = error.__cause__
    return error


def _missing(target: str, error: BaseException) -> str | None:
    """What of ``target`` is not there and how to fix it, when that is the error (not a failure inside a
    module that is there)."""
    name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if not name or not (target == name or target.startswith(name + ".")):
        # `_locate`'s own getattr on a class (`initmod.MLP.nope`), not an error raised in the user's code
        if isinstance(error, AttributeError) and raised_at(error) is None:
            return f"{one_line(error)}; check the dotted path"
        return None
    parent, _, leaf = name.rpartition(".")
    module = sys.modules.get(parent) if parent else None
    if module is None:  # every installed module: only a close one, not private (`_codecs` for `my_models`)
        top = [n for n in _submodules(None) + list(sys.builtin_module_names) if not n.startswith("_")]
        return (f"no module named '{name}'{_hint(name, top, cutoff=0.8)}; "
                "check the dotted path, and that the module's directory is on the Python path (the directory "
                "you run from, or PYTHONPATH)")
    path = getattr(module, "__path__", None)  # a package's submodules may not be imported yet
    names = [n for n in dir(module) if not n.startswith("_")] + (_submodules(path) if path is not None else [])
    return f"module '{parent}' has no '{leaf}'{_hint(leaf, names)}; check the dotted path"


def _hint(word: str, options: list[str], cutoff: float = 0.6) -> str:
    close = closest(word, options, cutoff)
    return f" (did you mean '{close}'?)" if close else ""


def _submodules(path: Iterable[str] | None) -> list[str]:
    import pkgutil

    return [m.name for m in pkgutil.iter_modules(path)]


def _absolute(key: str, full_key: str) -> str:
    """Hydra's ``full_key`` of a nested node under ``key`` (relative when the node had no parent)."""
    top = key.removesuffix("._target_")
    return full_key if full_key == top or full_key.startswith(top + ".") else f"{top}.{full_key}"


def shown_path(filename: str) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return relative if not relative.startswith(os.pardir) else filename


_CSF_DIR = os.path.dirname(os.path.realpath(__file__)) + os.sep
#: csframework's own models are the user's code of a run (their constructors check their arguments)
_CSF_MODELS = (os.path.join(_CSF_DIR, "models.py"), os.path.join(_CSF_DIR, "defaults") + os.sep)


@functools.lru_cache(maxsize=1)
def _library() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Python's own library directories, and those of the packages whose frames are machinery."""
    import hydra
    import omegaconf
    import torch

    paths = sysconfig.get_paths()
    stdlib = tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})
    return stdlib, tuple(os.path.dirname(os.path.realpath(str(m.__file__))) + os.sep for m in (hydra, omegaconf, torch))


def internal_file(filename: str) -> bool:
    """Whether ``filename`` is machinery (Python's library, Hydra, OmegaConf, torch, csframework but its
    bundled models), not the user's code."""
    if not filename or filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    if path.startswith(_CSF_DIR):
        return not path.startswith(_CSF_MODELS)
    stdlib, packages = _library()
    # site-packages may lie inside the standard library's directory: what is installed there is not Python's
    return path.startswith(packages) or (path.startswith(stdlib) and "-packages" + os.sep not in path)
