"""A job script run by a python that cannot import genrec (`ray job submit -- python jobs/...` on a cluster whose
`python` is not the venv's) stops with one line saying what is missing and how to fix it, exit status 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (REPO / "jobs").glob("*.py") if not p.name.startswith("_"))


def test_every_job_script_is_checked():
    assert {"batch_recommend.py", "batch_rank.py", "load_user_embeddings.py", "build_semantic_ids.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_python_without_genrec_gets_one_line(script):
    # -S: no site-packages (the venv's genrec install lives there), no PYTHONPATH; the standard library stays
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, "-S", f"jobs/{script}", "--help"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: {sys.executable} cannot import genrec (No module named 'genrec')")
    assert ".venv/bin/python" in line and "pip install" in line
    assert done.stdout == ""
