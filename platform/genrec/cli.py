"""`genrec ...` commands: tiny-model, build-ids, model-version, prompt, deploy, bench, catalog."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click
import typer
from typer.core import TyperGroup

from genrec.errors import GenrecError

BENCH_MISSING = (
    "genrec bench: the benchmarks are their own package, genrec_bench, and it is not installed here. From a source "
    "checkout, `pip install -e .` installs it beside genrec (`pip install -e '.[bench]'` adds matplotlib for --plot), "
    "or put the checkout's platform/ on PYTHONPATH."
)


class _Commands(TyperGroup):
    """`bench` is looked up when asked for: the benchmarks are a package of their own that an install may lack."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), "bench"]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return _bench_command() if name == "bench" else super().get_command(ctx, name)


@functools.cache
def _bench_command() -> click.Command:
    try:
        from genrec_bench.cli import bench_app
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "genrec_bench":  # the package is there, something it needs is not
            raise
        return click.Command(
            "bench",
            callback=_bench_missing,
            help="Benchmarks (the genrec_bench package: not installed here).",
            params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
            context_settings={"ignore_unknown_options": True},
            add_help_option=False,
        )
    return typer.main.get_command(bench_app)


def _bench_missing(args) -> None:
    typer.echo(f"error: {BENCH_MISSING}", err=True)
    raise typer.Exit(1)


