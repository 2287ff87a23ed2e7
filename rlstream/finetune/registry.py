"""Component registries: ``_type`` name -> (config class, factory), one per kind of component.

A factory is called ``factory(config, builder)`` where ``builder`` is the run's
:class:`~rlstream.finetune.context.FinetuneContext` (NAT passes its workflow Builder there). It may be an
async generator that yields the component (NAT's form; code after ``yield`` runs at cleanup), a
coroutine function, or a plain function::

    class MyBuilderConfig(TrajectoryBuilderConfig, name="my_traj_builder"):
        num_generations: int = 2

    @register_trajectory_builder(config_type=MyBuilderConfig)
    async def my_trajectory_builder(config, builder):
        yield MyTrajectoryBuilder(trajectory_builder_config=config)

Select it with ``finetuning.trajectory_builder: my_traj_builder`` (the ``_type`` itself) or by a named entry
``finetuning.trajectory_builders: {mine: {_type: my_traj_builder, num_generations: 4}}`` and
``finetuning.trajectory_builder: mine``. Modules listed in ``finetuning.plugins`` are imported first.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Literal

from rlstream.finetune.interfaces import (ComponentConfig, Trainer, TrainerAdapter, TrainerAdapterConfig, TrainerConfig,
                                     TrajectoryBuilder, TrajectoryBuilderConfig)
from rlstream.schemas.config import FinetuningConfig

Kind = Literal["trajectory_builder", "trainer_adapter", "trainer"]
KINDS: dict[Kind, tuple[type[ComponentConfig], type[Any], str]] = {
    "trajectory_builder": (TrajectoryBuilderConfig, TrajectoryBuilder, "trajectory_builders"),
    "trainer_adapter": (TrainerAdapterConfig, TrainerAdapter, "trainer_adapters"),
    "trainer": (TrainerConfig, Trainer, "trainers"),
}


class RegistryError(ValueError):
    """An unknown ``_type``, a bad component config, or a conflicting registration."""


@dataclass(frozen=True)
class Registration:
    kind: Kind
    type_name: str
    config_type: type[ComponentConfig]
    factory: Callable[..., Any]


_REGISTRY: dict[Kind, dict[str, Registration]] = {k: {} for k in KINDS}


def _register(kind: Kind, config_type: type[ComponentConfig], factory: Callable[..., Any]) -> Callable[..., Any]:
    base = KINDS[kind][0]
    if not (isinstance(config_type, type) and issubclass(config_type, base)):
        raise RegistryError(f"{kind} config {config_type!r} must subclass {base.__name__}")
    name = config_type.type_name
    if not name:
        raise RegistryError(f"{config_type.__name__} has no _type: declare it with `name=\"...\"`")
    existing = _REGISTRY[kind].get(name)
    if existing is not None and existing.factory.__qualname__ != factory.__qualname__:
        raise RegistryError(f"{kind} _type {name!r} is already registered by {existing.factory.__module__}."
                            f"{existing.factory.__qualname__}")
    _REGISTRY[kind][name] = Registration(kind, name, config_type, factory)
    return factory


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def register_trajectory_builder(config_type: type[TrajectoryBuilderConfig]) -> Decorator:
    """Decorator: register a TrajectoryBuilder factory under ``config_type``'s ``_type``."""
    return lambda factory: _register("trajectory_builder", config_type, factory)


def register_trainer_adapter(config_type: type[TrainerAdapterConfig]) -> Decorator:
    """Decorator: register a TrainerAdapter factory under ``config_type``'s ``_type``."""
    return lambda factory: _register("trainer_adapter", config_type, factory)


def register_trainer(config_type: type[TrainerConfig]) -> Decorator:
    """Decorator: register a Trainer factory under ``config_type``'s ``_type``."""
    return lambda factory: _register("trainer", config_type, factory)


def registered(kind: Kind) -> dict[str, Registration]:
    """The registrations of one kind (after importing rlstream's own components)."""
    load_builtin_components()
    return dict(_REGISTRY[kind])


def load_builtin_components() -> None:
    """Import rlstream's implementations so that their registrations exist."""
    importlib.import_module("rlstream.finetune.components")


def load_plugins(modules: list[str]) -> None:
    """Import user modules that register components (``finetuning.plugins``)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise RegistryError(f"finetuning.plugins: cannot import {name!r}: {exc}") from exc


def resolve(kind: Kind, ft: FinetuningConfig) -> tuple[Registration, ComponentConfig]:
    """The registration and validated config that ``finetuning.<kind>`` selects."""
    load_builtin_components()
    load_plugins(ft.plugins)
    _, _, section = KINDS[kind]
    selected: str = getattr(ft, kind)
    entries: dict[str, dict[str, Any]] = getattr(ft, section)
    if selected in entries:
        options = dict(entries[selected])
        type_name = options.pop("_type", None)
        if not type_name:
            raise RegistryError(f"finetuning.{section}.{selected} has no _type")
        where = f"finetuning.{section}.{selected}"
    else:
        type_name, options, where = selected, {}, f"finetuning.{kind}"
    registration = _REGISTRY[kind].get(str(type_name))
    if registration is None:
        known = ", ".join(sorted(_REGISTRY[kind])) or "none"
        raise RegistryError(f"{where}: unknown {kind} _type {type_name!r} (registered: {known}; "
                            f"custom ones are imported through finetuning.plugins)")
    try:
        config = registration.config_type.model_validate(options)
    except Exception as exc:
        raise RegistryError(f"{where}: invalid options for _type {type_name!r}: {exc}") from exc
    return registration, config


async def build_component(kind: Kind, ft: FinetuningConfig, builder: Any, stack: contextlib.AsyncExitStack) -> Any:
    """Build the component ``finetuning.<kind>`` selects; its cleanup (after an async generator's ``yield``)
    is pushed on ``stack``."""
    registration, config = resolve(kind, ft)
    produced = registration.factory(config, builder)
    if inspect.isasyncgen(produced):
        component = await produced.__anext__()
        stack.push_async_callback(_finish_generator, produced)
    elif inspect.isawaitable(produced):
        component = await produced
    else:
        component = produced
    expected = KINDS[kind][1]
    if not isinstance(component, expected):
        raise RegistryError(f"the {kind} factory of _type {registration.type_name!r} returned "
                            f"{type(component).__name__}, not a {expected.__name__}")
    return component


async def _finish_generator(gen: Any) -> None:
    try:
        await gen.__anext__()
    except StopAsyncIteration:
        return
    await gen.aclose()
