from genrec.engine.engine import Engine

__all__ = ["Engine"]
