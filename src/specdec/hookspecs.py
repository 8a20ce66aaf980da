"""The hooks a specdec plugin may implement (entry-point group ``specdec``).

A plugin is a module with functions marked ``@specdec.hookimpl``. Each hook receives a ``register``
callback and calls it once per class it contributes. Built-in proposers, verifiers and caches are
registered through these same hooks, as default plugins.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("specdec")
hookimpl = pluggy.HookimplMarker("specdec")


@hookspec
def register_proposers(register: Callable[[type], None]) -> None:
    """Register proposer classes.

    :param register: call ``register(cls)`` for each :class:`specdec.Proposer` subclass. ``cls.name``
        is what ``--proposer`` takes and must be unique across all plugins; ``cls.Config`` (a
        :class:`specdec.ProposerConfig`) validates its options.
    """


@hookspec
def register_verifiers(register: Callable[[type], None]) -> None:
    """Register verifier classes.

    :param register: call ``register(cls)`` for each :class:`specdec.Verifier` subclass. A verifier
        turns the target's logits ``[B, k+1, V]`` and a draft into a :class:`specdec.Verdict`; it alone
        guarantees that output is lossless, whatever the proposer suggests.
    """


@hookspec
def register_caches(register: Callable[[type], None]) -> None:
    """Register target KV-cache classes.

    :param register: call ``register(cls)`` for each :class:`specdec.KVCache` subclass; a cache keeps a
        length per row (``lengths()``) and must support ``crop(lengths)`` so rejected draft positions can be
        rolled back. A cache for transformers' forward also provides ``hf_cache``.
    """


@hookspec
def register_objectives(register: Callable[[type], None]) -> None:
    """Register training objectives for ``specdec train --proposer NAME``.

    :param register: call ``register(cls)`` for each :class:`specdec.training.TrainingObjective`
        subclass; ``cls.name`` is the proposer it trains drafts for. The shared trainer owns the loop,
        optimiser, checkpoints and evaluation; the objective owns the draft and its loss.
    """


@hookspec
def register_commands(cli) -> None:
    """Add commands to the ``specdec`` command line.

    :param cli: the ``specdec`` :class:`click.Group`; call ``cli.add_command(command)`` (or decorate with
        ``@cli.command()``). A plugin's command name must not collide with specdec's own commands or another
        plugin's. specdec's ``export`` comes from the plugins whose drafts can be exported this way.
    """


@hookspec
def register_exporters(register: Callable[[type], None]) -> None:
    """Register draft exporters for ``specdec export``.

    :param register: call ``register(cls)`` for each :class:`specdec.contracts.DraftExporter` subclass.
        ``cls.architectures`` are the ``config.json`` architectures of the drafts it writes (``specdec export``
        picks the exporter by them, so one command exports every plugin's drafts) and ``cls.formats`` the
        layouts it writes (``--format``); ``cls.name`` must be unique across all plugins.
    """