app = typer.Typer(
    cls=_Commands,
    help="genrec: generative recommendation with semantic IDs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
catalog_app = typer.Typer(help="The item catalog of a model directory.", no_args_is_help=True)
app.add_typer(catalog_app, name="catalog")


@app.command("tiny-model")
def tiny_model(
    out_dir: Path,
    items: int = typer.Option(500, help="catalog size"),
    levels: int = typer.Option(3, help="semantic-ID code length"),
    codebook: int = typer.Option(16, help="tokens per level"),
    user_dim: int = typer.Option(16, help="soft-token input dimension (0: no projector)"),
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    seed: int = 0,
    family: str = typer.Option("qwen3", help="qwen3 (semantic-ID retrieval) | hstu (ranking after a history)"),
    architecture: str = typer.Option("qwen3", help="qwen3 | qwen2 (q/k/v biases, no q/k norm): the decoder's"),
    force: bool = typer.Option(False, "--force", help="replace a model directory already at OUT_DIR"),
):
    """Write a complete model directory with random weights of the real architecture (Qwen3 or Qwen2, or HSTU)."""
    from genrec.testing.tiny import ModelSpec, make_room, write_model_dir

    if family not in ("qwen3", "hstu"):
        raise typer.BadParameter("--family must be qwen3 or hstu")
    if family == "hstu" and architecture != "qwen3":
        raise typer.BadParameter("--architecture is the qwen3 family's decoder; an HSTU model has none")
    if family == "hstu":
        from genrec.testing.tiny import HSTUSpec, write_hstu_dir

        make_room(out_dir, force)
        hstu = HSTUSpec(items=items, hidden=hidden, layers=layers, heads=heads, head_dim=head_dim, seed=seed)
        typer.echo(str(write_hstu_dir(out_dir, hstu)))
        return
    spec = ModelSpec(
        items=items,
        levels=levels,
        codebook=codebook,
        user_dim=user_dim,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        seed=seed,
        architecture=architecture,
    )
    make_room(out_dir, force)
    typer.echo(str(write_model_dir(out_dir, spec)))


@app.command("build-ids")
def build_ids(
    embeddings: Path = typer.Argument(..., help="Parquet with columns item_id, embedding (list<float>)"),
    model: Path = typer.Option(..., help="model directory whose tokenizer defines the semantic-ID tokens"),
    out: Path = typer.Option(None, help="catalog to write (default: MODEL/genrec/catalog.parquet)"),
    iters: int = typer.Option(20, min=1, help="k-means iterations per level"),
    seed: int = typer.Option(0, min=0),
):
    """Semantic IDs by residual k-means per level plus a last, disambiguating level; the codebooks that code a new
    item later (`genrec catalog add`) are written beside the catalog, as codebooks.safetensors. --out names a new
    file in a folder of its own (no other catalog's codebooks there); without it the model's catalog is rebuilt."""
    from genrec.catalog_tools.build_ids import build_catalog_and_codebooks, build_target, write_built
    from genrec.model.directory import ModelDir

    directory = ModelDir.open(model, family="qwen3")
    target = build_target(out, directory.catalog_path)
    catalog, codebooks = build_catalog_and_codebooks(embeddings, directory.load_sid_layout(), iters=iters, seed=seed)
    write_built(target, catalog.to_table(), codebooks)
    typer.echo(json.dumps({"items": len(catalog), "levels": catalog.levels, "catalog": str(target)}))


NEW_VERSION = (
    "Every change is a new file, written atomically: catalog-<hash12>.parquet beside the model's catalog (its name "
    "carries its content hash), or --out's. The JSON summary names it and its catalog_version: put the path in the "
    "Serve config's user_config `catalog` and deploy."
)
OUT_HELP = "the catalog file to write (default: MODEL_DIR/genrec/catalog-<hash12>.parquet, a new version)"
IN_PLACE_HELP = (
    "rewrite the catalog changed (or --out's file) in place, under a lock (a second run waits); replicas serving it "
    "load the new content within seconds"
)
IMPORT_HELP = f"""Read an item map into a catalog of MODEL_DIR, every code checked against
the model's tokenizer and SID layout (an error names the row and the item); prints a JSON summary. A model without a
catalog gets it as its own, MODEL_DIR/genrec/catalog.parquet. {NEW_VERSION} Replacing a trained catalog (build-ids'
codebooks beside it) needs --force, which deletes the codebooks."""
ADD_HELP = f"""Code new items from their embeddings with the codebooks build-ids kept
(nearest code level by level, then the first free last-level code under the prefix) and write the catalog with them
appended; the existing items keep their codes. {NEW_VERSION}"""
RETIRE_HELP = f"""Remove items from the catalog (their codes become free for `catalog add`).
{NEW_VERSION}"""
BASE_HELP = "the catalog version to change (default: MODEL_DIR/genrec/catalog.parquet)"


@catalog_app.command("import", help=IMPORT_HELP)
def catalog_import(
    model_dir: Path = typer.Argument(..., help="the model directory whose tokenizer the codes must fit"),
    source: Path = typer.Argument(..., help="pid2sid.parquet, *.index.json, a SID-GR *.jsonl, or a catalog.parquet"),
    fmt: str = typer.Option(None, "--format", help="pid2sid | index-json | jsonl | genrec (default: from the file)"),
    layout: str = typer.Option(
        None,
        "--layout",
        help="first write MODEL_DIR/genrec/sid_layout.json naming this preset (openonerec | minionerec | genrec), "
        "for a layout the token names do not tell (MiniOneRec: codes end with \\n then EOS)",
    ),
    out: Path = typer.Option(None, help=OUT_HELP),
    in_place: bool = typer.Option(False, "--in-place", help="replace MODEL_DIR/genrec/catalog.parquet (or --out's)"),
    force: bool = typer.Option(False, "--force", help="replace a trained catalog, deleting its codebooks"),
):
    from genrec.catalog_tools.importers import import_catalog

    summary = import_catalog(model_dir, source, fmt, out, layout_preset=layout, in_place=in_place, force=force)
    if summary.warning:
        typer.echo(f"warning: {summary.warning}", err=True)
    typer.echo(json.dumps(summary.as_dict()))


@catalog_app.command("add", help=ADD_HELP)
def catalog_add(
    model_dir: Path = typer.Argument(..., help="a model directory whose catalog `genrec build-ids` wrote"),
    items: Path = typer.Argument(..., help="Parquet with columns item_id, embedding (list<float>): the new items"),
    out: Path = typer.Option(None, help=OUT_HELP),
    catalog: Path = typer.Option(None, help=BASE_HELP),
    in_place: bool = typer.Option(False, "--in-place", help=IN_PLACE_HELP),
):
    from genrec.catalog_tools.changes import add_items

    typer.echo(json.dumps(add_items(model_dir, items, out, catalog, in_place).as_dict()))


@catalog_app.command("retire", help=RETIRE_HELP)
def catalog_retire(
    model_dir: Path = typer.Argument(..., help="the model directory"),
    items: str = typer.Option(None, "--items", help="item IDs, separated by commas"),
    items_file: Path = typer.Option(None, "--items-file", help="a file of item IDs: one a line, or Parquet (item_id)"),
    out: Path = typer.Option(None, help=OUT_HELP),
    catalog: Path = typer.Option(None, help=BASE_HELP),
    in_place: bool = typer.Option(False, "--in-place", help=IN_PLACE_HELP),
):
    from genrec.catalog_tools.changes import read_item_list, retire_items

    given = "--items" if items_file is None else f"--items-file {items_file}"
    retired = retire_items(model_dir, read_item_list(items, items_file), out, catalog, in_place, given)
    typer.echo(json.dumps(retired.as_dict()))


@app.command("model-version")
def model_version_command(model: Path = typer.Argument(..., help="model directory")):
    """Print the model's version and record its weights' digests in MODEL/genrec/digests.json, so replicas do
    not hash the weights at start (run it before the directory becomes read-only, e.g. in an image build)."""
    from genrec.model.directory import ModelDir

    typer.echo(ModelDir.open(model).version)


@app.command("prompt")
def prompt(
    model: Path = typer.Argument(..., help="model directory (a Qwen3 semantic-ID model)"),
    messages: Path = typer.Option(None, help="a JSON file of chat messages, [{role, content}, ...] ('-': stdin)"),
    text: str = typer.Option(None, help="the prompt as raw text"),
    token_ids: Path = typer.Option(None, help="a JSON file of token IDs, [1, 2, ...] ('-': stdin)"),
    show_tokens: bool = typer.Option(False, "--show-tokens", help="also each token ID's token, as `tokens`"),
):
    """Print the prompt as the engine would run it, as JSON (what POST /v1/prompt answers): its text (chat messages
    rendered by the model's template and genrec/prompt.json), token IDs, soft-token placeholders. Reads no weights."""
    from pydantic import ValidationError

    from genrec.api import PromptRequest, located_error
    from genrec.engine.request_tokens import render_prompt
    from genrec.model.directory import ModelDir
    from genrec.model.tokenizer import USER_TOKEN

    given = {"messages": messages, "prompt": text, "prompt_token_ids": token_ids}
    if sum(value is not None for value in given.values()) != 1:
        raise typer.BadParameter("give exactly one of --messages, --text, --token-ids")
    options = {"messages": "--messages", "prompt_token_ids": "--token-ids"}
    fields = {k: _json_file(v, options[k]) if isinstance(v, Path) else v for k, v in given.items() if v is not None}
    try:
        request = PromptRequest(**fields)
    except ValidationError as err:  # one line, genrec's words, the field named
        problems = (": ".join(filter(None, located_error(e, PromptRequest))) for e in err.errors())
        raise GenrecError("; ".join(problems)) from None
    directory = ModelDir.open(model, family="qwen3")
    tokenizer = directory.load_tokenizer()
    layout = directory.load_sid_layout(tokenizer)
    # As Retriever.max_prompt_tokens: room for the longest code, its ending and the begin token the engine may add.
    steps = directory.load_catalog(tokenizer, layout).levels + len(layout.ending) + (layout.begin is not None)
    room, vocab, placeholder = directory.config.prompt_room(steps), directory.config.vocab_size, tokenizer.get_vocab()
    chat = directory.load_chat(tokenizer)
    rendered = render_prompt(request, chat, vocab, room, placeholder.get(USER_TOKEN), layout.begin)
    shown = rendered.model_dump(exclude={"request_id"})
    if show_tokens:
        shown["tokens"] = tokenizer.convert_ids_to_tokens(rendered.token_ids)
    # one line per field (a list on one line): the text stays readable beside thousands of token IDs
    lines = [f"  {json.dumps(name)}: {json.dumps(value, ensure_ascii=False)}" for name, value in shown.items()]
    typer.echo("{\n" + ",\n".join(lines) + "\n}")


def _json_file(path: Path, option: str):
    """A JSON value from a file, or from stdin for '-'; a file that is not one is refused naming `option`."""
    try:
        return json.loads(sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # missing, a directory, unreadable, not UTF-8, not JSON
        raise GenrecError(f"{option} {path}: not a JSON file ({err})") from None


@app.command("deploy")
def deploy(
    config: Path = typer.Argument(..., help="a Serve config file (deployments/*.yaml)"),
    address: str = typer.Option(
        None, "--address", "-a", help="the Ray dashboard, http://<head>:8265 (default: serve deploy's)"
    ),
    check_model: bool = typer.Option(False, "--model", help="also check each app's model directory on this machine"),
    dashboard_timeout_s: float = typer.Option(
        10.0, "--dashboard-timeout-s", min=0.1, help="how long the dashboard has to answer before nothing is sent"
    ),
    catalog_arrives: bool = typer.Option(
        False,
        "--catalog-arrives",
        help="a catalog a user_config names that is missing here will be written after the deploy (its replicas "
        "serve it once it appears); otherwise a missing one is refused",
    ),
):
    """`serve deploy`, sent only if the config passes `genrec.serving.check` (Serve would accept a `user_config`
    that does not validate, or a catalog file no replica can load) and the dashboard answers: otherwise one `error:`
    line each, exit 2."""
    from genrec.serving.check import deploy as deploy_config

    raise typer.Exit(deploy_config(config, address, check_model, dashboard_timeout_s, catalog_arrives))


def main() -> None:
    try:
        app()
    except (GenrecError, ValueError, FileNotFoundError) as err:  # bad input: one clear line, no traceback
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
