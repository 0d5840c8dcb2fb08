"""The batch job's engine and cache flags: they reach the spec, bad values are one line naming the flag, and the
run identity holds what changes results (the engine's options) but not how the run executes (the KV budget)."""

import argparse

import pytest

from genrec.batch import BatchSpec, CacheConfig, Execution
from genrec.batch.job_args import add_cache_flags, add_shard_job_flags, cache_config, job_spec_fields, run_job


def spec_from(*flags: str) -> BatchSpec:
    parser = argparse.ArgumentParser()
    add_shard_job_flags(parser, users_help="users")
    add_cache_flags(parser)
    args = parser.parse_args(["--model", "m", "--users", "u", "--out", "o", *flags])
    return BatchSpec(cache=cache_config(args), **job_spec_fields(args))


def test_flags_left_out_are_the_settings_defaults():
    assert spec_from() == BatchSpec(model="m", users="u", out="o")
    assert spec_from("--cache", "users").cache == CacheConfig(name="users")


def test_engine_and_cache_flags_reach_the_spec_and_the_identity():
    spec = spec_from(
        *("--dtype", "bfloat16", "--score-max-tokens", "512", "--max-candidates", "9", "--cuda-fast"),
        *("--max-candidate-tokens", "4096"),
        *("--cache", "users", "--cache-policy", "lfu", "--cache-shards", "2", "--cache-store", "none"),
    )
    assert spec.engine_kwargs() == {
        "dtype": "bfloat16",
        "max_candidates": 9,
        "score_max_tokens": 512,
        "max_candidate_tokens": 4096,
        "cuda_fast": True,
    }
    assert spec.cache == CacheConfig(name="users", policy="lfu", shards=2, store="none")
    plain = BatchSpec(model="m", users="u", out="o").identity("v", "input")
    identity = spec.identity("v", "input")
    assert sorted(k for k in identity if identity[k] != plain[k]) == [
        "cache",
        "cuda_fast",
        "dtype",
        "max_candidate_tokens",
        "max_candidates",
        "score_max_tokens",
    ]


def test_the_kv_budget_is_how_a_run_executes_not_what_it_computes():
    assert "kv_budget_bytes" in Execution.model_fields and "kv_budget_bytes" not in BatchSpec.model_fields
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        Execution(kv_budget_bytes=0)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--score-max-tokens", "0"], "error: --score-max-tokens: Input should be greater than or equal to 1"),
        (["--max-candidates", "-1"], "error: --max-candidates: Input should be greater than or equal to 1"),
        (["--cache", "users", "--cache-capacity", "0"], "error: --cache-capacity: Input should be greater than 0"),
        (["--cache", "users", "--cache-admit-after", "0"], "error: --cache-admit-after: Input should be greater"),
        (["--cache", "users", "--cache-store", "redis", "--cache-redis-url", "localhost"], "redis_url must be a"),
    ],
)
def test_a_bad_engine_or_cache_flag_is_one_line_naming_it(flags, fragment, capsys):
    with pytest.raises(SystemExit) as exited:
        run_job(lambda: spec_from(*flags) and 0)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and fragment in err, err
