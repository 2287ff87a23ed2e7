"""Weight publication: a new directory per version, a sha256 manifest, a PolicyVersion on ``policy-versions``,
then the Redis latest pointer moved by compare-and-set under the learner's lease (fencing).

Order of one publication: write the weights, verify their sha256, check (renew) the lease, announce the
PolicyVersion in a Kafka transaction, move the Redis pointer (fenced CAS). The announcing producer is transactional
with a per-policy transactional id (:func:`transactional_id`): when a new learner starts its producer, Kafka fences
the previous one, so a zombie learner's announcement fails with ``ProducerFenced`` (raised here as
:class:`PublicationFenced`, a :class:`LeaseLost`), is aborted (never read by ``read_committed`` consumers) and the
pointer is not moved.

Version directory ``<output_dir>/versions/v<NNNNNN>/``: full fine-tuning writes ``model.safetensors`` with
untied embeddings, ``config.json`` (``tie_word_embeddings: false``) and the tokenizer; LoRA writes a PEFT
adapter folder (``adapter_model.safetensors``, ``adapter_config.json``), or, with ``learner.lora.publish_merged``,
the full-weights files of the adapter merged into a copy of the base (kind ``full``). ``manifest.json`` lists the sha256 of
every file; the Redis pointer's ``sha256`` is the sha256 of ``manifest.json`` itself.

Weight store (``learner.weight_store``): a directory (the version directories go there instead of
``<output_dir>/versions``) or an fsspec URL (``s3://``, ``gs://``): each version is still written and verified under
``<output_dir>/versions``, then uploaded to ``<weight_store>/v<NNNNNN>/`` (:func:`store_version`) before it is
announced, and its ``uri`` is that URL (rlstream/transport/weight_store.py).
"""
from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from safetensors.torch import save_file

from rlstream.learner.checkpoint import MANIFEST, fsync_path, sha256_file, verify_manifest, write_manifest
from rlstream.learner.policy import Policy
from rlstream.schemas.config import KafkaConfig
from rlstream.transport.control import ControlPlane, Lease, LeaseLost
from rlstream.transport.manifest import local_dir
from rlstream.transport.weight_store import is_remote, join_url, upload_version
from rlstream.transport.kafka import make_producer
from rlstream.transport.trusted_versions import announce_record
from rlstream.transport.log import get_logger
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import FileDigest, OffsetRange, PolicyVersion, WeightsKind

log = get_logger(__name__)


class PublicationFenced(LeaseLost):
    """Kafka fenced this learner's transactional producer: another learner of the policy started one."""


def transactional_id(policy_name: str) -> str:
    """The transactional id of the producer that announces ``policy_name``'s versions (one per policy)."""
    return f"rlstream-learner-{policy_name}"


@dataclass(frozen=True)
class Announcer:
    """The producer that announces a policy's versions, with the transactional id its caller built it with (None:
    a plain producer, whose announcements are refused)."""

    producer: Any
    transactional_id: str | None

    @classmethod
    def for_policy(cls, kafka: KafkaConfig, policy_name: str) -> "Announcer":
        """A transactional announcer with the policy's id (:func:`transactional_id`): starting it fences the
        announcer of any other learner of the policy."""
        tid = transactional_id(policy_name)
        return cls(make_producer(kafka, transactional_id=tid), tid)


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def versions_root(output_dir: Path, weight_store: str | None) -> Path:
    """Where versions are written locally: a weight store that is a directory (or ``file://`` URL), else
    ``<output_dir>/versions`` (also for a remote store: the local copy is uploaded from there)."""
    if weight_store and not is_remote(weight_store):
        return local_dir(weight_store)
    return Path(output_dir) / "versions"


