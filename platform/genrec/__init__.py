"""genrec: generative recommendation with semantic IDs on a Qwen3 decoder."""

__version__ = "0.1.0"
