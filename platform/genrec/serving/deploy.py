"""`genrec deploy CONFIG.yaml [-a ADDRESS] [--model]`: Serve's `serve deploy`, sent only for a config that passes
`genrec.serving.check`.

Serve accepts what it is sent and finds problems late. The builder refuses bad `args` and model directories at
deploy (preflight.py), but Serve runs no builder for a change of a deployment's `user_config` alone: such a config
goes straight to the running replicas, which refuse it and keep their limits (args.live_limits) while the deploy
itself reports success. This gate refuses it, and every other problem the check finds, before anything is sent:
one `error:` line each, exit 2, the running version untouched. A KubeRay RayService file is applied by kubectl,
not here; `python -m genrec.serving.check` checks it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from genrec.serving.check import file_problems, is_rayservice


def deploy(path: Path, address: str | None, check_model: bool) -> int:
    """The exit status: 2 when the config was refused here (nothing sent), else `serve deploy`'s."""
    found = file_problems(path, check_model)
    if not found and is_rayservice(yaml.safe_load(path.read_text())):
        found = ["a KubeRay RayService: apply it with kubectl (it is checked, not deployed, here)"]
    for problem in found:
        print(f"error: {path}: {problem}", file=sys.stderr)
    if found:
        print(f"error: {path}: not deployed (the running version, if any, is unchanged)", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "ray.serve.scripts", "deploy", str(path)]
    return subprocess.run(command + (["--address", address] if address else [])).returncode
