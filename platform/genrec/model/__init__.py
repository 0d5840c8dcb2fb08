from genrec.model.config import Qwen3Config
from genrec.model.loader import load_qwen3
from genrec.model.qwen3 import ContextKV, Qwen3

__all__ = ["ContextKV", "Qwen3", "Qwen3Config", "load_qwen3"]
