"""The model families (qwen3.py, hstu.py), their directories (directory.py) and configs (config.py). Nothing is
re-exported here: importing config.py must not import torch (`genrec deploy` checks a config.json without it)."""
