"""``rlstream export`` / ``rlstream import`` on the real broker: Parquet that TRL trains on, ATIF that round-trips
every token id, bad ATIF records dead-lettered with their reason, and slices chosen like replay's."""
from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from nat.atif import Trajectory
from typer.testing import CliRunner

from rlstream.ops.export import (ExportFilter, ExportFormat, ImportFormat, ParquetLayout, export_trajectories,
                                 import_atif, import_trajectories)
from rlstream.ops.replay import Position, parse_position, replay_group_id, replay_trajectory_id
from rlstream.schemas.config import dump_config
from rlstream.schemas.models import (TOOLS_METADATA_KEY, DeadLetter, MetricEvent, ToolCall, TrajectoryEvent,
                                     TrajectorySource)
from rlstream.transport.topic_reader import TopicMissingError
from tests.support.factories import make_trajectory
from tests.support.ops_helpers import publish, read_all

pytestmark = pytest.mark.integration


def by_key(event: TrajectoryEvent) -> str:
    return event.example_id


def varied(run_id: str, tag: str, count: int, version: int = 0, task: str = "test") -> list[TrajectoryEvent]:
    """Trajectories with one to three turns, tool calls on every other one, the given version and task."""
    out = []
    for i in range(count):
        event = make_trajectory(run_id=run_id, example_id=f"{tag}-ex{i}", group_size=2, generation_index=i % 2,
                                policy_version=version, turns=1 + i % 3, with_tool_call=i % 2 == 0,
                                seed=sum(map(ord, tag)) * 100 + i, reward=None if i == 1 else i / 4)
        event.metadata["task"] = task
        out.append(event)
    return out


async def cli(rl_config, tmp_path: Path, *args: str) -> str:
    """``rlstream ARGS`` (in a thread: the command runs its own event loop); exit code 0, or 3 after dead letters."""
    from rlstream.cli.app import app

    config = tmp_path / "rlstream.yaml"
    config.write_text(dump_config(rl_config))
    result = await asyncio.to_thread(CliRunner().invoke, app, [*args, "-c", str(config)], env={"COLUMNS": "250"})
    assert result.exit_code in (0, 3), result.output
    return result.stdout


def position(text: str | None) -> Position | None:
    return parse_position(text) if text is not None else None


def parquet_ids(path: Path) -> set[str]:
    return set(pq.read_table(path, columns=["trajectory_id"]).column("trajectory_id").to_pylist())


