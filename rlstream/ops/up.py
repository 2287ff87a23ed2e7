"""``rlstream up``: the whole system on one machine, training continuously on a toy task.

Starts the embedded broker and Redis, creates the topics, then the streams worker, the learner,
a vLLM server with its sync worker and a rollout runner as child processes (``ops/supervisor.py``); with the gate on
and full-weight versions, a second vLLM server on the same model with its own sync worker (``inference.role:
evaluate``) where the gate evaluates every candidate, while the serving server's sync worker loads only what the
serving pointer asks for (``inference.full_weights_follow: serving``, docs/gate.md); without the gate every
version serves once loaded (``gateway.serve_unpromoted``, full weights following the newest); evaluates every
policy version vLLM loads on held-out prompts (``ops/evaluation.py``); shows a live view (``ops/live.py``); on the
end of ``--duration`` or Ctrl-C stops every child by PID and writes a reward-per-version plot
(``ops/version_plot.py``) and a JSON summary (``ops/summary.py``). The task and the run's config come from
``ops/up_config.py``.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rlstream.ops.evaluation import VersionScore, evaluate_versions
from rlstream.ops.infra import LocalStack
from rlstream.ops.interrupts import terminate_as_interrupt
from rlstream.ops.live import LiveFigures, Watcher, render
from rlstream.ops.ports import LOOPBACK, free_port
from rlstream.ops.summary import summarize
from rlstream.ops.supervisor import Supervisor, rlstream_command
from rlstream.ops.up_config import (TOY_DEFAULTS, StackAddresses, UpOptions, compose_config, process_config,
                                    task_inputs, task_users_args, task_vllm_args, toy_model_tokenizer)
from rlstream.ops.vllm import ModelSource, ModelTokenizer
from rlstream.ops.version_plot import write_plot
from rlstream.gateway.auth import API_KEYS_ENV
from rlstream.rollout.users import USERS_API_KEY_ENV
from rlstream.schemas.config import RlstreamConfig, load_config
from rlstream.schemas.masking import remember_secret, secret_env
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import create_topics
from rlstream.transport.log import get_logger
from rlstream.transport.signals import sleep_or_stop, stop_event

if TYPE_CHECKING:
    from rlstream.ops.vllm import EngineRestart, VllmSupervisor

log = get_logger(__name__)


async def _supervise(cfg: RlstreamConfig, opts: UpOptions, sup: Supervisor, vllm_url: str,
                     heldout: list[dict[str, Any]], figures: LiveFigures) -> None:
    from rich.console import Console
    from rich.live import Live

    from rlstream.transport.kafka import make_producer
    from rlstream.transport.metrics import MetricsPublisher
    from rlstream.schemas.codec import codec_for

    stop = stop_event()
    control = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
    producer = make_producer(cfg.kafka)
    await producer.start()
    metrics = MetricsPublisher(producer, codec_for(cfg), TopicNames.from_config(cfg.topics).metrics, source="up",
                               run_id=cfg.run_id)

    async def on_score(score: VersionScore) -> None:
        figures.heldout.append(score)
        log.info("held-out reward", version=score.version, reward_mean=round(score.reward_mean, 3))
        await metrics.emit(mn.VALIDATION_REWARD_MEAN, score.reward_mean, step=score.version,
                           tags={mn.STEP_TAG: mn.STEP_VERSION})

    watcher = Watcher(cfg, control, figures)
    tasks = [
        asyncio.create_task(watcher.follow_topics(stop)),
        asyncio.create_task(watcher.poll_control(stop)),
    ]
    if heldout and opts.gate:
        # the gate evaluates each candidate, and serving, on these prompts with the task's own episode: its figures
        # are the curve (evaluating every version again here would double the load on the serving engine)
        figures.heldout_from_gate = True
    elif heldout:
        tasks.append(asyncio.create_task(evaluate_versions(cfg, control, f"{vllm_url}/v1", heldout, opts.eval_samples,
                                                           stop, on_score)))
    else:
        log.warning("no held-out examples (set finetuning.validation_dataset): versions are not evaluated")
    figures.started = time.monotonic()  # the clock of the live view starts with the services
    deadline = figures.started + opts.duration_s if opts.duration_s else None
    console = Console()
    try:
        with Live(render(figures, cfg.run_id, opts.duration_s), console=console, refresh_per_second=1,
                  transient=False, auto_refresh=opts.live) as live:
            while not stop.is_set():
                if deadline and time.monotonic() >= deadline:
                    break
                if opts.until_version is not None and any(s.version >= opts.until_version for s in figures.heldout):
                    log.info("held-out score of the requested version recorded; stopping", version=opts.until_version)
                    break
                dead = sup.dead()
                if dead:
                    names = ", ".join(f"{c.name} (exit {c.proc.returncode}, log {c.log_file})" for c in dead)
                    log.error("a service stopped; shutting down", services=names)
                    break
                live.update(render(figures, cfg.run_id, opts.duration_s))
                await sleep_or_stop(stop, 1.0)
            live.update(render(figures, cfg.run_id, opts.duration_s))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:  # the summary shows the end of the run, not the last poll (a version loaded since would be missing)
            await watcher.refresh_control()
        except Exception as exc:
            log.warning("final control-plane read failed; the summary shows the last poll", error=str(exc))
        await producer.stop()
        await control.close()


def _start_vllm_servers(sup: Supervisor, model_dir: Path, served: str, run_dir: Path, api_key: str,
                        extra_args: list[str], ports: dict[str, int],
                        tool_call_parser: str = "auto") -> dict[str, VllmSupervisor]:
    """Start one vLLM server per name in ``ports`` at once (each start is mostly waiting on its own process) and
    hand every started one to the supervisor, also when another failed to start (then its error is raised). Each
    comes with its (not yet started) :class:`VllmSupervisor`, which starts it again the same way when it dies."""
    from rlstream.ops.vllm import VllmSupervisor, resolve_tool_call_parser, start_vllm_server

    parser = resolve_tool_call_parser(model_dir, tool_call_parser, extra_args)
    for name, port in ports.items():  # the files up --dry-run writes (config/NAME.yaml), here for the record
        write_vllm_config(run_dir / "config" / f"{name}.yaml", model_dir, served, port, parser, extra_args)
    how = {name: partial(start_vllm_server, model_dir, served_model_name=served, port=port, workdir=run_dir / name,
                         api_key=api_key, extra_args=extra_args, tool_call_parser=tool_call_parser)
           for name, port in ports.items()}
    with ThreadPoolExecutor(max_workers=len(ports)) as pool:
        starts = {name: pool.submit(start) for name, start in how.items()}
    servers: dict[str, VllmSupervisor] = {}
    for name, start in starts.items():
        if start.exception() is None:
            servers[name] = VllmSupervisor(name, start.result(), how[name])
            sup.extra_pids[name] = servers[name].server.pid
    for start in starts.values():
        start.result()  # the first failure, once every started server is known to the supervisor
    return servers


def _watch_vllm_servers(sup: Supervisor, supervisors: dict[str, VllmSupervisor], figures: LiveFigures) -> None:
    """Start supervising the vLLM servers: a dead one is restarted, shown in the live view while it is down, and
    every restart is listed in the summary (``engine_restarts``)."""
    def on_down(name: str, reason: str) -> None:
        figures.engines_down[name] = (reason, time.monotonic())

    def on_restart(event: EngineRestart) -> None:
        figures.engines_down.pop(event.name, None)
        figures.engine_restarts.append(event)
        if event.new_pid is not None:
            sup.extra_pids[event.name] = event.new_pid  # stopped with the run

    for supervisor in supervisors.values():
        supervisor.on_down, supervisor.on_restart = on_down, on_restart
        supervisor.start_thread()


@dataclass(frozen=True)
class ServingOverrides:
    """The ``-o`` pairs of the serve replica's sync worker and of the gateway (:func:`serving_overrides`)."""

    sync: tuple[str, ...]
    gateway: tuple[str, ...]


