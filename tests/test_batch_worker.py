"""The batch worker and output directory in-process (no Ray): every kind of bad row becomes an error row that
names its field, a cut output file counts as not done, and a rerun with other settings is refused."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from genrec.batch import RecommendSpec, run
from genrec.batch.output import RECOMMENDATIONS, STALE_TMP_AGE_S, OutputDir
from genrec.batch.shards import UsersInput
from genrec.batch.stages import Recommend, Retrieve
from genrec.errors import GenrecError
from genrec.model.directory import model_version
from genrec.model.tokenizer import USER_TOKEN
from tests.conftest import random_prompt
from tests.shard_runs import error_rows, run_in_process, run_shard

SCHEMA = pa.schema(
    [
        ("user_id", pa.int64()),
        ("prompt", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int64())),
        ("user_embedding", pa.list_(pa.float32())),
        ("candidates", pa.list_(pa.string())),
    ]
)


def test_every_kind_of_bad_row_becomes_an_error_naming_its_field(engine, tiny_dir, tmp_path):
    gen = torch.Generator().manual_seed(5)
    placeholder = engine.family.tokenizer.convert_tokens_to_ids(USER_TOKEN)
    dim, vocab = engine.family.projector.user_dim, engine.model.config.vocab_size
    ok = random_prompt(engine, 12, gen)
    cases = [  # (row fields, the field its error names; None: a good row)
        ({"prompt_token_ids": ok}, None),
        ({"prompt_token_ids": ok, "user_id": None}, "user_id"),
        ({"prompt": "   "}, "prompt"),
        ({}, "prompt"),
        ({"prompt_token_ids": [3, -1]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [vocab + 5]}, "prompt_token_ids"),
        ({"prompt_token_ids": [3] * (engine.family.max_prompt_tokens + 1)}, "prompt_token_ids"),
        ({"prompt_token_ids": [placeholder, *ok], "user_embedding": [0.5] * (dim + 1)}, "user_embedding"),
        ({"prompt_token_ids": [placeholder, *ok], "user_embedding": [math.nan] * dim}, "user_embedding"),
        ({"prompt_token_ids": [placeholder, *ok]}, "user_embedding"),
        ({"prompt_token_ids": ok, "candidates": ["item-000001", "no-such-item"]}, "candidates[1].item_id"),
        ({"prompt_token_ids": [placeholder, *ok], "user_embedding": [0.1] * dim, "candidates": ["item-000002"]}, None),
    ]
    rows = [{"user_id": i, **fields} for i, (fields, _) in enumerate(cases)]
    pq.write_table(pa.Table.from_pylist(rows, SCHEMA), tmp_path / "users.parquet")
    spec = RecommendSpec(
        model=str(tiny_dir), users=str(tmp_path / "users.parquet"), out=str(tmp_path / "out"), beam_width=4, score=True
    )
    shard, worker, report = run_in_process(Recommend(spec))

    want = [(i, field, None if i == 1 else i) for i, (_, field) in enumerate(cases) if field]
    assert error_rows(spec.out, shard) == want
    output = pq.read_table(tmp_path / "out" / "recommendations" / shard.name).to_pylist()
    assert {r["user_id"] for r in output} == {0, len(cases) - 1}
    counts = {"rows": len(output), "errors": len(want), "degraded": 0}
    assert report == {"shard": 0, "users": len(cases), **counts, "skipped": False}
    again = run_shard(worker, shard)  # a retried task: nothing recomputed
    assert again["skipped"] and again["rows"] == len(output)


def test_a_cut_or_missing_output_file_is_not_done_and_stale_temporaries_go(tmp_path):
    out = OutputDir(str(tmp_path / "out"), RECOMMENDATIONS)
    out.open_run({"beam_width": 1})
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": list(range(5)), "prompt": ["x"] * 5}), users)
    shards = UsersInput(str(users), Retrieve.layout).shards(2)
    assert [(s.start, s.stop) for s in shards] == [(0, 2), (2, 4), (4, 5)]
    empty = pa.table({"user_id": pa.array([], pa.int64())})
    for shard in shards:
        out.commit(shard, empty, empty)
    recommendations = tmp_path / "out" / "recommendations"
    cut = recommendations / shards[1].name
    cut.write_bytes(cut.read_bytes()[:20])  # as a machine crash might leave it
    (tmp_path / "out" / "errors" / shards[2].name).unlink()
    stale, live = recommendations / ".part-000009.parquet.0123.tmp", recommendations / ".part-000008.parquet.4567.tmp"
    for tmp in (stale, live):
        tmp.write_bytes(b"partial")
    old = time.time() - STALE_TMP_AGE_S - 1  # a killed writer's; the other may be a live run's, being written
    os.utime(stale, (old, old))
    assert sorted(out.committed(shards)) == [0]
    assert out.remove_stale_tmp() == 1 and list(recommendations.glob(".*")) == [live]


def test_a_rerun_with_other_settings_is_refused_before_any_work(tiny_dir, tmp_path):
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello"]}), users)
    first = RecommendSpec(model=str(tiny_dir), users=str(users), out=str(tmp_path / "out"), beam_width=8)
    fingerprint = UsersInput(str(users), Retrieve.layout).fingerprint()
    OutputDir(first.out, RECOMMENDATIONS).open_run(first.identity(model_version(tiny_dir), fingerprint))
    with pytest.raises(GenrecError, match="another run .*beam_width: 8 -> 9"):
        run(first.model_copy(update={"beam_width": 9}))
    pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello again"]}), users)  # a new night's input
    with pytest.raises(GenrecError, match="another run .*input"):
        run(first)


@pytest.mark.parametrize(
    "columns, fragment",
    [
        ({"prompt": ["x"]}, "column 'user_id' is missing"),
        ({"user_id": [1], "text": ["x"]}, "needs a column 'prompt'"),
        ({"user_id": [1.5], "prompt": ["x"]}, "must hold integers or strings"),
    ],
)
def test_an_unusable_users_file_is_one_clear_error(tmp_path, columns, fragment):
    pq.write_table(pa.table(columns), tmp_path / "users.parquet")
    with pytest.raises(GenrecError, match=fragment):
        UsersInput(str(tmp_path / "users.parquet"), Retrieve.layout)
    with pytest.raises(GenrecError, match="no such file"):
        UsersInput(str(tmp_path / "missing.parquet"), Retrieve.layout)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--beam-width", "0"], "error: --beam-width: Input should be greater than or equal to 1"),
        (["--beam-width", "4", "--num-results", "9"], "error: num_results (9) exceeds beam_width (4)"),
        (["--users", "/no/such/users.parquet"], "no such file or directory (expected the users Parquet)"),
        (["--order-by", "joint"], "error: order_by applies to recommend: set score"),
        (["--score", "--score-weight", "2"], "error: score_weight applies to order_by joint"),
        (["--score", "--order-by", "joint", "--score-weight", "-1"], "error: --score-weight: Input should be greater"),
    ],
)
def test_the_job_refuses_bad_arguments_in_one_line_before_starting_ray(tiny_dir, tmp_path, flags, fragment):
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello"]}), users)
    job = [sys.executable, str(Path(__file__).resolve().parents[1] / "jobs" / "batch_recommend.py")]
    job += ["--model", str(tiny_dir), "--users", str(users), "--out", str(tmp_path / "out"), *flags]
    done = subprocess.run(job, capture_output=True, text=True, timeout=120, env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and fragment in done.stderr, done.stderr


def test_an_actor_refuses_a_catalog_changed_since_the_run_started(tiny_dir, tmp_path):
    """One run never mixes catalog versions: an actor (started or restarted later) that loads another version
    than the driver found at the start refuses to run, naming both."""
    from genrec.batch.stages import Retrieve
    from genrec.batch.worker import ShardWorker
    from genrec.catalog.catalog import catalog_version

    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": ["a"], "prompt": ["hello"]}), users)
    spec = RecommendSpec(model=str(tiny_dir), users=str(users), out=str(tmp_path / "out"), beam_width=4)
    now = catalog_version(tiny_dir / "genrec/catalog.parquet")
    ShardWorker(Retrieve(spec), run_id="r", catalog_version=now)  # the same version: runs
    with pytest.raises(GenrecError, match=f"catalog changed during the run .*0123456789abcdef.*{now}"):
        ShardWorker(Retrieve(spec), run_id="r", catalog_version="0123456789abcdef")
