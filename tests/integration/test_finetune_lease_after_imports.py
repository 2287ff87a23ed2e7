"""The finetune run takes its learner lease only once the learner's modules (torch behind them; transformers and
peft are imported when the policy loads, in a thread) are imported: an import on the event loop holds up the lease's renewal, and on a loaded machine importing them
takes longer than the lease lives (the run then stops with "learner lease lost" before its first epoch).

Run in a fresh interpreter against the session's broker and Redis: what is imported at the moment the lease is asked
for. Negative control: the modules the run imports up to that point do not import torch by themselves (a module
imported first thing in the child before the run starts is the control's own)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlstream.schemas.config import RlstreamConfig

CHILD = """
import asyncio, json, sys
from rlstream.finetune import runtime
from rlstream.schemas.config import RlstreamConfig
from rlstream.transport.control import ControlPlane

seen = {"torch_before_open": "torch" in sys.modules}


class Asked(Exception):
    pass


async def acquire_lease(self, *args, **kwargs):
    seen.update({name: name in sys.modules for name in ("torch", "rlstream.learner.publish", "rlstream.learner.step",
                                                        "rlstream.learner.loop", "rlstream.inference.sync")})
    raise Asked()

ControlPlane.acquire_lease = acquire_lease
cfg = RlstreamConfig.model_validate_json(open(sys.argv[1]).read())
ctx = runtime.FinetuneContext(cfg, server_url="http://127.0.0.1:9")
try:
    asyncio.run(ctx.open())
except Asked:
    pass
print(json.dumps(seen))
"""


def test_the_learner_lease_is_taken_after_the_learner_modules_are_imported(rl_config: RlstreamConfig,
                                                                           tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(rl_config.model_dump_json())
    proc = subprocess.run([sys.executable, "-c", CHILD, str(config)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen.pop("torch_before_open") is False  # control: nothing before the run's open imported torch
    assert seen and all(seen.values()), seen
