"""`genrec bench batch` end to end on the tiny model (smoke only: the figures are not asserted)."""

import json

from typer.testing import CliRunner

from genrec.cli import app


def test_bench_batch(ray_cluster, tiny_dir, tmp_path):
    out = tmp_path / "report.json"
    args = ["bench", "batch", "--model", str(tiny_dir), "--users", "12", "--batch-size", "4", "--prompt-len", "16"]
    args += ["--beam-width", "4", "--actors", "1", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["ratios"]["ray_over_loop"] > 0 and report["ratios"]["ray_over_loop_steady"] > 0
    assert len(report["plain_loops"]) == 2  # one before and one after the job
    (job,) = report["ray_data"]
    assert job["actors"] == 1 and '"processed": 12' in job["summary"] and '"errors": 0' in job["summary"]