def serving_overrides(gated: bool) -> ServingOverrides:
    """What serves under ``rlstream up``. Gated (the promotion gate on, with held-out prompts): only promoted
    versions; full weights on the serve replica follow the serving pointer. Ungated (``--no-gate``, or no held-out
    prompts): every version the learner publishes serves as soon as a replica loads it; the gateway routes the policy
    to the newest loaded version without a serving pointer (``gateway.serve_unpromoted``) and full weights follow the
    newest version."""
    if gated:
        return ServingOverrides(sync=("-o", "inference.full_weights_follow", "serving"), gateway=())
    return ServingOverrides(sync=("-o", "inference.full_weights_follow", "newest"),
                            gateway=("-o", "gateway.serve_unpromoted", "true"))


def canary_overrides(traffic: str) -> list[str]:
    """The gate's canary settings under ``rlstream up``: the config's (on by default) with production traffic; off
    otherwise (the canary is tested on production feedback: without it every canary would only time out)."""
    return [] if traffic == "production" else ["-o", "gate.canary_share", "0"]


@dataclass(frozen=True)
class PlannedProcess:
    """One process ``rlstream up`` starts: its name, command line and resolved config file."""

    name: str
    argv: tuple[str, ...]
    config_file: Path


def _flag_pairs(flags: Sequence[str]) -> list[tuple[str, str]]:
    """``["-o", KEY, VALUE, ...]`` -> ``[(KEY, VALUE), ...]``."""
    return [(flags[i + 1], flags[i + 2]) for i in range(0, len(flags), 3)]


