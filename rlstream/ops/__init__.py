"""Operations: operator tools, the local stack and its processes, ``rlstream up`` and the vLLM launcher.

Operator tools (one command each): ``tail.py``, ``status.py``, ``replay.py``, ``plot.py``, ``lineage.py``,
``promotion.py`` (rollback / promote), ``export.py`` with ``atif.py`` (export / import).

Processes and the local stack:

* ``ports.py``: free loopback ports, is a port open.
* ``processes.py``: process identity (alive, same start time and boot) and stopping a process group, via psutil.
* ``children.py``: starting children that die with their parent (PDEATHSIG and the group reaper, ``reaper.py``).
* ``interrupts.py``: SIGTERM / SIGHUP as Ctrl-C for launchers.
* ``infra.py``: the local broker (noida-db) and Redis; ``infra_daemon.py``: the ``rlstream infra up`` daemon.

``rlstream up``: ``up.py`` (the run), ``up_config.py`` (options, task, effective config), ``supervisor.py`` (its
children, also ``rlstream finetune``'s), ``evaluation.py`` (held-out scores per version), ``live.py`` (live figures
and view), ``version_plot.py`` and ``summary.py`` (the run's outputs).

Models, tasks and servers: ``vllm.py`` (vLLM's own virtualenv and server), ``toy.py`` and ``tool_task.py`` (tiny model
and tasks). Assets: ``alerts.yml``, ``prometheus.yml``, ``grafana/``, ``RUNBOOK.md``.
"""
