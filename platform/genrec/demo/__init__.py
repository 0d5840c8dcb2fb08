"""The demo: MovieLens-100k, a Qwen3 trained on semantic IDs, served and measured against most-popular."""

from genrec.demo.config import DemoConfig
from genrec.demo.pipeline.run import run_demo

__all__ = ["DemoConfig", "run_demo"]
