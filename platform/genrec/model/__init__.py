from genrec.model.config import Qwen3Config
from genrec.model.directory import HSTUDir, ModelDir, Qwen3Dir
from genrec.model.qwen3 import ContextKV, Qwen3

__all__ = ["ContextKV", "HSTUDir", "ModelDir", "Qwen3", "Qwen3Config", "Qwen3Dir"]
