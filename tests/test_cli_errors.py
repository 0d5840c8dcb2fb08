"""Bad command-line input ends in exit code 2 and a clear message, never a traceback or a hang."""

import contextlib
import json
import signal

import pytest
import torch

from genrec.cli import main


@contextlib.contextmanager
def deadline(seconds=60):
    """Fail, rather than hang the suite, if the block does not finish in time."""

    def hung(signum, frame):
        raise AssertionError(f"did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_main(monkeypatch, capsys, *argv) -> str:
    """`genrec ARGV` through its entry point `main`; returns stderr after asserting exit code 2, no traceback."""
    monkeypatch.setenv("COLUMNS", "200")  # typer's usage box: one line per message
    monkeypatch.setattr("sys.argv", ["genrec", *map(str, argv)])
    with deadline(), pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "rates, fragment",
    [("-5", "rate -5.0"), ("0", "rate 0.0"), ("1,nan", "rate nan"), ("1,abc", "'1,abc'"), (",", "empty")],
)
def test_bench_load_bad_rates(tiny_dir, monkeypatch, capsys, rates, fragment):
    """`--rates -5` used to hang forever: the Poisson clock ran backwards."""
    err = run_main(monkeypatch, capsys, "bench", "load", "--model", tiny_dir, f"--rates={rates}")
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1


def test_load_benchmark_refuses_a_rate_that_never_advances(tiny_dir):
    """The library entry too (the suite and `bench serve` call it without the CLI's parsing)."""
    from genrec_bench.cli import LoadOptions
    from genrec_bench.load import run

    with deadline(), pytest.raises(ValueError, match="rate -5.0: offered loads must be positive"):
        run(LoadOptions(rates="-5", duration=0.5, model=tiny_dir, prompt_len=8, beam_width=2, candidates=4, burst=1))


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["bench", "cache", "--keys", "0"], "Invalid value for '--keys'"),
        (["bench", "retrieve", "--beam-width", "0"], "Invalid value for '--beam-width'"),
        (["bench", "score", "--repeats", "0"], "Invalid value for '--repeats'"),
        (["tiny-model", "OUT", "--levels", "30"], "levels must be at most 26"),
        (["tiny-model", "OUT", "--user-dim", "-1"], "user_dim must be at least 0, not -1"),
        (["tiny-model", "OUT", "--heads", "3"], "heads (3) must be a multiple of kv_heads (2)"),
        (["bench", "retrieve", "--model", "MODEL", "--levels", "9"], "--levels sets the code length of a preset"),
        (["bench", "retrieve", "--beam-widths", "4,x"], "--beam-widths '4,x': give comma-separated integers"),
        (["bench", "retrieve", "--beam-widths", "0,30"], "every width must be at least 1"),
        (["bench", "retrieve", "--beam-widths", "4,8"], "it must end with --beam-width (30)"),
        (["bench", "retrieve", "--model", "MODEL", "--beam-widths", "4,30"], "--beam-widths has 2 widths"),
        (["bench", "score", "--model", "MODEL", "--device", "gpu"], "--device 'gpu' is not a device name"),
    ],
)
def test_bad_option_is_exit_2_with_the_option_named(tiny_dir, tmp_path, monkeypatch, capsys, argv, fragment):
    out = tmp_path / "out"
    argv = [out if a == "OUT" else tiny_dir if a == "MODEL" else a for a in argv]
    assert fragment in run_main(monkeypatch, capsys, *argv)
    assert not out.exists()  # refused before anything is written


@pytest.mark.parametrize("command", ["retrieve", "score", "load", "suite"])
def test_device_this_machine_lacks_is_refused_before_loading(tiny_dir, monkeypatch, capsys, command):
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU; on a CPU machine, any CUDA device
    model = ["--model", str(tiny_dir)] if command != "suite" else []
    err = run_main(monkeypatch, capsys, "bench", command, *model, "--device", missing)
    expected = "CUDA is not available" if not torch.cuda.is_available() else "CUDA device(s)"
    assert err.startswith(f"error: --device {missing}: ") and expected in err