@dataclass(frozen=True)
class ServiceEndpoints:
    """The addresses the run's services are given: vLLM servers' URLs, and the gateway's port (production)."""

    vllm_url: str
    eval_vllm_url: str | None
    gateway_port: int | None


def plan_services(opts: UpOptions, cfg: RlstreamConfig, run_dir: Path, heldout: list[dict[str, Any]],
                  at: ServiceEndpoints) -> list[PlannedProcess]:
    """The rlstream services of the run, each with its own resolved config file under ``run_dir/config`` (the run's
    config plus what this process differs in); every process is started with ``-c`` its file and no overrides."""
    config_dir = run_dir / "config"

    def planned(name: str, overrides: Sequence[tuple[str, str]], *args: str) -> PlannedProcess:
        path = process_config(cfg, name, overrides, config_dir)
        return PlannedProcess(name, tuple(rlstream_command(*args, "-c", str(path))), path)

    serves = serving_overrides(gated=opts.gate and bool(heldout))
    plan = [planned("streams", [], "streams", "worker"), planned("learner", [], "learner", "run"),
            planned("inference-sync", _flag_pairs(serves.sync), "inference", "sync", "--backend", "vllm", "--url",
                    at.vllm_url)]
    if at.eval_vllm_url is not None:
        plan.append(planned("inference-sync-eval", [("inference.role", "evaluate")], "inference", "sync",
                            "--backend", "vllm", "--url", at.eval_vllm_url, "--worker-id",
                            f"{cfg.inference.worker_id}-eval"))
    if opts.gate and heldout:  # the gate evaluates every candidate on the held-out prompts before it serves
        heldout_file = run_dir / "heldout.jsonl"
        heldout_file.write_text("".join(json.dumps(e) + "\n" for e in heldout))
        gate = [] if cfg.gate.dataset else [("gate.dataset", str(heldout_file))]
        gate += _flag_pairs(canary_overrides(opts.traffic))
        gate += [("gate.samples", str(opts.gate_samples)), ("gate.examples", str(len(heldout)))]
        plan.append(planned("gate", gate, "gate"))
    if opts.traffic == "production":
        assert at.gateway_port is not None
        gateway = [*_flag_pairs(serves.gateway), ("gateway.served_model", cfg.rollout.model),
                   ("gateway.session_idle_s", "30")]
        plan.append(planned("gateway", gateway, "gateway", "serve", "--upstream", at.vllm_url, "--port",
                            str(at.gateway_port), "--spool-dir", str(run_dir / "spool")))
        low, high = opts.feedback_delay_s
        plan.append(planned("users", [], "rollout", "users", "--gateway", f"http://127.0.0.1:{at.gateway_port}",
                            "--task", opts.task, "--feedback-min-s", str(low), "--feedback-max-s", str(high),
                            "--concurrency", str(opts.users),
                            *task_users_args(opts)))
    else:
        plan.append(planned("rollout", [], "rollout", "run"))
    return plan


def plan_console(cfg: RlstreamConfig, run_dir: Path, port: int) -> PlannedProcess:
    """``rlstream console`` of the run on loopback ``port``, with its own config file: an auxiliary process (the run
    goes on without it; ops/supervisor.py)."""
    path = process_config(cfg, "console", [], run_dir / "config")
    return PlannedProcess("console", tuple(rlstream_command("console", "--port", str(port), "-c", str(path))), path)


