"""Read-only configs: once a run is validated, ``run.config`` and its stage configs cannot be changed.

A plugin that changed a setting mid-run would make the run differ from its composed config (which the
checkpoints record) without saying so. The schema dataclasses mix in :class:`ReadOnly`; :func:`freeze`
marks a config tree read-only, turning the plain dicts and lists inside it (``model``, ``data.train``,
``stages``, ``plugins.enable`` ...) into read-only OmegaConf containers: Hydra's ``instantiate``,
``OmegaConf.structured`` / ``to_container`` take them as they are (OmegaConf refuses a ``dict`` subclass in
an ``Any`` field, so a read-only ``dict`` type would break ``OmegaConf.structured(run.config)``).
A copy (``copy.deepcopy(run.config)``, pickling) is mutable again, with plain dicts and lists.
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ReadonlyConfigError

from ..errors import ReadOnlyConfigError

_FROZEN = "_csf_read_only"  # instance attribute of a frozen dataclass: (root label, path of the node)
_FLAG = "csframework_run_config"  # OmegaConf flag of the read-only dicts of a frozen config
_T = TypeVar("_T")


def _refuse(root: str, key: str) -> ReadOnlyConfigError:
    return ReadOnlyConfigError(f"{root} is read-only while the run runs: {key} cannot be changed; set it in "
                               f"the config ({key}=...), or adjust it in a csframework_configure hook")


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


class ReadOnly:
    """Mixin of the config schemas: ``__setattr__`` / ``__delattr__`` refuse once :func:`freeze` ran."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        self._check_writable(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._check_writable(name)
        object.__delattr__(self, name)

    def _check_writable(self, name: str) -> None:
        frozen = self.__dict__.get(_FROZEN)
        if frozen is not None:
            raise _refuse(frozen[0], _join(frozen[1], name))

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles are mutable, with plain dicts and lists as before freezing
        return {k: _thaw(v) for k, v in self.__dict__.items() if k != _FROZEN}


def _thaw(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)) and (value._metadata.flags or {}).get(_FLAG) is not None:
        return OmegaConf.to_container(value)
    return value


def _read_only_container(value: dict[str, Any] | list[Any], path: str) -> DictConfig | ListConfig:
    """``value`` as a read-only OmegaConf container whose keys OmegaConf names from the config's root
    (``model.net.hidden``): created inside its parents' keys, then taken out."""
    parts = path.split(".") if path else []
    wrapped: Any = value
    for part in reversed(parts):
        wrapped = {part: wrapped}
    node: Any = OmegaConf.create(wrapped, flags={"allow_objects": True})
    for part in parts:
        node = node[part]
    # The path is kept on the node, for the error: OmegaConf.structured(run.config) re-parents the node,
    # after which OmegaConf's own full_key no longer starts at the config's root.
    node._metadata.flags[_FLAG] = path
    OmegaConf.set_readonly(node, True)
    container: DictConfig | ListConfig = node
    return container


def read_only_error(error: BaseException) -> ReadOnlyConfigError | None:
    """OmegaConf's refusal to change a read-only dict of a frozen config, as the error a dataclass field
    gives; ``None`` for any other error."""
    if not isinstance(error, ReadonlyConfigError):
        return None
    keys, node = [error.key], error.parent_node
    while node is not None:
        path = node._metadata.flags.get(_FLAG)
        if path is not None:
            key = path + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys) if k is not None)
            return _refuse("run.config", key)
        keys.append(node._key())
        node = node._get_parent()
    return None


def freeze(config: _T, root: str = "run.config") -> _T:
    """Make ``config`` (a schema dataclass instance) read-only in place, with everything in it; ``root``
    names it in the error. Returns it."""
    frozen: _T = _freeze(config, root, "")
    return frozen


def _freeze(value: Any, root: str, path: str) -> Any:
    if isinstance(value, ReadOnly) and dataclasses.is_dataclass(value):
        if _FROZEN not in value.__dict__:
            for f in dataclasses.fields(value):
                object.__setattr__(value, f.name, _freeze(getattr(value, f.name), root, _join(path, f.name)))
            object.__setattr__(value, _FROZEN, (root, path))
        return value
    if isinstance(value, (dict, list)):
        return _read_only_container(value, path)
    return value


def plain(args: Any) -> dict[str, Any]:
    """``args`` (a mapping of keyword arguments, or ``None``) as a plain dict of plain values: a frozen run
    config holds read-only OmegaConf containers, which a constructor must not receive."""
    container: Any = OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else args
    return {str(key): value for key, value in dict(container or {}).items()}