def store_version(directory: Path, weight_store: str | None, version: int,
                  options: Mapping[str, Any] | None = None) -> str:
    """The ``uri`` a written version is announced under: its resolved local directory, or, when ``weight_store``
    is a URL, ``<weight_store>/v<NNNNNN>`` after uploading the directory there (manifest last)."""
    if not weight_store or not is_remote(weight_store):
        return str(Path(directory).resolve())
    url = join_url(weight_store, version_dir(Path(""), version).name)
    upload_version(Path(directory), url, MANIFEST, dict(options or {}))
    log.info("version uploaded to the weight store", version=version, uri=url)
    return url


def published_kind(policy: Policy) -> WeightsKind:
    """What a version of ``policy`` is published as: its adapter (LoRA), or full weights (full fine-tuning, or
    LoRA with ``learner.lora.publish_merged``)."""
    return WeightsKind.lora if policy.lora and not policy.publish_merged else WeightsKind.full


def merged_copy(policy: Policy) -> Any:
    """A copy of the LoRA model with the adapter merged into the base weights (``merge_and_unload``); the model
    being trained keeps its adapter."""
    with torch.no_grad():
        return copy.deepcopy(policy.model).merge_and_unload()


def _save_full(policy: Policy, out: Path, model: Any = None) -> None:
    model = policy.model if model is None else model
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    out_emb = model.get_output_embeddings()
    if out_emb is not None:  # untie: vLLM keeps stale weights for tied embeddings on reload
        state["lm_head.weight"] = out_emb.weight.detach().to("cpu").contiguous().clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    if hasattr(config, "get_text_config"):
        config.get_text_config().tie_word_embeddings = False
    config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    if policy.tokenizer is not None:
        policy.tokenizer.save_pretrained(str(out))


class NonFiniteWeightsError(RuntimeError):
    """The weights hold a NaN or an infinity: they are never written as a version."""


def check_finite(policy: Policy) -> None:
    """Raise :class:`NonFiniteWeightsError` naming the trainable parameters that are not finite."""
    bad = policy.nonfinite_parameters()
    if bad:
        raise NonFiniteWeightsError(f"{len(bad)} parameter(s) hold NaN or inf, e.g. {bad[:3]}; not published")


def write_version(policy: Policy, root: Path, policy_name: str, version: int) -> tuple[Path, dict[str, Any]]:
    """Write version ``version`` atomically (temporary directory, fsync, rename); returns (dir, manifest).

    Raises :class:`NonFiniteWeightsError` (and writes nothing) when a trainable parameter is not finite. A sharded
    policy's weights are gathered for it (:meth:`Policy.publishable`).
    """
    check_finite(policy)
    with policy.publishable() as whole:
        return _write_version(whole, root, policy_name, version)


def _write_version(policy: Policy, root: Path, policy_name: str, version: int) -> tuple[Path, dict[str, Any]]:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    kind = published_kind(policy)
    if kind == WeightsKind.lora:
        policy.model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "README.md").unlink(missing_ok=True)  # PEFT's model card: versions hold weights, JSON, tokenizer only
    elif policy.lora:
        _save_full(policy, tmp, merged_copy(policy))
    else:
        _save_full(policy, tmp)
    manifest = write_manifest(tmp, {"policy": policy_name, "version": version,
                                    "kind": kind.value, "base_model": policy.base_model})
    if final.exists():  # an unannounced leftover of a crashed publication of this same version
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(root)
    verify_manifest(final)
    return final, manifest


def manifest_digest(directory: Path) -> str:
    """The sha256 of a version's ``manifest.json`` (what the Redis pointer carries)."""
    return sha256_file(Path(directory) / MANIFEST)


def offset_ranges(topic: str, ranges: dict[int, list[int]]) -> list[OffsetRange]:
    """One inclusive range per partition from ``{partition: [first, last]}``."""
    return [OffsetRange(topic=topic, partition=p, first=r[0], last=r[1]) for p, r in sorted(ranges.items())]


