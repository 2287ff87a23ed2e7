"""Component registration by ``_type`` (NAT's decorators and config classes) and resolution from the config."""
from __future__ import annotations

import contextlib
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from rlstream.finetune import (TrainerAdapter, TrainerAdapterConfig, TrajectoryBuilder, TrajectoryBuilderConfig,
                          TrajectoryCollection, register_trainer_adapter, register_trajectory_builder)
from rlstream.finetune.registry import RegistryError, build_component, registered, resolve
from rlstream.schemas.config import FinetuningConfig


class EchoBuilderConfig(TrajectoryBuilderConfig, name="test_echo_builder"):
    num_generations: int = 2


class EchoBuilder(TrajectoryBuilder):
    closed = False

    async def start_run(self, run_id: str, meta: dict[str, Any] | None = None) -> None:
        self.started = run_id

    async def finalize(self, run_id: str, meta: dict[str, Any] | None = None) -> TrajectoryCollection:
        return TrajectoryCollection([], run_id)

    def log_progress(self, run_id: str, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        pass


@register_trajectory_builder(config_type=EchoBuilderConfig)
async def echo_builder(config: EchoBuilderConfig, builder: Any) -> Any:
    component = EchoBuilder(trajectory_builder_config=config)
    yield component  # NAT's form: an async generator; what follows runs at cleanup
    EchoBuilder.closed = True


class WrongAdapterConfig(TrainerAdapterConfig, name="test_wrong_adapter"):
    pass


@register_trainer_adapter(config_type=WrongAdapterConfig)
def wrong_adapter(config: WrongAdapterConfig, builder: Any) -> Any:
    return object()  # not a TrainerAdapter


def test_rlstream_components_are_registered_under_their_types() -> None:
    assert "rlstream_kafka" in registered("trajectory_builder")
    assert "rlstream_kafka" in registered("trainer_adapter")
    assert "rlstream_grpo" in registered("trainer")
    registration, config = resolve("trainer", FinetuningConfig())
    assert registration.type_name == "rlstream_grpo" and type(config).type_name == "rlstream_grpo"


def test_a_type_is_selected_directly_or_through_a_named_entry_with_options() -> None:
    registration, config = resolve("trajectory_builder", FinetuningConfig(trajectory_builder="test_echo_builder"))
    assert registration.factory is echo_builder and config == EchoBuilderConfig()
    ft = FinetuningConfig(trajectory_builder="mine",
                          trajectory_builders={"mine": {"_type": "test_echo_builder", "num_generations": 7}})
    _, config = resolve("trajectory_builder", ft)
    assert isinstance(config, EchoBuilderConfig) and config.num_generations == 7


def test_unknown_types_and_bad_options_are_clear_errors() -> None:
    with pytest.raises(RegistryError, match="unknown trainer _type 'nope'.*rlstream_grpo"):
        resolve("trainer", FinetuningConfig(trainer="nope"))
    bad = FinetuningConfig(trajectory_builder="b", trajectory_builders={"b": {"_type": "test_echo_builder",
                                                                                "num_generations": "many"}})
    with pytest.raises(RegistryError, match="finetuning.trajectory_builders.b: invalid options"):
        resolve("trajectory_builder", bad)
    with pytest.raises(RegistryError, match="has no _type"):
        resolve("trainer", FinetuningConfig(trainer="t", trainers={"t": {"poll_interval_s": 1}}))


def test_registration_needs_a_named_config_of_the_right_kind_and_no_clash() -> None:
    class Unnamed(TrajectoryBuilderConfig):
        pass

    with pytest.raises(RegistryError, match="no _type"):
        register_trajectory_builder(config_type=Unnamed)(echo_builder)
    with pytest.raises(RegistryError, match="must subclass TrajectoryBuilderConfig"):
        register_trajectory_builder(config_type=WrongAdapterConfig)(echo_builder)  # type: ignore[arg-type]

    def another(config: Any, builder: Any) -> Any:
        return None

    with pytest.raises(RegistryError, match="already registered"):
        register_trajectory_builder(config_type=EchoBuilderConfig)(another)


async def test_build_component_runs_the_generator_cleanup_and_checks_the_type() -> None:
    EchoBuilder.closed = False
    async with contextlib.AsyncExitStack() as stack:
        component = await build_component("trajectory_builder", FinetuningConfig(trajectory_builder="test_echo_builder"),
                                          builder=None, stack=stack)
        assert isinstance(component, EchoBuilder) and not EchoBuilder.closed
    assert EchoBuilder.closed
    async with contextlib.AsyncExitStack() as stack:
        with pytest.raises(RegistryError, match="returned object, not a TrainerAdapter"):
            await build_component("trainer_adapter", FinetuningConfig(trainer_adapter="test_wrong_adapter"), None, stack)


def test_plugins_register_custom_components_by_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = f"plugin_{uuid.uuid4().hex[:8]}"
    type_name = f"custom_{module}"
    (tmp_path / f"{module}.py").write_text(f'''
from rlstream.finetune import TrainerAdapter, TrainerAdapterConfig, register_trainer_adapter

class CustomConfig(TrainerAdapterConfig, name="{type_name}"):
    endpoint: str = "http://training:8080"

@register_trainer_adapter(config_type=CustomConfig)
async def custom(config, builder):
    yield None
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    ft = FinetuningConfig(trainer_adapter=type_name)
    with pytest.raises(RegistryError, match=f"unknown trainer_adapter _type '{type_name}'"):
        resolve("trainer_adapter", ft)
    registration, config = resolve("trainer_adapter", ft.model_copy(update={"plugins": [module]}))
    assert registration.type_name == type_name and config.endpoint == "http://training:8080"  # type: ignore[attr-defined]
    with pytest.raises(RegistryError, match="cannot import 'no_such_plugin_module'"):
        resolve("trainer_adapter", ft.model_copy(update={"plugins": ["no_such_plugin_module"]}))
    sys.modules.pop(module, None)


def test_interfaces_are_abstract_like_nat() -> None:
    with pytest.raises(TypeError):
        TrainerAdapter(TrainerAdapterConfig())  # type: ignore[abstract]
    with pytest.raises(TypeError):
        TrajectoryBuilder(TrajectoryBuilderConfig())  # type: ignore[abstract]
