"""`genrec bench` is a thin entry into a package of its own (genrec_bench): without it, the command says how to
install it, and the rest of `genrec` works."""

import os
import subprocess
import sys

import pytest

WITHOUT_BENCH = """
import sys

class NotInstalled:  # first on the path: genrec_bench is found nowhere, with the error Python gives then
    def find_spec(self, name, path=None, target=None):
        if name == "genrec_bench":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
sys.argv[0] = "genrec"
from genrec.cli import main
main()
"""


def genrec(*argv: str, without_bench: bool) -> subprocess.CompletedProcess:
    code = WITHOUT_BENCH if without_bench else "import sys; from genrec.cli import main; sys.argv[0] = 'genrec'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.parametrize("argv", [["bench"], ["bench", "retrieve", "--beam-width", "3"], ["bench", "--help"]])
def test_bench_without_its_package_says_how_to_install_it(argv):
    done = genrec(*argv, without_bench=True)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: genrec bench: the benchmarks are their own package, genrec_bench")
    assert "pip install -e ." in done.stderr and "Traceback" not in done.stderr


def test_genrec_without_the_bench_package_still_runs():
    done = genrec("--help", without_bench=True)
    assert done.returncode == 0, done.stderr
    assert "tiny-model" in done.stdout and "not installed here" in done.stdout


def test_bench_with_its_package_is_the_benchmarks():
    done = genrec("bench", "--help", without_bench=False)
    assert done.returncode == 0, done.stderr
    assert "retrieve" in done.stdout and "catalog-reload" in done.stdout
