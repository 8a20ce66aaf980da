"""Plugin loading: built-ins as default plugins, third parties from the ``specdec`` entry-point group.

``SPECDEC_LOAD_PLUGINS`` restricts which entry points load: unset = all, empty = none, otherwise a
comma-separated allowlist of entry-point names (tests set it to stay hermetic).
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from functools import lru_cache

import pluggy

from . import hookspecs
from .contracts import KVCache, Proposer, Registry, Verifier
from .errors import PluginError
from .training.objective import TrainingObjective

ENV_ALLOWLIST = "SPECDEC_LOAD_PLUGINS"
BUILTIN_DISTRIBUTION = "specdec (built-in)"
_KINDS = {"proposers": Proposer, "verifiers": Verifier, "caches": KVCache, "objectives": TrainingObjective}


def _allowed_entry_points() -> set[str] | None:
    raw = os.environ.get(ENV_ALLOWLIST)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _distribution_label(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return f"entry point {entry_point.name}"
    return f"{dist.metadata['Name']} {dist.version}"


def make_plugin_manager() -> tuple[pluggy.PluginManager, dict[str, str]]:
    """A plugin manager with the built-ins and every allowed entry point; returns plugin -> distribution."""
    from . import builtin

    pm = pluggy.PluginManager("specdec")
    pm.add_hookspecs(hookspecs)
    labels: dict[str, str] = {}
    pm.register(builtin, name="specdec.builtin")
    labels["specdec.builtin"] = BUILTIN_DISTRIBUTION
    allowed = _allowed_entry_points()
    for entry_point in importlib.metadata.entry_points(group="specdec"):
        if allowed is not None and entry_point.name not in allowed:
            continue
        if pm.get_plugin(entry_point.name) is not None:
            continue
        try:
            module = entry_point.load()
        except Exception as exc:  # a broken plugin must not take the others down
            warnings.warn(
                f"specdec plugin {entry_point.name!r} ({_distribution_label(entry_point)}) failed to load and "
                f"was skipped: {type(exc).__name__}: {exc}",
                stacklevel=2,
            )
            continue
        pm.register(module, name=entry_point.name)
        labels[entry_point.name] = _distribution_label(entry_point)
    return pm, labels


def collect(pm: pluggy.PluginManager, labels: dict[str, str]) -> Registry:
    registry = Registry()
    for kind, base in _KINDS.items():
        table = getattr(registry, kind)
        hook = getattr(pm.hook, f"register_{kind}")
        for impl in hook.get_hookimpls():
            origin = labels.get(impl.plugin_name, impl.plugin_name)

            def register(cls: type, _table=table, _kind=kind, _base=base, _origin=origin) -> None:
                if not (isinstance(cls, type) and issubclass(cls, _base)):
                    raise PluginError(f"{_origin} registered {cls!r} as one of the {_kind}, but it is not a "
                                      f"subclass of specdec.{_base.__name__}; subclass it.")
                name = getattr(cls, "name", "")
                if not name:
                    raise PluginError(f"{_origin} registered {cls.__name__} without a `name`; give the class a "
                                      f"unique `name` attribute.")
                if name in _table:
                    first = registry.origins[(_kind, name)]
                    raise PluginError(f"Two plugins register the {_kind[:-1]} {name!r}: {first} and {_origin}; "
                                      f"uninstall one of them or restrict loading with {ENV_ALLOWLIST}.")
                _table[name] = cls
                registry.origins[(_kind, name)] = _origin

            impl.function(register=register)
    return registry


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    """The registry of every loaded plugin (cached; call ``get_registry.cache_clear()`` after installing one)."""
    pm, labels = make_plugin_manager()
    return collect(pm, labels)


def get_proposer_class(name: str) -> type[Proposer]:
    registry = get_registry()
    if name not in registry.proposers:
        known = ", ".join(sorted(registry.proposers))
        raise PluginError(f"Unknown proposer {name!r}; choose one of: {known}.")
    return registry.proposers[name]


def get_verifier_class(name: str) -> type[Verifier]:
    registry = get_registry()
    if name not in registry.verifiers:
        known = ", ".join(sorted(registry.verifiers))
        raise PluginError(f"Unknown verifier {name!r}; choose one of: {known}.")
    return registry.verifiers[name]


def get_cache_class(name: str) -> type[KVCache]:
    registry = get_registry()
    if name not in registry.caches:
        known = ", ".join(sorted(registry.caches))
        raise PluginError(f"Unknown cache {name!r}; choose one of: {known}.")
    return registry.caches[name]


def get_objective_class(name: str) -> type:
    registry = get_registry()
    if name not in registry.objectives:
        known = ", ".join(sorted(registry.objectives)) or "none"
        raise PluginError(f"No training objective for proposer {name!r}; trainable proposers: {known}.")
    return registry.objectives[name]
