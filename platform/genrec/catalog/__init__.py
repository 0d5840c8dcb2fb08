from genrec.catalog.catalog import Catalog
from genrec.catalog.trie import CodeTrie

__all__ = ["Catalog", "CodeTrie"]
