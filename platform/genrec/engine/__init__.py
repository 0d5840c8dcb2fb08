from genrec.engine.async_engine import AsyncEngine
from genrec.engine.engine import Engine
from genrec.engine.scheduler import SchedulerConfig

__all__ = ["AsyncEngine", "Engine", "SchedulerConfig"]
