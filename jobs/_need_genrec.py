"""Imported first by every job script: when this interpreter cannot import genrec, say so in one line and exit 2.

`ray job submit -- python jobs/...` runs whatever `python` is on the cluster's PATH, and the working dir it
uploads carries no .venv: on a local `ray start --head` cluster that `python` is usually not the venv's.
"""

import sys

try:
    import genrec  # noqa: F401
except ImportError as err:
    print(
        f"error: {sys.executable} cannot import genrec ({err}): run the job with a python that has it installed, "
        "e.g. the venv's by absolute path (`ray job submit --working-dir . -- $PWD/.venv/bin/python jobs/...`, "
        "or `.venv/bin/python jobs/...` locally), or `pip install -e .` into this python (see jobs/README.md)",
        file=sys.stderr,
    )
    sys.exit(2)