def test_tiny_model_does_not_overwrite_without_force(tmp_path, monkeypatch, capsys):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (target / "keep.txt").write_text("mine")
    args = ["tiny-model", target, "--items", "20", "--levels", "2", "--codebook", "8", "--user-dim", "0"]
    assert "pass --force to replace it" in run_main(monkeypatch, capsys, *args)
    assert (target / "keep.txt").read_text() == "mine"

    monkeypatch.setattr("sys.argv", ["genrec", *map(str, args), "--force"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 0
    assert not (target / "keep.txt").exists()  # replaced whole: no stale file of the old model is left
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 2


def test_force_never_deletes_a_directory_that_is_not_a_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("precious")
    err = run_main(monkeypatch, capsys, "tiny-model", tmp_path, "--items", "20", "--levels", "2", "--force")
    assert "not a model directory" in err and (tmp_path / "notes.txt").read_text() == "precious"


@pytest.fixture
def own_model(tiny_dir, tmp_path):
    """A copy of the tiny model these tests may write catalog versions into."""
    import shutil

    shutil.copytree(tiny_dir, tmp_path / "model")
    return tmp_path / "model"


def test_catalog_changes_refuse_bad_paths_in_one_line(own_model, tmp_path, monkeypatch, capsys):
    """A comma list longer than a file name (it used to be tried as a path first), --out naming a folder, --out an
    existing file without --in-place, both or neither of --items / --items-file."""
    ids = [f"item-{i:06d}" for i in range(40)]
    long_list = ",".join(ids[:30] + ["nope"])
    assert len(long_list) > 255
    cases = [
        (["--items", long_list], "--items: item 'nope' is not in the catalog (1 of 31)"),
        (["--items", ids[0], "--out", tmp_path], f"--out {tmp_path}: is a directory"),
        (["--items", ids[0], "--out", own_model / "genrec" / "catalog.parquet"], "rewritten in place only with"),
        (["--items", ids[0], "--items-file", tmp_path / "ids.txt"], "--items A,B,... or --items-file FILE"),
        ([], "--items A,B,... or --items-file FILE"),
        (["--items-file", tmp_path / "nope.txt"], "nope.txt: no such file"),
    ]
    before = sorted(p.name for p in (own_model / "genrec").iterdir())
    for argv, fragment in cases:
        err = run_main(monkeypatch, capsys, "catalog", "retire", own_model, *argv)
        assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err
    assert sorted(p.name for p in (own_model / "genrec").iterdir()) == before  # nothing written


@pytest.mark.parametrize("name", ["deep.index.json", "deep.jsonl"])
def test_import_of_deeply_nested_json_is_one_line(own_model, tmp_path, monkeypatch, capsys, name):
    depth = 200_000  # past Python's recursion limit in json's decoder
    nested = "[" * depth + "]" * depth
    source = tmp_path / name
    source.write_text(f'{{"0": {nested}}}' if name.endswith(".index.json") else f'{{"item_id": "a", "x": {nested}}}\n')
    err = run_main(monkeypatch, capsys, "catalog", "import", own_model, source)
    assert err.startswith(f"error: {source}: ") and "nested too deeply" in err and err.count("\n") == 1


def test_import_refuses_to_replace_a_trained_catalog_in_one_line(own_model, monkeypatch, capsys):
    from genrec.catalog_tools.codebooks import Codebooks

    codebooks = Codebooks(1.0, (torch.zeros(8, 3), torch.zeros(8, 3)), 8)  # TINY: 3 levels of 8 codes
    codebooks.save(own_model / "genrec" / "codebooks.safetensors")
    catalog = own_model / "genrec" / "catalog.parquet"
    before = catalog.read_bytes()
    err = run_main(monkeypatch, capsys, "catalog", "import", own_model, catalog, "--in-place")
    assert err.startswith(f"error: {catalog}: a trained catalog") and "--force" in err and err.count("\n") == 1
    assert catalog.read_bytes() == before and (own_model / "genrec" / "codebooks.safetensors").is_file()


def test_bad_files_for_build_ids_and_prompt_are_one_line_naming_the_file(own_model, tmp_path, monkeypatch, capsys):
    """Found by a careless-operator probe: an embedding column of scalars or strings, item IDs that are not UTF-8, a
    folder or broken JSON as --messages, and messages missing a field each gave a traceback or a line naming
    nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    scalars, strings, not_utf8 = (tmp_path / f"{n}.parquet" for n in ("scalars", "strings", "not_utf8"))
    pq.write_table(pa.table({"item_id": ["a", "b"], "embedding": [0.5, 1.5]}), scalars)
    pq.write_table(pa.table({"item_id": ["a", "b"], "embedding": ["x", "y"]}), strings)
    pq.write_table(pa.table({"item_id": pa.array([b"\xff", b"b"], pa.binary()).cast(pa.string(), safe=False),
                             "embedding": [[1.0, 2.0], [3.0, 4.0]]}), not_utf8)  # fmt: skip
    broken, missing = tmp_path / "broken.json", tmp_path / "missing.json"
    broken.write_text("[{role")
    missing.write_text('[{"role": "user"}]')
    out = tmp_path / "apart" / "c.parquet"
    cases = [
        (["build-ids", scalars, "--model", own_model, "--out", out], "column 'embedding' must be a list of numbers"),
        (["build-ids", strings, "--model", own_model, "--out", out], "per item, not string"),
        (["build-ids", not_utf8, "--model", own_model, "--out", out], "column 'item_id' holds text that is not UTF-8"),
        (["prompt", own_model, "--messages", own_model], f"--messages {own_model}: not a JSON file"),
        (["prompt", own_model, "--messages", broken], f"--messages {broken}: not a JSON file"),
        (["prompt", own_model, "--messages", missing], "messages[0].content: is required"),
    ]
    for argv, fragment in cases:
        err = run_main(monkeypatch, capsys, *argv)
        assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, (argv, err)
    assert not out.parent.exists()