async def test_parquet_loads_in_datasets_and_trains_one_trl_sft_step(rl_config, created_topics, tmp_path):
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    from trl.data_utils import maybe_apply_chat_template

    from tests.support.learner_helpers import tiny_model

    events = varied(rl_config.run_id, "sft", 6)
    placed = await publish(rl_config, created_topics.trajectories, events, by_key)
    out = tmp_path / "slice.parquet"
    report = await export_trajectories(rl_config, out, ExportFormat.parquet)
    assert report.written == report.read == len(events) and report.filtered == report.undecodable == 0

    dataset = load_dataset("parquet", data_files=str(out), split="train")
    assert len(dataset) == len(events)
    rows = {row["trajectory_id"]: row for row in dataset}
    for event, (partition, offset) in zip(events, placed):
        row = rows[event.trajectory_id]
        assert [m["role"] for m in row["messages"]] == [m.role for m in event.messages]
        assert [m["content"] for m in row["messages"]] == [m.content for m in event.messages]
        assert row["prompt_token_ids"] == [t.prompt_token_ids for t in event.turns]
        assert row["completion_token_ids"] == [t.completion_token_ids for t in event.turns]
        assert row["completion_logprobs"] == [t.completion_logprobs for t in event.turns]
        assert [t["message_index"] for t in row["turns"]] == [t.message_index for t in event.turns]
        assert row["reward"] == event.reward and json.loads(row["reward_components"]) == event.reward_components
        assert (row["run_id"], row["policy_version"], row["task"], row["source"]) == \
            (event.run_id, event.policy_version, "test", "rollout")
        assert (row["kafka_partition"], row["kafka_offset"]) == (partition, offset)
        calls = [m["tool_calls"] for m in row["messages"] if m["tool_calls"]]
        assert calls == ([[{"id": "call_1", "type": "function", "function": {"name": "lookup",
                                                                          "arguments": {"q": "x"}}}]]
                         if any(m.tool_calls for m in event.messages) else [])

    # TRL's SFT input pipeline (chat template, tokenization, labels) and one optimizer step on the tiny model
    model = tiny_model(tmp_path / "models")
    tokenizer = AutoTokenizer.from_pretrained(model)
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, per_device_train_batch_size=2, report_to=[],
                     use_cpu=True, save_strategy="no", logging_steps=1, dataloader_num_workers=0)
    trainer = SFTTrainer(model=str(model), args=args, train_dataset=dataset, processing_class=tokenizer)
    rendered = [tokenizer.decode(row["input_ids"]) for row in trainer.train_dataset]
    assert len(rendered) == len(events) and any("<tool_call>lookup" in text for text in rendered)
    result = trainer.train()
    assert result.global_step == 1 and result.training_loss > 0

    # the prompt-completion layout: GRPO's prompt formatting (generation prompt after the user turn)
    split = tmp_path / "grpo.parquet"
    await export_trajectories(rl_config, split, ExportFormat.parquet, layout=ParquetLayout.prompt_completion)
    grpo = load_dataset("parquet", data_files=str(split), split="train")
    assert "messages" not in grpo.column_names
    for row in grpo:
        assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["completion"][0]["role"] == "assistant"
        prompt = maybe_apply_chat_template({"prompt": row["prompt"]}, tokenizer)["prompt"]
        assert prompt.endswith("<|im_start|>assistant\n") and row["example_id"] in prompt


async def test_atif_export_import_export_keeps_every_token_id(rl_config, created_topics, tmp_path):
    events = varied(rl_config.run_id, "atif", 5, version=3)
    await publish(rl_config, created_topics.trajectories, events, by_key)
    first = tmp_path / "first.jsonl"
    stdout = await cli(rl_config, tmp_path, "export", "--format", "atif", "--out", str(first), "--run", rl_config.run_id,
                 "--report", "json")
    assert json.loads(stdout)["written"] == len(events)
    exported = [Trajectory.model_validate_json(line) for line in first.read_text().splitlines()]
    assert {t.trajectory_id for t in exported} == {e.trajectory_id for e in events}
    agent_steps = [s for t in exported for s in t.steps if s.metrics is not None]
    assert sum(len(s.metrics.completion_token_ids) for s in agent_steps) > 0

    stdout = await cli(rl_config, tmp_path, "import", str(first), "--format", "atif", "--run-id", "imported",
                 "--report", "json")
    imported = json.loads(stdout)
    assert imported["published"] == len(events) and imported["dead_lettered"] == 0

    on_topic = {e.trajectory_id: e for _, _, e in await read_all(rl_config, created_topics.trajectories,
                                                                  TrajectoryEvent) if e.run_id == "imported"}
    for original in events:
        copy = on_topic[replay_trajectory_id("imported", original.trajectory_id)]
        assert copy.source == TrajectorySource.replay and copy.group_id == replay_group_id("imported", original.group_id)
        assert copy.metadata["replay_of_trajectory_id"] == original.trajectory_id
        assert copy.messages == original.messages and copy.turns == original.turns
        assert (copy.reward, copy.reward_components, copy.policy_version, copy.created_at) == \
            (original.reward, original.reward_components, original.policy_version, original.created_at)

    second = tmp_path / "second.jsonl"
    await export_trajectories(rl_config, second, ExportFormat.atif, selection=ExportFilter(run_ids=frozenset({"imported"})))
    again = {t.extra["rlstream"]["metadata"]["replay_of_trajectory_id"]: t
             for t in (Trajectory.model_validate_json(line) for line in second.read_text().splitlines())}
    assert set(again) == {t.trajectory_id for t in exported}
    for before in exported:
        after = again[before.trajectory_id]
        # the steps (messages, tool calls, token ids, logprobs, turn fields) are equal, field for field
        assert [s.model_dump() for s in after.steps] == [s.model_dump() for s in before.steps]
        assert after.final_metrics == before.final_metrics and after.agent == before.agent
        root_before, root_after = before.extra["rlstream"], after.extra["rlstream"]
        changed = {"run_id", "group_id", "source", "metadata", "producer_id"}
        assert {k: v for k, v in root_after.items() if k not in changed} == \
            {k: v for k, v in root_before.items() if k not in changed}
        assert after.extra["reward"] == before.extra["reward"] and after.extra["task"] == before.extra["task"]


