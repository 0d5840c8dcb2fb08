"""Items <-> semantic-ID codes (`Catalog`) and their constraint trie (`CodeTrie`). The trie needs torch and loads on
first use, so a catalog file can be read and checked without it (`genrec deploy`'s check on a machine without GPUs)."""

from genrec.catalog.catalog import Catalog

__all__ = ["Catalog", "CodeTrie"]


def __getattr__(name: str):
    if name == "CodeTrie":
        from genrec.catalog.trie import CodeTrie

        return CodeTrie
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
