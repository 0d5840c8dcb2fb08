"""Recall@K curves of the model (retrieve, recommend) against the most-popular baseline, as a PNG."""

from __future__ import annotations

from pathlib import Path

from genrec.errors import GenrecError
from genrec_demo.evaluate import Evaluation

LABELS = {
    "retrieve": "genrec retrieve (beam search)",
    "recommend": "genrec recommend (retrieve, then score)",
    "ranker": "genrec funnel (retrieve, then the HSTU ranker)",
    "popularity": "most popular (unseen)",
}


def plot_recall(evaluation: Evaluation, path: Path, title: str) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GenrecError("the recall plot needs matplotlib: pip install matplotlib") from None
    ks = range(1, evaluation.depth + 1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in evaluation.ranks:
        ax.plot(ks, evaluation.recall_curve(method), label=LABELS.get(method, method))
    ax.axvline(10, color="grey", linewidth=0.8, linestyle=":")
    ax.set(xlabel="K", ylabel="Recall@K (held-out last item)", title=title, xlim=(1, evaluation.depth), ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
