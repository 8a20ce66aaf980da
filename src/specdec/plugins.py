"""Plugin loading: built-ins as default plugins, third parties from the ``specdec`` entry-point group.

``SPECDEC_LOAD_PLUGINS`` restricts which entry points load: unset = all, empty = none, otherwise a
comma-separated allowlist of entry-point names (tests set it to stay hermetic).
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from functools import lru_cache

import click
import pluggy

from . import hookspecs
from .contracts import (
    DraftExporter,
    KVCache,
    Proposer,
    Registry,
    TrainingObjective,
    Verifier,
    cache_api_problem,
)
from .errors import PluginError

ENV_ALLOWLIST = "SPECDEC_LOAD_PLUGINS"
BUILTIN_DISTRIBUTION = "specdec (built-in)"
_KINDS = {"proposers": Proposer, "verifiers": Verifier, "caches": KVCache, "objectives": TrainingObjective,
          "exporters": DraftExporter}


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
                problem = cache_api_problem(cls) if _kind == "caches" else None
                if problem is not None:
                    raise PluginError(f"{_origin} registered an outdated cache: {problem}")
                if name in _table:
                    first = registry.origins[(_kind, name)]
                    raise PluginError(f"Two plugins register the {_kind[:-1]} {name!r}: {first} and {_origin}; "
                                      f"uninstall one of them or restrict loading with {ENV_ALLOWLIST}.")
                _table[name] = cls
                registry.origins[(_kind, name)] = _origin

            impl.function(register=register)
    return registry


def _collect_commands(pm: pluggy.PluginManager, labels: dict[str, str], registry: Registry) -> None:
    """Each plugin's `register_commands` adds to a group of its own, so a clash names both plugins."""
    for impl in pm.hook.register_commands.get_hookimpls():
        origin = labels.get(impl.plugin_name, impl.plugin_name)
        group = click.Group("specdec")
        impl.function(cli=group)
        for name, command in group.commands.items():
            if name in registry.commands:
                first = registry.origins[("commands", name)]
                raise PluginError(f"Two plugins add the command {name!r}: {first} and {origin}; uninstall one of "
                                  f"them or restrict loading with {ENV_ALLOWLIST}.")
            registry.commands[name] = command
            registry.origins[("commands", name)] = origin


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    """The registry of every loaded plugin (cached; call ``get_registry.cache_clear()`` after installing one).
    Its `commands` are empty until `get_commands()` collects them."""
    pm, labels = make_plugin_manager()
    registry = collect(pm, labels)
    _COMMAND_SOURCES[id(registry)] = (pm, labels)
    return registry


#: registry id -> the plugin manager whose commands are not collected yet (library use never collects them)
_COMMAND_SOURCES: dict[int, tuple[pluggy.PluginManager, dict[str, str]]] = {}


def get_commands() -> dict[str, click.Command]:
    """The CLI commands plugins add (`register_commands`), collected on first use: only the command line needs
    them, so importing specdec as a library never runs a plugin's command code."""
    registry = get_registry()
    source = _COMMAND_SOURCES.pop(id(registry), None)
    if source is not None:
        _collect_commands(*source, registry)
    return registry.commands


def _lookup(kind: str, name: str, unknown: str) -> type:
    table = getattr(get_registry(), kind)
    if name not in table:
        raise PluginError(unknown.format(name=name, known=", ".join(sorted(table)) or "none"))
    return table[name]


def get_proposer_class(name: str) -> type[Proposer]:
    return _lookup("proposers", name, "Unknown proposer {name!r}; choose one of: {known}.")


def get_verifier_class(name: str) -> type[Verifier]:
    return _lookup("verifiers", name, "Unknown verifier {name!r}; choose one of: {known}.")


def get_cache_class(name: str) -> type[KVCache]:
    return _lookup("caches", name, "Unknown cache {name!r}; choose one of: {known}.")


def get_objective_class(name: str) -> type[TrainingObjective]:
    return _lookup("objectives", name, "No training objective for proposer {name!r}; trainable proposers: {known}.")
