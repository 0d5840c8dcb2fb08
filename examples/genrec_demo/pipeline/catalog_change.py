"""The catalog changing under the running app, over HTTP: items retired with `genrec catalog retire`, then added
back from their embeddings with `genrec catalog add`, each version deployed live (the retriever's `user_config`
`catalog`, as an operator's `serve deploy` would) and named in every answer (`catalog_version`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from genrec.errors import GenrecError
from genrec_demo.pipeline.client import post

RETIRED = 3  # the user's top retrieved movies taken out of the catalog, then added back


def show_catalog_change(app, model_dir: Path, item_vectors: dict[str, list[float]], user: dict, titles, out, latencies,
                        say) -> dict:  # fmt: skip
    """Retire the user's top retrieved movies, serve that version, add them back, serve that: what each answer
    was and which version gave it. Ends serving the model's own catalog again."""
    versions = out / "catalogs"
    versions.mkdir(parents=True, exist_ok=True)
    retrieve = {**user, "beam_width": 50, "num_results": 5}
    before = post(app.url, "retrieve", retrieve, latencies)
    top = [item["item_id"] for item in before["items"][:RETIRED]]
    say(f"\ncatalog {before['catalog_version']}: retrieve gives " + _shown(before, titles))

    retired = _genrec("catalog", "retire", model_dir, "--items", ",".join(top))  # model_dir/genrec/catalog-<hash>
    names = "; ".join(titles[i] for i in top)
    say(f"genrec catalog retire: {RETIRED} movies out ({names}) -> catalog {retired['catalog_version']}")
    after_retire = _serve(app, Path(retired["catalog"]), retired["catalog_version"], retrieve, latencies)
    if set(top) & {item["item_id"] for item in after_retire["items"]}:
        raise GenrecError("a retired item was retrieved")  # the decode is constrained to the catalog served
    say(f"catalog {after_retire['catalog_version']} (deployed live): retrieve gives " + _shown(after_retire, titles))

    embeddings = versions / "returning.parquet"
    pq.write_table(pa.table({"item_id": top, "embedding": [item_vectors[i] for i in top]}), embeddings)
    added = _genrec("catalog", "add", model_dir, embeddings, "--catalog", retired["catalog"])
    say(f"genrec catalog add: the {RETIRED} back from their SVD factors -> catalog {added['catalog_version']}")
    back = _serve(app, Path(added["catalog"]), added["catalog_version"], retrieve, latencies)
    say(f"catalog {back['catalog_version']} (deployed live): retrieve gives " + _shown(back, titles))
    same = [i["item_id"] for i in back["items"]] == [i["item_id"] for i in before["items"]]
    say("  the same movies as before the change" if same else "  (the order moved: a code changed)")
    app.deploy_catalog(None)  # the model's own catalog again, for the batch job's comparison
    versions = [before["catalog_version"], retired["catalog_version"], added["catalog_version"]]
    return {"retired": top, "versions": versions, "same_after_adding_back": same}


def _genrec(*args) -> dict:
    """A `genrec` command as an operator runs it: its one line of JSON."""
    done = subprocess.run([sys.executable, "-m", "genrec.cli", *map(str, args)], capture_output=True, text=True)
    if done.returncode:
        raise GenrecError(f"genrec {' '.join(map(str, args[:2]))}: {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _serve(app, catalog: Path, version: str, retrieve: dict, latencies, timeout_s: float = 120.0) -> dict:
    """Deploy the catalog and wait for every replica to serve it (GET /v1/model); then the user's retrieve."""
    app.deploy_catalog(catalog)
    deadline = time.monotonic() + timeout_s
    while not _all_serve(app.url, version):
        if time.monotonic() > deadline:
            raise GenrecError(f"the replicas did not load catalog {version} within {timeout_s:.0f} s")
        time.sleep(0.5)
    return post(app.url, "retrieve", retrieve, latencies)


def _all_serve(url: str, version: str) -> bool:
    with urllib.request.urlopen(f"{url}/v1/model", timeout=30) as response:
        model = json.loads(response.read())
    replicas = model.get("replicas") or [model]
    return all(r.get("catalog_version") == version for r in replicas)


def _shown(answer: dict, titles) -> str:
    return "; ".join(titles[i["item_id"]] for i in answer["items"])
