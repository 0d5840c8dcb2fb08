"""The engine: `Engine`, `AsyncEngine`, `SchedulerConfig`. Loaded on first use (PEP 562), so that importing a light
module of the package (e.g. `genrec.engine.metrics`, which a Serve ingress reads) does not import torch."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genrec.engine.async_engine import AsyncEngine
    from genrec.engine.engine import Engine
    from genrec.engine.scheduler import SchedulerConfig

__all__ = ["AsyncEngine", "Engine", "SchedulerConfig"]
_HOMES = {"AsyncEngine": "async_engine", "Engine": "engine", "SchedulerConfig": "scheduler"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'genrec.engine' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"genrec.engine.{_HOMES[name]}"), name)
