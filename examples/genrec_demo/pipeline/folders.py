"""The demo's three folders, checked before anything trains: `--out` is the demo's own (it deletes its `batch/`
and its cache store there on each run), the two model folders are apart, and all three can be written."""

from __future__ import annotations

from pathlib import Path

from genrec.errors import GenrecError

OUT_MARK = ".genrec-demo"  # in an --out the demo made: its files there are its own to replace
LEGACY_OUT = ("metrics.json", "users.parquet", "user_embeddings.parquet")  # an --out from before the mark


def checked_folders(out: Path, model_dir: Path, ranker_dir: Path) -> None:
    """Refuse, one line naming the option, before any training: a file where a folder goes, one folder for both
    models, an --out that holds files the demo did not write, a folder that cannot be made."""
    named = {"--out": out, "--model-dir": model_dir, "--ranker-dir": ranker_dir}
    for option, path in named.items():
        if path.exists() and not path.is_dir():
            raise GenrecError(f"{option} {path}: is a file; name a folder")
    if model_dir.resolve() == ranker_dir.resolve():
        raise GenrecError(f"--ranker-dir {ranker_dir}: the same folder as --model-dir; each model needs its own")
    if out.is_dir() and any(out.iterdir()) and not is_demo_out(out):
        raise GenrecError(
            f"--out {out}: holds files the demo did not write (it replaces its batch/ and its cache store there); "
            "name a new or empty folder"
        )
    for option, path in named.items():
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise GenrecError(f"{option} {path}: cannot be made ({err.strerror})") from None
    try:
        (out / OUT_MARK).touch()
    except OSError as err:
        raise GenrecError(f"--out {out}: cannot be written ({err.strerror})") from None


def is_demo_out(out: Path) -> bool:
    return (out / OUT_MARK).is_file() or all((out / name).is_file() for name in LEGACY_OUT)