def write_vllm_config(path: Path, model_dir: Path, served: str, port: int, parser: str | None,
                      extra_args: list[str]) -> Path:
    """``path``: a vLLM server's main options (model, served name, port, resolved tool-call parser, extra options),
    the same file in a dry run and a real run."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"model": str(model_dir), "served_model_name": served, "port": port,
                                    "tool_call_parser": parser, "extra_args": list(extra_args)}, sort_keys=False))
    return path


def plan_vllm(name: str, model_dir: Path, served: str, port: int, extra_args: list[str], tool_call_parser: str,
              config_dir: Path, tokenizer: ModelSource | None = None) -> PlannedProcess:
    """A vLLM server of the run: its main options (``start_vllm_server`` adds the engine's fixed ones) written to
    ``config_dir/NAME.yaml``; the tool-call parser checked against ``tokenizer`` (default: ``model_dir``'s)."""
    from rlstream.ops.vllm import resolve_tool_call_parser, tool_call_args

    checked = model_dir if tokenizer is None else tokenizer
    parser = resolve_tool_call_parser(checked, tool_call_parser, extra_args)
    path = write_vllm_config(config_dir / f"{name}.yaml", model_dir, served, port, parser, extra_args)
    argv = ("vllm", "serve", str(model_dir), "--served-model-name", served, "--port", str(port),
            *tool_call_args(checked, tool_call_parser, extra_args), *extra_args)
    return PlannedProcess(name, argv, path)


def print_plan(plan: Sequence[PlannedProcess]) -> None:
    """The process plan: one block per process (name, config file, command line)."""
    for process in plan:
        print(f"{process.name}\n  config:  {process.config_file}\n  command: {shlex.join(process.argv)}", flush=True)


def _vllm_key(user_cfg: RlstreamConfig | None) -> str:
    """vLLM's key (its --api-key): the inference settings' own, else a fresh one; masked wherever it shows."""
    wanted = (user_cfg or RlstreamConfig()).inference.api_key
    key = wanted.get_secret_value() if wanted is not None else f"vllm-{secrets.token_urlsafe(32)}"
    remember_secret(key)
    return key


def dry_run_up(opts: UpOptions) -> list[PlannedProcess]:
    """Resolve and write the config of every process ``rlstream up`` would start (``RUN_DIR/config/NAME.yaml``,
    without secrets), check the tool-call parser against the model's tokenizer, print the plan and return it;
    starts no broker, Redis, vLLM or service."""
    user_cfg = load_config(opts.config, opts.overrides) if opts.config else None
    run_id = f"up-{time.strftime('%Y%m%d-%H%M%S')}-dry-run"
    run_dir = (opts.runs_dir / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir, dataset, heldout = task_inputs(opts, run_dir, user_cfg, build_model=False)
    # a toy model not built yet is checked by the tokenizer it will have (building it takes up to minutes)
    tokenizer: ModelSource = model_dir if model_dir.is_dir() else toy_model_tokenizer(opts.model)
    served = user_cfg.inference.served_model if user_cfg else TOY_DEFAULTS["inference"]["served_model"]
    # the addresses up would use: the environment's, else those of the broker and Redis it would start
    stack = StackAddresses(os.environ.get("RLSTREAM_KAFKA_BOOTSTRAP") or f"{LOOPBACK}:{free_port()}",
                           os.environ.get("RLSTREAM_REDIS_URL") or f"redis://{LOOPBACK}:{free_port()}/0")
    vllm_port = free_port()
    cfg, config_path = compose_config(opts, run_id, run_dir, stack, None if user_cfg else model_dir,
                                      f"http://{LOOPBACK}:{vllm_port}", dataset, vllm_api_key=_vllm_key(user_cfg))
    evaluation_server = opts.gate and bool(heldout) and not cfg.learner.lora.enabled
    extra = task_vllm_args(opts, run_dir)
    ports = {"vllm": vllm_port, **({"vllm-eval": free_port()} if evaluation_server else {})}
    plan = [plan_vllm(name, model_dir, served, port, extra, opts.tool_call_parser, run_dir / "config", tokenizer)
            for name, port in ports.items()]
    eval_url = f"http://{LOOPBACK}:{ports['vllm-eval']}" if "vllm-eval" in ports else None
    gateway_port = free_port() if opts.traffic == "production" else None
    plan += plan_services(opts, cfg, run_dir, heldout, ServiceEndpoints(f"http://{LOOPBACK}:{vllm_port}", eval_url,
                                                                        gateway_port))
    plan.append(plan_console(cfg, run_dir, free_port()))
    print(f"dry run {run_id}: run config {config_path}; nothing started", flush=True)
    if isinstance(tokenizer, ModelTokenizer):
        print(f"model: {model_dir} is built by the first real run; the tool-call parser was checked against "
              f"{tokenizer.source}", flush=True)
    print_plan(plan)
    return plan


def run_up(opts: UpOptions) -> dict[str, Any]:
    """Run the whole system until ``duration_s``, ``until_version`` (scored) or Ctrl-C, whichever comes first;
    returns the summary written to disk."""
    from rlstream.ops.vllm import ensure_vllm_venv, resolve_tool_call_parser

    if opts.dry_run:
        dry_run_up(opts)
        return {}
    user_cfg = load_config(opts.config, opts.overrides) if opts.config else None  # fail before starting anything
    run_id = f"up-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = (opts.runs_dir / run_id).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    model_dir, dataset, heldout = task_inputs(opts, run_dir, user_cfg)
    vllm_args = task_vllm_args(opts, run_dir)
    resolve_tool_call_parser(model_dir, opts.tool_call_parser, vllm_args)  # refuse before anything starts
    # SIGTERM/SIGHUP stop the run as Ctrl-C does; every child dies with this process even when it is SIGKILLed
    signals = terminate_as_interrupt()
    signals.install()
    stack = LocalStack.start(run_dir / "infra")
    sup = Supervisor(run_dir / "logs")
    figures = LiveFigures()
    vllm_supervisors: dict[str, VllmSupervisor] = {}
    cfg: RlstreamConfig | None = None
    config_path = run_dir / "config.yaml"
    try:
        print(f"run {run_id}: data in {run_dir}", flush=True)
        print("preparing vLLM (its own virtualenv; the first run installs it, ~3-5 min)…", flush=True)
        ensure_vllm_venv(None, log_file=run_dir / "logs" / "vllm-install.log")
        served = user_cfg.inference.served_model if user_cfg else TOY_DEFAULTS["inference"]["served_model"]
        # every service gets vLLM's key through the environment (secret_env), never in a file or on a command line
        vllm_key = _vllm_key(user_cfg)
        vllm_port = free_port()
        cfg, config_path = compose_config(opts, run_id, run_dir, stack, None if user_cfg else model_dir,
                                          f"http://{LOOPBACK}:{vllm_port}", dataset, vllm_api_key=vllm_key)
        sup.env.update(secret_env(cfg))
        # full weights: one server holds one set, so the gate's candidates go to a dedicated evaluation server and
        # the serving server holds only what the serving pointer asks for (LoRA candidates load under own names)
        evaluation_server = opts.gate and bool(heldout) and not cfg.learner.lora.enabled
        if evaluation_server:
            print("starting the evaluation vLLM server too (full-weight candidates are evaluated there)…", flush=True)
        vllm_supervisors = _start_vllm_servers(
            sup, model_dir, served, run_dir, vllm_key, vllm_args,
            {"vllm": vllm_port, **({"vllm-eval": free_port()} if evaluation_server else {})},
            tool_call_parser=opts.tool_call_parser)
        _watch_vllm_servers(sup, vllm_supervisors, figures)
        vllm = vllm_supervisors["vllm"].server
        eval_vllm = vllm_supervisors["vllm-eval"].server if "vllm-eval" in vllm_supervisors else None
        if user_cfg is None and heldout and opts.task == "tool-agent":  # what no tool use earns on the same prompts
            from rlstream.ops.tool_task import baseline_scores

            figures.task_baselines = baseline_scores(heldout).figures()
        elif user_cfg is None and heldout:  # the toy task: what ignoring the instruction earns on the same prompts
            from rlstream.ops.toy import best_constant_answer
            from rlstream.rollout.loading import load_callable

            figures.constant_answer = best_constant_answer(heldout, load_callable(cfg.rollout.reward_function))
        asyncio.run(create_topics(cfg.kafka, cfg.topics))
        gateway_port = free_port() if opts.traffic == "production" else None
        plan = plan_services(opts, cfg, run_dir, heldout, ServiceEndpoints(
            vllm.url, eval_vllm.url if eval_vllm is not None else None, gateway_port))
        if opts.gate and heldout:
            figures.promotion.gate = True
        elif opts.gate:
            log.warning("no held-out examples (set finetuning.validation_dataset or gate.dataset): the promotion "
                        "gate is off and every loaded version serves")
        if gateway_port is not None:
            api_key = f"rls-{secrets.token_urlsafe(32)}"  # the gateway's client key, through the environment only
            remember_secret(api_key)
            sup.env.update({API_KEYS_ENV: api_key, USERS_API_KEY_ENV: api_key})
            print(f"gateway http://127.0.0.1:{gateway_port} (OpenAI-compatible; send Authorization: Bearer {api_key})",
                  flush=True)
        console_port = free_port()  # the read-only web page of the run (docs/console.md); the run goes on without it
        console = plan_console(cfg, run_dir, console_port)
        sup.spawn(console.name, list(console.argv), env={API_KEYS_ENV: ""},  # loopback: open to this machine, not
                  auxiliary=True)  # behind the gateway's client key
        print(f"console http://127.0.0.1:{console_port}/ (read-only web page of the run)", flush=True)
        for process in plan:
            if process.name == "users" and figures.promotion.gate:
                # production is answered only by a promoted version: the users start once version 0 serves
                _wait_for_serving(cfg, sup)
            sup.spawn(process.name, list(process.argv), env=child_env(process.name))
        try:
            asyncio.run(_supervise(cfg, opts, sup, vllm.url, heldout, figures))
        except KeyboardInterrupt:
            pass
        signals.install()  # asyncio.run reset SIGTERM to its default
    except KeyboardInterrupt:
        log.warning("interrupted; stopping the services")
    finally:
        for supervisor in vllm_supervisors.values():  # no restart of a server the run stops
            supervisor.stop()
        sup.stop_all()
        topic_ends = _topic_end_offsets(cfg) if cfg is not None else {}
        stack.stop()
        plot = None
        try:
            plot = write_plot(figures, run_dir / "reward_per_version.png", run_id)
        except Exception as exc:
            log.warning("plot not written", error=str(exc))
        summary = summarize(figures, run_id, run_dir, config_path, plot, topic_ends)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"\nrun data and checkpoints: {run_dir}")
        print(f"plot:    {plot}")
        print(f"summary: {run_dir / 'summary.json'}")
        signals.restore()
    return summary


#: cores at or below which the learner runs one OpenMP thread: vLLM and the other services share the cores, and
#: OpenMP threads that wait for a busy core at every barrier made a learner step 2x slower
#: (bench/results/2026-11-25-tool-agent.md)
LEARNER_SINGLE_THREAD_CORES = 4


def child_env(name: str) -> dict[str, str]:
    """Environment added to the ``name`` service of ``rlstream up``: on a small machine the learner gets
    ``OMP_NUM_THREADS=1`` unless the caller set it."""
    if name == "learner" and "OMP_NUM_THREADS" not in os.environ \
            and (os.cpu_count() or 1) <= LEARNER_SINGLE_THREAD_CORES:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def _wait_for_serving(cfg: RlstreamConfig, sup: Supervisor, timeout_s: float = 600.0) -> None:
    """Wait until a serving pointer exists (the gate promotes version 0 once the learner announced it), so the
    simulated users' first request is answered; a service that died meanwhile, or the timeout, ends the wait (the
    users then start anyway, and their 503s show in the summary)."""
    from rlstream.transport.serving import ServingControl

    async def wait() -> bool:
        control = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
        try:
            serving = ServingControl(control)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if await serving.serving(cfg.policy) is not None:
                    return True
                if sup.dead():
                    return False
                await asyncio.sleep(0.5)
            return False
        finally:
            await control.close()

    print("waiting for the gate to serve version 0 (the base weights) before production traffic starts…", flush=True)
    if not asyncio.run(wait()):
        log.warning("no serving version yet: production traffic starts anyway", timeout_s=timeout_s)


def _topic_end_offsets(cfg: RlstreamConfig) -> dict[str, int]:
    """What the run wrote to each topic, read before the broker stops (empty when it cannot be read)."""
    from rlstream.ops.status import topic_end_offsets

    try:
        return asyncio.run(topic_end_offsets(cfg.kafka, TopicNames.from_config(cfg.topics)))
    except Exception as exc:  # the summary must be written even when the broker is gone
        log.warning("topic offsets not read", error=str(exc))
        return {}