def exact_ranges(topic: str, offsets: Mapping[int, Iterable[int]]) -> list[OffsetRange]:
    """The inclusive ranges that hold exactly ``offsets`` (per partition): consecutive offsets merge, any gap
    (a skipped or dead-lettered record, a transaction marker) splits."""
    out: list[OffsetRange] = []
    for partition in sorted(offsets):
        run: list[int] = []
        for offset in sorted(set(offsets[partition])):
            if run and offset == run[1] + 1:
                run[1] = offset
                continue
            if run:
                out.append(OffsetRange(topic=topic, partition=partition, first=run[0], last=run[1]))
            run = [offset, offset]
        if run:
            out.append(OffsetRange(topic=topic, partition=partition, first=run[0], last=run[1]))
    return out


async def announce(
    *, announcer: Announcer, codec: AvroCodec, control: ControlPlane, lease: Lease, topic: str, groups_topic: str,
    policy_name: str, run_id: str, directory: Path, manifest: dict[str, Any], version: int, step: int,
    kind: WeightsKind, base_model: str, group_count: int, metrics: dict[str, float], lease_ttl_s: float,
    ranges: dict[int, list[int]] | None = None, offsets: Mapping[int, Iterable[int]] | None = None,
    before_commit: Callable[[], None] | None = None, uri: str | None = None,
) -> PolicyVersion:
    """Announce a written version: verify its sha256 manifest, renew (check) the lease, PolicyVersion on
    ``policy-versions`` (in a transaction of ``announcer``, which must be transactional), then move the Redis pointer by
    CAS under the lease. Raises :class:`LeaseLost` when the lease is gone (then nothing is announced) and
    :class:`PublicationFenced` when Kafka fenced the producer (then the pointer is not moved).

    Lineage (``trained_on``): ``offsets`` (per partition, the exact offsets of the groups trained) become the
    ranges that hold exactly them; ``ranges`` (``{partition: [first, last]}``) are announced as given.
    ``uri``: where readers find the files (:func:`store_version`; default: ``directory``).
    ``before_commit`` (fault injection for tests): see :func:`~rlstream.transport.trusted_versions.announce_record`.
    """
    verify_manifest(directory)
    await control.renew_lease(policy_name, lease, lease_ttl_s)
    trained_on = exact_ranges(groups_topic, offsets) if offsets is not None else \
        offset_ranges(groups_topic, ranges or {})
    event = PolicyVersion(
        policy=policy_name, version=version, base_model=base_model, kind=kind,
        uri=uri or str(Path(directory).resolve()),
        files=[FileDigest(path=f["path"], sha256=f["sha256"], size=f["size"]) for f in manifest["files"]],
        learner_step=step, group_count=group_count, trained_on=trained_on,
        metrics={k: float(v) for k, v in metrics.items()}, run_id=run_id, fencing_token=lease.token,
    )
    from aiokafka.errors import ProducerFenced

    try:  # registered and confirmed under the lease: readers accept only such records (transport/trusted_versions)
        await announce_record(announcer.producer, control, lease, topic=topic, policy=policy_name, version=version,
                              value=codec.encode(event), transactional=announcer.transactional_id is not None,
                              before_commit=before_commit)
    except ProducerFenced as exc:
        raise PublicationFenced(f"the announcing producer was fenced by a newer learner ({exc}); "
                                "version not announced") from exc
    moved = await control.publish_latest(policy_name, version, event.uri, manifest_digest(directory), lease)
    log.info("version published", policy=policy_name, version=version, step=step, uri=event.uri, moved=moved,
             groups=group_count)
    return event


def load_published(directory: Path, dtype: torch.dtype = torch.float32) -> Any:
    """Load a published version with transformers/peft (verifying its manifest first)."""
    from transformers import AutoModelForCausalLM

    manifest = verify_manifest(Path(directory))
    if manifest["kind"] == "lora":
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(manifest["base_model"], dtype=dtype, local_files_only=True)
        return PeftModel.from_pretrained(base, str(directory))
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
