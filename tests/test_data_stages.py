"""genrec.data's stages as a caller builds them (no Ray): their settings refused with the setting's name, a dataset
without the columns the stage reads refused in one line, and the output's one schema for results and error rows.
The stages in a running pipeline: tests/test_batch.py, test_batch_funnel.py and test_batch_rank.py, beside the
jobs they must equal."""

import pyarrow as pa
import pytest
from pydantic import ValidationError

import genrec.data
from genrec.batch.shards import InputLayout
from genrec.batch.tables import RowError
from genrec.data.worker import _users, with_error_rows
from genrec.errors import GenrecError, ModelDirectoryError


def test_a_setting_of_a_jobs_driver_is_refused_naming_it(tiny_dir):
    with pytest.raises(GenrecError, match="max_error_fraction applies to the batch jobs"):
        genrec.data.Recommend(str(tiny_dir), max_error_fraction=0.5)


def test_a_misspelt_setting_is_refused_naming_it(tiny_dir):
    with pytest.raises(ValidationError, match="beam_wdth"):
        genrec.data.Recommend(str(tiny_dir), beam_wdth=8)
    with pytest.raises(GenrecError, match="batch_size"):
        genrec.data.Recommend(str(tiny_dir), batch_size=0)


def test_the_other_familys_model_is_refused_before_any_work(tiny_dir, hstu_dir):
    with pytest.raises(ModelDirectoryError, match="HSTU"):
        genrec.data.Recommend(str(hstu_dir))
    with pytest.raises(ModelDirectoryError, match="not an HSTU"):
        genrec.data.Rank(str(tiny_dir))


def test_a_dataset_without_a_column_the_stage_reads_fails_in_one_line_naming_it():
    layout = InputLayout(required=(("prompt", "prompt_token_ids"),), optional=("filters",))
    with pytest.raises(GenrecError, match="'prompt' or 'prompt_token_ids'"):
        _users(pa.table({"user_id": ["a"], "text": ["x"]}), layout)
    with pytest.raises(GenrecError, match="no column 'user_id'"):
        _users(pa.table({"prompt": ["x"]}), layout)
    with pytest.raises(GenrecError, match="integers or strings"):
        _users(pa.table({"user_id": [1.5], "prompt": ["x"]}), layout)
    kept = _users(pa.table({"user_id": [1], "prompt": ["x"], "mine": [2]}), layout)
    assert kept.column_names == ["user_id", "prompt"]
    unnamed = pa.table({"user_id": pa.nulls(2), "prompt": ["x", "y"]})  # no user_id in a batch: its rows' errors
    assert _users(unnamed, layout).num_rows == 2


def test_results_and_error_rows_share_one_schema_in_every_batch():
    results = pa.table({"user_id": pa.array(["a", "a"]), "rank": pa.array([1, 2], pa.int32()), "item_id": ["x", "y"]})
    user_ids = pa.array(["a", "b", None])
    errors = [RowError(1, "prompt", "is empty"), RowError(2, "user_id", "is null")]
    mixed = with_error_rows(results, user_ids, errors, {"item_id": "stamp"})
    only_errors = with_error_rows(results.slice(0, 0), user_ids, [RowError(1, "prompt", "is empty")])
    assert mixed.schema == only_errors.schema == with_error_rows(results, user_ids, []).schema
    assert mixed.column("error_field").to_pylist() == [None, None, "prompt", "user_id"]
    assert mixed.column("user_id").to_pylist() == ["a", "a", "b", None]
    assert mixed.column("item_id").to_pylist()[2:] == ["stamp", "stamp"]
    assert mixed.column("rank").to_pylist()[2:] == [None, None]
