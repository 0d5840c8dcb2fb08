"""What the platform's jobs read: every user's prompt and exclusions, and the user embeddings (the soft token).

    users.parquet            user_id, prompt, exclude_item_ids,  (jobs/batch_recommend.py --users)
                             history (the ranker's events)
    user_embeddings.parquet  user_id, embedding                  (jobs/load_user_embeddings.py --embeddings)

Derived from MovieLens: they live under the git-ignored output directory and are never committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from genrec.model.directory import ModelDir
from genrec.model.tokenizer import USER_TOKEN
from genrec_demo.data import MovieLens
from genrec_demo.prompts import prompt_text, prompt_token_ids
from genrec_demo.ranker.events import histories_before, history_array


@dataclass
class Prompts:
    """Builds a user's prompt text from their history, with the model directory's tokenizer and catalog."""

    tokenizer: object
    codes: np.ndarray  # [items in MovieLens order, levels] token IDs
    user_token: int
    history: int

    @classmethod
    def of(cls, model_dir: Path, data: MovieLens, history: int) -> Prompts:
        directory = ModelDir.open(model_dir)
        tokenizer = directory.load_tokenizer()
        catalog = directory.load_catalog(tokenizer)
        codes = catalog.codes[[catalog.index_of(item) for item in data.item_ids]]
        return cls(tokenizer, codes, tokenizer.convert_tokens_to_ids(USER_TOKEN), history)

    def text(self, items: np.ndarray) -> str:
        return prompt_text(self.tokenizer, prompt_token_ids(self.codes, items, self.user_token, self.history))


@dataclass
class Inputs:
    users: Path
    embeddings: Path


def write_inputs(out: Path, data: MovieLens, prompts: Prompts, user_vectors: np.ndarray, window: int) -> Inputs:
    """Each user's request for their next item: the history before the held-out test item, all of it excluded;
    the ranker's form of it (its last `window` events) beside the retriever's prompt."""
    out.mkdir(parents=True, exist_ok=True)
    seen = [data.seen_before_test(u) for u in range(len(data.user_ids))]
    users = pa.table(
        {
            "user_id": pa.array(data.user_ids, pa.string()),
            "prompt": [prompts.text(items) for items in seen],
            "exclude_item_ids": [[data.item_ids[i] for i in items] for items in seen],
            "history": history_array(histories_before(data, [len(items) for items in seen], window)),
        }
    )
    embeddings = pa.table(
        {
            "user_id": pa.array(data.user_ids, pa.string()),
            "embedding": pa.array(user_vectors.astype(np.float32).tolist(), pa.list_(pa.float32())),
        }
    )
    paths = Inputs(out / "users.parquet", out / "user_embeddings.parquet")
    pq.write_table(users, paths.users, row_group_size=64)  # the batch job reads row groups per shard
    pq.write_table(embeddings, paths.embeddings)
    return paths