async def test_bad_atif_records_go_to_dlq_with_their_reason(rl_config, created_topics, tmp_path):
    from rlstream.ops.atif import to_atif

    good = to_atif(make_trajectory(run_id="src", example_id="good", turns=2, seed=1)).to_json_dict()
    no_agent = {k: v for k, v in good.items() if k != "agent"}
    skipped_step = json.loads(json.dumps(good))
    skipped_step["steps"][1]["step_id"] = 7
    agent_first = json.loads(json.dumps(good))
    agent_first["steps"] = agent_first["steps"][2:]
    for i, step in enumerate(agent_first["steps"]):
        step["step_id"] = i + 1
    agent_first["extra"]["rlstream"]["message_count"] -= 2
    short_logprobs = json.loads(json.dumps(good))
    metrics = next(s for s in short_logprobs["steps"] if "metrics" in s)["metrics"]
    metrics["logprobs"] = metrics["logprobs"][:-1]
    too_large_id = json.loads(json.dumps(good))
    next(s for s in too_large_id["steps"] if "metrics" in s)["metrics"]["prompt_token_ids"][0] = 2**70
    lines = [json.dumps(good).encode(), b"{not json", json.dumps(no_agent).encode(), json.dumps(skipped_step).encode(),
             json.dumps(agent_first).encode(), json.dumps(short_logprobs).encode(), b'{"steps": "\xff\xfe"}',
             b"[" * 100_000, json.dumps(too_large_id).encode()]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n\n")

    report = await import_atif(rl_config, path, "mixed-import")
    assert report.records == 9 and report.published == 1 and report.dead_lettered == 8

    letters = [e for _, _, e in await read_all(rl_config, created_topics.dlq, DeadLetter)]
    by_offset = {letter.source_offset: letter for letter in letters}
    assert sorted(by_offset) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert {letter.source_topic for letter in letters} == {f"file:{path}"}
    assert {letter.service for letter in letters} == {"import"}
    expected = {1: ("invalid_json", "line 2 is not JSON"), 2: ("invalid_atif", "agent: Field required"),
                3: ("invalid_atif", "expected 2 (sequential from 1), got 7"),
                4: ("bad_first_role", "first message has role 'assistant'"),
                5: ("token_logprob_mismatch", "8 completion token ids but 7 logprobs"),
                6: ("invalid_json", "line 7 is not JSON: 'utf-8' codec can't decode"),
                7: ("invalid_json", "line 8 is not JSON"), 8: ("CorruptPayloadError", "")}
    for offset, (error_type, text) in expected.items():
        assert by_offset[offset].error_type == error_type, by_offset[offset]
        assert text in by_offset[offset].error_message, by_offset[offset].error_message
        assert by_offset[offset].value == lines[offset]

    published = [e for _, _, e in await read_all(rl_config, created_topics.trajectories, TrajectoryEvent)]
    assert [e.metadata["replay_of_trajectory_id"] for e in published] == [good["trajectory_id"]]
    assert published[0].metadata["imported_from"] == "mixed.jsonl:0"
    metrics = [e for _, _, e in await read_all(rl_config, created_topics.metrics, MetricEvent)]
    assert [(m.source, m.run_id, m.name, m.value, m.tags) for m in metrics] == [
        ("import", "mixed-import", "import/published", 1.0, {"format": "atif"}),
        ("import", "mixed-import", "import/dead_lettered", 8.0, {"format": "atif"})]

    # the same import again publishes the same ids (the assembler's de-duplication holds) and the CLI says so
    stdout = await cli(rl_config, tmp_path, "import", str(path), "--format", "atif", "--run-id", "mixed-import")
    assert "published 1" in stdout and "dead-lettered 8" in stdout and "invalid_atif 2" in stdout
    published = [e for _, _, e in await read_all(rl_config, created_topics.trajectories, TrajectoryEvent)]
    assert len({e.trajectory_id for e in published}) == 1 and len(published) == 2


