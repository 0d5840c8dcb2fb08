"""The demo: MovieLens-100k, a Qwen3 trained on semantic IDs, served and measured against most-popular.

An example outside the serving package: it uses genrec only through genrec's modules, and nothing in genrec
imports it. `python -m genrec_demo` (what `make demo` runs) is its command line (genrec_demo.cli).
"""

from genrec_demo.config import DemoConfig
from genrec_demo.pipeline.run import run_demo

__all__ = ["DemoConfig", "run_demo"]
