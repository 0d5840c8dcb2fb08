"""The batch jobs' flags, derived from the settings' fields: the engine and cache flags reach the spec, bad values
are one line naming the flag, the removed recommend flags are refused, and the run identity holds
what changes results (the engine's options) but not how the run executes (the KV budget)."""

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from genrec.batch import CacheConfig, Execution, FunnelSpec, RankingExecution, RankSpec, RecommendSpec
from genrec.batch.job_args import add_cache_flags, cache_config, parse, run_job

RECOMMEND = ((RecommendSpec, Execution), (FunnelSpec, Execution, RankingExecution))
REPO = Path(__file__).resolve().parents[1]


def spec_from(*flags: str) -> RecommendSpec:
    spec, _ = parse(RECOMMEND, ["--model", "m", "--users", "u", "--out", "o", *flags])
    return spec


def test_flags_left_out_are_the_settings_defaults():
    assert spec_from() == RecommendSpec(model="m", users="u", out="o")
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
    assert spec_from("--no-cuda-fast").engine_kwargs()["cuda_fast"] is False  # the opt-out
    assert spec_from("--split-kv", "off").engine_kwargs()["split_kv"] == "off"
    assert "split_kv" not in spec.engine_kwargs()  # auto unless asked: no part of a run's identity (same results)
    plain = RecommendSpec(model="m", users="u", out="o").identity("v", "input")
    identity = spec.identity("v", "input")
    assert "cuda_fast" not in plain  # derived from the device when not given: not part of a run's identity
    assert sorted(k for k in identity | plain if identity.get(k) != plain.get(k)) == [
        "cache",
        "cuda_fast",
        "dtype",
        "max_candidate_tokens",
        "max_candidates",
        "score_max_tokens",
    ]


def test_a_relative_cache_file_is_the_drivers(tmp_path, monkeypatch):
    """The cache's actor runs in the cluster's working directory: a relative SQLite file is made absolute on the
    driver, in the recommend job's spec and in the flags the loader job reads (issue #29 item 7)."""
    monkeypatch.chdir(tmp_path)
    spec = spec_from("--cache", "users", "--cache-store-path", "emb/users.sqlite")
    assert spec.cache.store_path == str(tmp_path / "emb" / "users.sqlite")
    parser = argparse.ArgumentParser()
    add_cache_flags(parser, required=True)
    loader = cache_config(parser.parse_args(["--cache", "users", "--cache-store-path", "~/users.sqlite"]))
    assert loader.store_path == str(Path.home() / "users.sqlite")


def test_the_kv_budget_is_how_a_run_executes_not_what_it_computes():
    assert "kv_budget_bytes" in Execution.model_fields and "kv_budget_bytes" not in RecommendSpec.model_fields
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


def test_a_beam_width_schedule_is_a_comma_separated_flag():
    spec = spec_from("--beam-widths", "4,8,16")
    assert spec.beam_widths == [4, 8, 16] and spec.beam_width == 16  # the result's width: the last level's
    assert spec.identity("v", "in")["beam_widths"] == [4, 8, 16]
    assert "beam_widths" not in spec_from().identity("v", "in")  # without one, run_ids stay as they were
    assert spec_from("--beam-widths", "4,8,16", "--beam-width", "16") == spec


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--beam-widths", "4,0,16"], "error: --beam-widths: Input should be greater than or equal to 1"),
        (["--beam-widths", "4,8", "--beam-width", "9"], "beam_width (9) differs from the last of beam_widths"),
        (["--beam-widths", "4,8,16", "--num-results", "17"], "num_results (17) exceeds beam_width (16)"),
    ],
)
def test_a_bad_beam_width_schedule_is_one_line_naming_it(flags, fragment, capsys):
    with pytest.raises(SystemExit) as exited:
        run_job(lambda: spec_from(*flags) and 0)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and fragment in err, err


def test_a_beam_width_schedule_that_is_not_integers_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exited:
        spec_from("--beam-widths", "4,x")
    assert exited.value.code == 2 and "--beam-widths: '4,x': give comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, models",
    [("batch_recommend.py", RECOMMEND[-1]), ("batch_rank.py", (RankSpec, Execution))],
)
def test_every_setting_is_a_flag_of_the_job(script, models):
    usage = subprocess.run([sys.executable, str(REPO / "jobs" / script), "--help"], capture_output=True, text=True)
    flags = {word.strip("[],") for word in usage.stdout.split() if word.startswith(("--", "[--"))}
    for model in models:
        for name, field in model.model_fields.items():
            if name in ("device", "cache"):  # the device follows --num-gpus; the cache: --cache NAME, --cache-*
                continue
            flag = "--" + ("no-" if field.default is True else "") + name.replace("_", "-")
            assert flag in flags, (flag, sorted(flags))
    assert script != "batch_recommend.py" or {"--cache", "--cache-shards", "--cache-store-path"} <= flags