async def test_slices_by_offsets_time_run_version_task_and_source(rl_config, created_topics, tmp_path):
    topic = created_topics.trajectories
    before = varied(rl_config.run_id, "before", 4)
    await publish(rl_config, topic, before, by_key)
    time.sleep(0.05)
    t_from = datetime.now(timezone.utc)
    time.sleep(0.05)
    inside = [e for v in range(3) for e in varied(rl_config.run_id, f"v{v}", 4, version=v,
                                                 task="math" if v == 1 else "code")]
    other_run = varied("other-run", "other", 3, version=1, task="math")
    placed = await publish(rl_config, topic, inside + other_run, by_key)
    time.sleep(0.05)
    t_to = datetime.now(timezone.utc)
    time.sleep(0.05)
    after = varied(rl_config.run_id, "after", 4)
    await publish(rl_config, topic, after, by_key)
    everything = before + inside + other_run + after

    async def exported(name: str, start: str | None = None, stop: str | None = None,
                       selection: ExportFilter | None = None) -> set[str]:
        out = tmp_path / f"{name}.parquet"
        report = await export_trajectories(rl_config, out, ExportFormat.parquet, position(start), position(stop),
                                           selection)
        ids = parquet_ids(out)
        assert report.written == len(ids) and report.read == report.written + report.filtered
        return ids

    assert await exported("all") == {e.trajectory_id for e in everything}
    assert await exported("time", t_from.isoformat(), t_to.isoformat().replace("+00:00", "Z")) == \
        {e.trajectory_id for e in inside + other_run}
    # partition:offset bounds: [first offset of the window, its last offset] on the partition of inside[0]
    partition = placed[0][0]
    on_partition = [(o, e) for e, (p, o) in zip(inside + other_run, placed) if p == partition]
    assert len(on_partition) >= 2
    low, high = on_partition[0][0], on_partition[-1][0]
    assert await exported("offsets", f"{partition}:{low}", f"{partition}:{high}") == \
        {e.trajectory_id for o, e in on_partition if o < high}
    assert await exported("run", selection=ExportFilter(run_ids=frozenset({"other-run"}))) == \
        {e.trajectory_id for e in other_run}
    assert await exported("versions", t_from.isoformat(), None, ExportFilter(min_policy_version=1,
                                                                           max_policy_version=2)) == \
        {e.trajectory_id for e in inside + other_run if e.policy_version >= 1}
    assert await exported("task", selection=ExportFilter(tasks=frozenset({"math"}), run_ids=frozenset(
        {rl_config.run_id}))) == {e.trajectory_id for e in inside if e.metadata["task"] == "math"}
    assert await exported("source", selection=ExportFilter(sources=frozenset({"production"}))) == set()
    # an empty slice is still a Parquet file with the schema (zero rows)
    empty = tmp_path / "empty.parquet"
    await export_trajectories(rl_config, empty, ExportFormat.parquet, selection=ExportFilter(tasks=frozenset({"none"})))
    assert pq.read_table(empty).num_rows == 0 and "completion_token_ids" in pq.read_schema(empty).names
    # a failed export leaves no file behind (nor a partial one)
    missing = rl_config.model_copy(update={"topics": rl_config.topics.model_copy(update={"prefix": "missing."})})
    with pytest.raises(TopicMissingError):
        await export_trajectories(missing, tmp_path / "failed.parquet", ExportFormat.parquet)
    assert not [p for p in tmp_path.iterdir() if "failed" in p.name]


WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def preference_group(run_id: str, example: str, rewards: list[float | None]) -> list[TrajectoryEvent]:
    """One group of ``len(rewards)`` trajectories, each answering ``<example> answer <i>``, tools offered."""
    out = []
    for i, reward in enumerate(rewards):
        event = make_trajectory(run_id=run_id, example_id=example, group_size=len(rewards), generation_index=i,
                                reward=reward, seed=i + sum(map(ord, example)))
        event.messages[-1].content = f"{example} answer {i}"
        event.metadata[TOOLS_METADATA_KEY] = json.dumps([WEATHER])
        out.append(event)
    return out


async def test_dpo_and_kto_exports_load_for_trl_preference_trainers(rl_config, created_topics, tmp_path):
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    from tests.support.learner_helpers import tiny_model

    # three groups, members interleaved: rewards 0.1/0.8/0.3/0.8 (chosen 1, rejected 0), 0.5/0.5/0.5 (no
    # preference), 1.0/None/-1.0 (chosen 0, rejected 2; KTO mean 0.0)
    groups = [preference_group(rl_config.run_id, "a", [0.1, 0.8, 0.3, 0.8]),
              preference_group(rl_config.run_id, "b", [0.5, 0.5, 0.5]),
              preference_group(rl_config.run_id, "c", [1.0, None, -1.0])]
    events = [e for i in range(4) for g in groups for e in g[i:i + 1]]
    await publish(rl_config, created_topics.trajectories, events, by_key)

    dpo_path = tmp_path / "dpo.parquet"
    stdout = await cli(rl_config, tmp_path, "export", "--out", str(dpo_path), "--layout", "dpo", "--report", "json")
    report = json.loads(stdout)
    assert (report["written"], report["groups"], report["groups_without_preference"]) == (2, 3, 1)
    dpo = load_dataset("parquet", data_files=str(dpo_path), split="train")
    assert {"prompt", "chosen", "rejected"} <= set(dpo.column_names) and "messages" not in dpo.column_names
    rows = {row["example_id"]: row for row in dpo}
    assert set(rows) == {"a", "c"}
    assert [m["content"] for m in rows["a"]["chosen"]] == ["a answer 1"]
    assert [m["content"] for m in rows["a"]["rejected"]] == ["a answer 0"]
    assert (rows["a"]["chosen_reward"], rows["a"]["rejected_reward"]) == (0.8, 0.1)
    assert [m["content"] for m in rows["c"]["chosen"]] == ["c answer 0"]
    assert [m["content"] for m in rows["c"]["rejected"]] == ["c answer 2"]
    assert rows["a"]["tools"] == [WEATHER]

    # what DPOTrainer does with a conversational row: the chat template over prompt / chosen / rejected, tools
    # from the row's own column
    tokenizer = AutoTokenizer.from_pretrained(tiny_model(tmp_path / "models"))
    # the tiny model's template, with the tools' names listed as tool-aware templates list them
    tokenizer.chat_template = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
                               "</tools>{% endif %}" + tokenizer.chat_template)
    row = rows["a"]
    assert is_conversational(row)
    text = maybe_apply_chat_template({k: row[k] for k in ("prompt", "chosen", "rejected")}, tokenizer,
                                     tools=row["tools"])
    assert text["prompt"].startswith("<tools>weather;</tools>")
    assert text["prompt"].endswith("<|im_start|>assistant\n")
    assert text["chosen"].startswith("a answer 1") and text["rejected"].startswith("a answer 0")

    kto_path = tmp_path / "kto.parquet"
    await export_trajectories(rl_config, kto_path, ExportFormat.parquet, layout=ParquetLayout.kto)
    kto = load_dataset("parquet", data_files=str(kto_path), split="train")
    labels = {(row["example_id"], row["completion"][0]["content"]): row["label"] for row in kto}
    # a: mean 0.5 -> 0.8, 0.8 above; c: mean 0.0 -> 1.0 above; b gives no rows
    assert labels == {("a", "a answer 0"): False, ("a", "a answer 1"): True, ("a", "a answer 2"): False,
                      ("a", "a answer 3"): True, ("c", "c answer 0"): True, ("c", "c answer 2"): False}
    assert all(is_conversational(row) for row in kto)


