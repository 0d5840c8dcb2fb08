"""Run the platform's job scripts (`jobs/*.py`) against the demo's Ray, as a user would run them locally.

Each job is its own process connected by RAY_ADDRESS. Its last line (its JSON summary) is shown, and on a
failure the lines before it. Ctrl-C stops the job's whole process group before it propagates.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import genrec
from genrec.errors import GenrecError

REPO_ROOT = Path(genrec.__file__).resolve().parents[2]  # platform/genrec/__init__.py -> the repository
JOBS_DIR = REPO_ROOT / "jobs"
TAIL = 30  # output lines shown when a job fails


@dataclass
class JobResult:
    summary: dict
    seconds: float


def run_job(script: str, args: list[str], ray_address: str, say) -> JobResult:
    path = JOBS_DIR / script
    if not path.is_file():
        raise GenrecError(f"{path}: job script not found (the demo runs from a clone of the repository)")
    env = {**os.environ, "RAY_ADDRESS": ray_address, "RAY_AUTH_MODE": "disabled"}
    say(f"$ python jobs/{script} {' '.join(args)}")
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(path), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: stopped as one on Ctrl-C
    )
    lines: list[str] = []
    try:
        lines = [line.rstrip() for line in process.stdout if line.strip()]
        status = process.wait()
    except BaseException:  # Ctrl-C (KeyboardInterrupt) or anything else: never leave the job running
        _stop(process)
        raise
    last = lines[-1] if lines else ""
    if status != 0:
        tail = "\n".join(f"  | {line}" for line in lines[-TAIL:])
        raise GenrecError(f"jobs/{script} exited with status {status}:\n{tail}")
    say(f"  | {last}")
    return JobResult(_summary(last), round(time.perf_counter() - started, 1))


def _summary(line: str) -> dict:
    """The job's JSON summary on its last line (`batch summary: {...}` or a bare JSON object)."""
    text = line[line.index("{") :] if "{" in line else ""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"output": line}


def _stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
