"""The demo's closing table: quality against the popularity baseline, then latencies and where things are."""

from __future__ import annotations


def quality_table(table: dict[str, dict[str, float]], k: int = 10) -> str:
    base = table["popularity"]
    mrr_name = next(name for name in base if name.startswith("mrr@"))
    header = f"{'method':<12} {'Recall@' + str(k):>10} {'NDCG@' + str(k):>9} {mrr_name.upper():>8} {'x popularity':>13}"
    lines = [header]
    for method, row in table.items():
        recall, ndcg = row[f"recall@{k}"], row[f"ndcg@{k}"]
        ratio = f"{recall / base[f'recall@{k}']:.2f}x" if base[f"recall@{k}"] else "n/a"
        lines.append(f"{method:<12} {recall:>10.4f} {ndcg:>9.4f} {row[mrr_name]:>8.4f} {ratio:>13}")
    return "\n".join(lines)


def key_values(title: str, rows: dict[str, object]) -> str:
    width = max(map(len, rows), default=0)
    return "\n".join([title, *(f"  {name:<{width}}  {value}" for name, value in rows.items())])