async def test_tools_column_and_arguments_as_objects(rl_config, created_topics, tmp_path):
    from datasets import load_dataset

    event = make_trajectory(run_id=rl_config.run_id, example_id="tools", turns=2, with_tool_call=True, seed=5)
    event.messages[2].tool_calls = [ToolCall(id="call_1", name="weather", arguments='{"city": "Paris"}'),
                                    ToolCall(id="call_2", name="weather", arguments="Paris, please")]
    event.metadata[TOOLS_METADATA_KEY] = json.dumps([WEATHER])
    bare = make_trajectory(run_id=rl_config.run_id, example_id="bare", seed=6)
    await publish(rl_config, created_topics.trajectories, [event, bare], by_key)
    out = tmp_path / "tools.parquet"
    await export_trajectories(rl_config, out, ExportFormat.parquet)
    rows = {row["example_id"]: row for row in load_dataset("parquet", data_files=str(out), split="train")}
    assert rows["tools"]["tools"] == [WEATHER] and rows["bare"]["tools"] is None
    calls = rows["tools"]["messages"][2]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}, "Paris, please"]
    # pyarrow alone reads the same columns as JSON text
    raw = {r["example_id"]: r for r in pq.read_table(out).to_pylist()}
    assert [json.loads(t) for t in raw["tools"]["tools"]] == [WEATHER]
    assert [json.loads(c["function"]["arguments"]) for c in raw["tools"]["messages"][2]["tool_calls"]] == \
        [{"city": "Paris"}, "Paris, please"]


async def test_parquet_import_twice_exports_each_trajectory_once(rl_config, created_topics, tmp_path):
    events = varied(rl_config.run_id, "pq", 4, version=2)
    events[0].metadata[TOOLS_METADATA_KEY] = json.dumps([WEATHER])
    await publish(rl_config, created_topics.trajectories, events, by_key)
    first = tmp_path / "first.parquet"
    await export_trajectories(rl_config, first, ExportFormat.parquet)

    stdout = await cli(rl_config, tmp_path, "import", str(first), "--format", "parquet", "--run-id", "again",
                       "--report", "json")
    assert json.loads(stdout)["published"] == len(events)
    report = await import_trajectories(rl_config, first, "again", ImportFormat.parquet)
    assert report.published == len(events) and report.dead_lettered == 0

    # control: the topic holds every imported trajectory twice, under the same id
    copies = [e for _, _, e in await read_all(rl_config, created_topics.trajectories, TrajectoryEvent)
              if e.run_id == "again"]
    assert len(copies) == 2 * len(events) and len({e.trajectory_id for e in copies}) == len(events)
    assert {e.trajectory_id for e in copies} == {replay_trajectory_id("again", e.trajectory_id) for e in events}

    second = tmp_path / "second.parquet"
    exported = await export_trajectories(rl_config, second, ExportFormat.parquet,
                                         selection=ExportFilter(run_ids=frozenset({"again"})))
    assert (exported.written, exported.duplicates) == (len(events), len(events))
    rows = {json.loads(r["metadata"])["replay_of_trajectory_id"]: r for r in pq.read_table(second).to_pylist()}
    assert len(rows) == len(events)
    for original in events:
        row = rows[original.trajectory_id]
        assert row["completion_token_ids"] == [t.completion_token_ids for t in original.turns]
        assert row["completion_logprobs"] == [t.completion_logprobs for t in original.turns]
        assert (row["reward"], row["policy_version"], row["source"]) == (original.reward, 2, "replay")
        assert [m["content"] for m in row["messages"]] == [m.content for m in original.messages]
    assert [json.loads(t) for t in rows[events[0].trajectory_id]["tools"]] == [WEATHER]
    copy = next(e for e in copies if e.metadata["replay_of_trajectory_id"] == events[0].trajectory_id)
    assert copy.messages == events[0].messages and copy.turns == events[0].turns
    assert copy.metadata["imported_from"] == "first.parquet:" + copy.metadata["imported_from"].split(":")[1]

    # a file that is not Parquet fails before anything is published
    bogus = tmp_path / "bogus.parquet"
    bogus.write_text("not parquet")
    with pytest.raises(ValueError):
        await import_trajectories(rl_config, bogus, "bogus", ImportFormat.parquet)
