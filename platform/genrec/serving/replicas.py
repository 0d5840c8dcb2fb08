"""Where each engine replica says what it serves, so GET /v1/model can show every replica's catalog version: a
Serve handle cannot list replicas, so each reports to one small actor per app, `ReplicaBoard`, on a change and every
`REPORT_EVERY_S` (left out after `STALE_S`; nothing on the board matters across its loss). The board lags a death;
the UserRouter knows at once and publishes it to its process (`publish_live`, read through `live_replicas`).
"""

from __future__ import annotations

import time

import ray

REPORT_EVERY_S = 5.0
STALE_S = 3 * REPORT_EVERY_S

# (app, deployment) -> the unique IDs of its running replicas, as this process's UserRouter of it last knew them.
_LIVE: dict[tuple[str, str], frozenset[str]] = {}


def publish_live(app: str, deployment: str, replica_ids: frozenset[str]) -> None:
    _LIVE[(app, deployment)] = replica_ids


def live_replicas(app: str, deployment: str) -> frozenset[str] | None:
    """The deployment's running replicas as this process's UserRouter knows them; None: no UserRouter of it here."""
    return _LIVE.get((app, deployment))


@ray.remote(num_cpus=0, max_restarts=-1)
class ReplicaBoard:
    def __init__(self):
        self._seen: dict[tuple[str, str], tuple[dict, float]] = {}

    def report(self, deployment: str, replica: str, state: dict) -> None:
        self._seen[(deployment, replica)] = (state, time.monotonic())

    def replicas(self, deployment: str) -> list[dict]:
        """The deployment's replicas heard from lately, by replica ID: {"replica": ID, **state}."""
        now = time.monotonic()
        for key in [k for k, (_, at) in self._seen.items() if now - at > STALE_S]:
            del self._seen[key]
        return [{"replica": r, **state} for (d, r), (state, _) in sorted(self._seen.items()) if d == deployment]


def board(app_name: str):
    """The app's board, made by whichever replica asks first (detached: it outlives any one replica)."""
    return ReplicaBoard.options(
        name=f"genrec-replicas-{app_name}", namespace="serve", lifetime="detached", get_if_exists=True
    ).remote()
