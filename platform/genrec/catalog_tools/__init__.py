"""Offline catalog tools: build semantic IDs from item embeddings, add and retire items, import other projects' item
maps. They write the catalog files an engine serves (genrec.catalog); no engine imports them."""
