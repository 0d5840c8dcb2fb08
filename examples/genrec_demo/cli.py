"""`python -m genrec_demo [--seed S] [--retrain] ...` (what `make demo` runs): the demo's command line."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import typer

from genrec.errors import GenrecError
from genrec_demo.config import DemoConfig
from genrec_demo.ranker.config import RankerConfig

DEMO_STEPS = DemoConfig().max_steps
RANKER_STEPS = RankerConfig().steps

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def demo(
    out: Path = typer.Option(Path("out/demo"), help="where the plot, the metrics and the batch output go"),
    model_dir: Path = typer.Option(Path("out/demo-model"), help="the trained retriever (deployments/local.yaml's)"),
    ranker_dir: Path = typer.Option(Path("out/demo-ranker"), help="the trained HSTU ranker (funnel-local.yaml's)"),
    retrain: bool = typer.Option(False, "--retrain", help="train again even if a model of this recipe exists"),
    seed: int = typer.Option(0, help="training seed (reported with the figures)"),
    budget_s: float = typer.Option(
        None, min=1.0, help="train for this many CPU-seconds of one thread instead of --steps (not reproducible)"
    ),
    users: int = typer.Option(None, min=1, help="only the first N users (a quick look; figures are noisier)"),
    steps: int = typer.Option(DEMO_STEPS, min=1, help="training steps (the same model on any machine)"),
    ranker_steps: int = typer.Option(RANKER_STEPS, min=1, help="the HSTU ranker's training steps"),
    port: int = typer.Option(
        None, min=0, max=65535, help="HTTP port (default: the Serve config's, or a free one if taken)"
    ),
):
    """MovieLens-100k on the whole platform: train (or reuse) a model, load user embeddings into the cache,
    serve it on a local Ray and query it over HTTP, run the batch job over all users, measure it against
    most-popular."""
    from genrec_demo.pipeline.cluster import port_or_free
    from genrec_demo.pipeline.folders import checked_folders
    from genrec_demo.pipeline.run import run_demo

    if budget_s is not None and not math.isfinite(budget_s):
        raise typer.BadParameter("give a finite number of CPU-seconds", param_hint="--budget-s")
    if port:
        port_or_free(port, chosen=True)  # taken now: refused before training (and again when Serve starts)
    checked_folders(out, model_dir, ranker_dir)
    by_budget = {"max_steps": None, "budget_cpu_s": budget_s} if budget_s is not None else {"max_steps": steps}
    cfg = DemoConfig(seed=seed, users=users, **by_budget)
    try:
        ranker = RankerConfig(seed=seed, steps=ranker_steps)
        run_demo(out, model_dir, cfg, retrain, ranker_dir, ranker, port=port, say=typer.echo)
    except KeyboardInterrupt:
        typer.echo("interrupted: the demo's Serve app, jobs and Ray are stopped", err=True)
        raise typer.Exit(130) from None


def main() -> None:
    try:
        app(prog_name="python -m genrec_demo")
    except (GenrecError, ValueError, OSError) as err:  # bad input: one clear line, no traceback
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