def test_the_removed_recommend_flags_are_refused_and_the_identity_keeps_their_keys(capsys):
    """--rank and --rank-by (--score's and --order-by's names before) are gone (docs/CHANGELOG.md): refused by
    argparse, exit 2, naming the flag. The identity keeps their names as its keys, so that a rerun of a run made with
    them keeps its run_id."""
    for old in ("--rank", "--rank-by"):
        with pytest.raises(SystemExit) as exited:
            spec_from(old, *(["joint"] if old == "--rank-by" else []))
        assert exited.value.code == 2 and old in capsys.readouterr().err.splitlines()[-1]
    identity = spec_from("--score", "--order-by", "joint", "--score-weight", "0.5").identity("v", "in")
    assert (identity["rank"], identity["rank_by"], identity["score_weight"]) == (True, "joint", 0.5)
    assert not {"score", "order_by"} & set(identity)


def test_the_rank_job_keeps_its_rank_by_task():
    spec, (run,) = parse(((RankSpec, Execution),), ["--model", "m", "--users", "u", "--out", "o", "--rank-by", "click"])
    assert spec == RankSpec(model="m", users="u", out="o", rank_by="click") and run == Execution()
    with pytest.raises(SystemExit):
        parse(((RankSpec, Execution),), ["--model", "m", "--users", "u", "--out", "o", "--score"])


def test_the_funnel_flags_make_a_funnel_spec_and_its_ranking_pool(hstu_dir):
    spec, (run, ranking) = parse(RECOMMEND, ["--model", "m", "--users", "u", "--out", "o", "--ranker", str(hstu_dir),
                                             "--rank-actors", "2", "--num-gpus", "1", "--no-progress"])  # fmt: skip
    assert isinstance(spec, FunnelSpec) and spec.rank_task == "click" and spec.device == "cuda"
    assert (run.num_gpus, run.progress, ranking.rank_actors) == (1.0, False, 2)


def test_fp8_runs_a_funnels_retriever_and_a_rank_job_refuses_it(tiny_dir, hstu_dir, capsys):
    from genrec.batch.stages import RankRetrieved, Recommend

    decoder = {"fp8": True, "split_kv": "on", "attention": "flash_attention_2"}
    funnel = FunnelSpec(model=str(tiny_dir), ranker=str(hstu_dir), users="u", out="o", **decoder)
    assert {name: Recommend(funnel).engine_kwargs()[name] for name in decoder} == decoder
    assert not set(decoder) & set(RankRetrieved(funnel).engine_kwargs())  # the HSTU ranker has no such paths
    for flags in (["--fp8"], ["--split-kv", "on"], ["--attention", "auto"]):  # taken with no effect until refused
        with pytest.raises(SystemExit) as exited:
            run_job(lambda f=flags: parse(((RankSpec, Execution),), ["--model", "m", "--users", "u", "--out", "o", *f]))
        err = capsys.readouterr().err
        name = flags[0][2:].replace("-", "_")
        assert exited.value.code == 2 and err.count("\n") == 1 and f"{name} is a Qwen3 decoder's option" in err, err


@pytest.mark.parametrize(
    "model, field, value",
    [
        (RecommendSpec, "beam_width", True),
        (RecommendSpec, "batch_size", "64"),
        (RecommendSpec, "score", 1),
        (RecommendSpec, "max_candidates", False),
        (Execution, "actors", True),
        (Execution, "cpus_per_actor", "0.5"),
        (Execution, "progress", "no"),
        (RankingExecution, "rank_actors", 2.0),
        (RecommendSpec, "beam_widths.0", [True, 2]),
        (RecommendSpec, "beam_widths.1", [8, "16"]),  # named by itself, not as beam_width
        (Execution, "num_gpus", float("inf")),
        (Execution, "gpu_wait_s", float("nan")),
    ],
)
def test_a_spec_from_python_takes_numbers_and_switches_only_as_such(model, field, value):
    """The flags parse to their types; a Python caller's `beam_width=True` was taken as 1 without a word."""
    required = {"model": "/m", "users": "/u.parquet", "out": "/o"} if model is RecommendSpec else {}
    with pytest.raises(ValueError, match=rf"{field}\n"):
        model(**required, **{field.split(".")[0]: value})
    assert Execution(num_gpus=1, cpus_per_actor=1).num_gpus == 1.0  # an integer where a decimal is asked: taken


def test_numpy_scalars_are_taken_by_their_values():
    """As a request's fields are: a pipeline's settings often come out of an array."""
    spec = RecommendSpec(model="/m", users="/u", out="/o", beam_widths=list(np.array([8, 16])), score=np.bool_(True))
    assert (spec.beam_widths, spec.beam_width, spec.score) == ([8, 16], 16, True)
    assert type(spec.beam_width) is int
    execution = Execution(actors=np.int64(2), num_gpus=np.float32(0.5))
    assert (execution.actors, execution.num_gpus) == (2, 0.5)
    assert CacheConfig(name="users").with_dim(np.int64(8)).dim == 8
