"""The job scripts' command lines, derived from the settings' fields (genrec.batch.spec): each field is a flag
(`--kebab-case`, its description as help; a bool a switch, `--no-NAME` when it defaults to true; a Literal's values
the choices; a nested model `--cache NAME --cache-shards N`). Flags left out are left out of the settings, so the
defaults live in one place. Bad input is one `error:` line naming the flag, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Callable

from pydantic import BaseModel, Field, ValidationError

from genrec.batch.pipeline import run
from genrec.batch.spec import with_absolute_store
from genrec.cache.config import CacheConfig
from genrec.errors import GenrecError

NOT_FLAGS = ("device", "dim")  # the engine's device follows --num-gpus; a cache's width is the model's


def main(doc: str, *variants: tuple[type[BaseModel], ...]) -> None:
    """A job script. `variants`: (spec, execution...), narrowest first; the flags given pick the first that has all."""
    run_job(lambda: run_command(doc, variants, sys.argv[1:]))


def run_command(doc: str, variants: tuple[tuple[type[BaseModel], ...], ...], argv: list[str]) -> int:
    """Run the job `argv` asks for; print its summary line; 1 when bad rows pass the allowed fraction, else 0."""
    spec, runs = parse(variants, argv, doc)
    summary = run(spec, *runs)
    print(summary.line(), flush=True)
    return 1 if summary.failed(runs[0].max_error_fraction) else 0


def parse(variants: tuple[tuple[type[BaseModel], ...], ...], argv: list[str], doc: str | None = None) -> tuple:
    """The spec and the settings of how it executes that `argv` gives."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    required = {name for name, field in variants[0][0].model_fields.items() if field.is_required()}
    for model in variants[-1]:
        add_flags(parser, model, required)
    given = vars(parser.parse_args(argv))
    spec_type, *how = chosen = next(v for v in variants if given.keys() <= _names(v))
    missing = [name for name, field in spec_type.model_fields.items() if field.is_required() and name not in given]
    if missing and chosen is not variants[0]:  # e.g. --rank-actors without --ranker
        extra = next(name for name in given if name not in _names(variants[0]))
        raise GenrecError(f"{_flag((extra,))} applies to {spec_type.applies_to}: give {_flag((missing[0],))} too")
    runs = [model(**settings(given, model)) for model in how]
    return spec_type(**settings(given, spec_type), device="cuda" if runs[0].num_gpus > 0 else "cpu"), runs


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], required=()) -> None:
    """A flag per field of `model` (`required`: the dests argparse requires)."""
    for path, field, about in _fields(model):
        shown = not field.is_required() and field.default is not None and not isinstance(field.default, bool)
        text = ("no " if field.default is True else "") + (about or "") + (f" (default: {field.default})" * shown)
        parser.add_argument(
            f"--no-{_flag(path)[2:]}" if field.default is True else _flag(path),
            dest=_dest(path),
            default=argparse.SUPPRESS,
            required=_dest(path) in required,
            help=text.replace("%", "%%") or None,
            **({"metavar": "NAME"} if path[1:] == ("name",) else {}),
            **_kind(field),
        )


def settings(given: dict, model: type[BaseModel]) -> dict:
    """The fields of `model` among the flags `given` (dest -> value); a nested model's as a dict of its own."""
    out: dict = {}
    for path, _, _ in _fields(model):
        if _dest(path) in given:
            inner = out
            for part in path[:-1]:
                inner = inner.setdefault(part, {})
            inner[path[-1]] = given[_dest(path)]
    return out


def add_cache_flags(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """The embedding cache's flags (`--cache NAME`, `--cache-*`), as the recommend job has them."""
    add_flags(parser, _CacheFlags, {"cache"} if required else ())


class _CacheFlags(BaseModel):
    cache: CacheConfig = Field(description="the embedding cache's name")  # an error's location gives its flag


def cache_config(args: argparse.Namespace) -> CacheConfig | None:
    given = settings(vars(args), _CacheFlags)
    if not given:
        return None
    return with_absolute_store(_CacheFlags(**given).cache)


def run_job(main: Callable[[], int]) -> None:
    """Exit with main's status; bad input (a missing file, invalid settings or data) exits 2 with one line."""
    try:
        status = main()
    except (GenrecError, ValueError, FileNotFoundError) as err:  # ValueError: pydantic's and load_parquet's
        print(f"error: {_one_line(err)}", file=sys.stderr)
        status = 2
    sys.exit(status)


def _fields(model: type[BaseModel], path: tuple = (), about: str | None = None):
    """(path, field, help) of each flag; a nested model's `name` is the flag of the name alone (`--cache`)."""
    for name, field in model.model_fields.items():
        nested = typing.get_args(field.annotation)[:1] or (field.annotation,)
        if name in NOT_FLAGS:
            continue
        if isinstance(nested[0], type) and issubclass(nested[0], BaseModel):
            yield from _fields(nested[0], (*path, name), field.description)
        else:
            yield (*path, name), field, about if path and name == "name" else field.description


def _names(variant: tuple[type[BaseModel], ...]) -> set[str]:
    """The dests of a variant's flags."""
    return {_dest(path) for model in variant for path, _, _ in _fields(model)}


def _dest(path: tuple) -> str:
    return _flag(path)[2:].replace("-", "_")


def _kind(field) -> dict:
    """argparse's action, type or choices for a field."""
    annotation = field.annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    while typing.get_origin(annotation) is typing.Annotated:  # genrec.api's Int, Float, Switch
        annotation = typing.get_args(annotation)[0]
    if annotation is bool:
        if field.default is None:  # on, off, or derived (e.g. --cuda-fast / --no-cuda-fast, default: by the device)
            return {"action": argparse.BooleanOptionalAction}
        return {"action": "store_false" if field.default is True else "store_true"}
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": typing.get_args(annotation)}
    if typing.get_origin(annotation) is list:  # e.g. --beam-widths 32,128,256; the spec checks the values
        return {"type": _comma_ints, "metavar": "N,N,..."}
    return {"type": annotation}


def _comma_ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 32,128,256") from None


def _one_line(err: Exception) -> str:
    if not isinstance(err, ValidationError):
        return " ".join(str(err).split())
    parts = []
    for problem in err.errors():
        message = problem["msg"].removeprefix("Value error, ")
        flag = _flag(problem["loc"])
        parts.append(f"{flag}: {message}" if flag else message)
    return "; ".join(parts)


def _flag(loc: tuple) -> str | None:
    """The flag of a field: `beam_width` -> --beam-width, `cache.capacity` -> --cache-capacity."""
    names = [str(part) for part in loc if not isinstance(part, int)]
    if not names:
        return None
    flag = "--" + "-".join(names).replace("_", "-")
    return "--cache" if flag == "--cache-name" else flag
