"""Where each engine replica says what it serves, so GET /v1/model can show every replica's catalog version: a
Serve handle cannot list replicas, so each reports to one small actor per app, `ReplicaBoard`, on a change and every
`REPORT_EVERY_S` (left out after `STALE_S`; nothing on the board matters across its loss). The board lags a death;
the UserRouter knows at once and publishes it to its process (`publish_live`, read through `live_replicas`).

The board is detached (it outlives any one replica), so it ends itself once no replica has reported for
`IDLE_EXIT_S`: its app was deleted or scaled to zero. The next replica to report, or reader, makes a new one.
"""

from __future__ import annotations

import threading
import time

import ray

REPORT_EVERY_S = 5.0
STALE_S = 3 * REPORT_EVERY_S
IDLE_EXIT_S = 12 * REPORT_EVERY_S

# (app, deployment) -> the unique IDs of its running replicas, as this process's UserRouter of it last knew them.
_LIVE: dict[tuple[str, str], frozenset[str]] = {}


def publish_live(app: str, deployment: str, replica_ids: frozenset[str]) -> None:
    _LIVE[(app, deployment)] = replica_ids


def live_replicas(app: str, deployment: str) -> frozenset[str] | None:
    """The deployment's running replicas as this process's UserRouter knows them; None: no UserRouter of it here."""
    return _LIVE.get((app, deployment))


@ray.remote(num_cpus=0, max_restarts=-1)
class ReplicaBoard:
    def __init__(self, idle_exit_s: float = IDLE_EXIT_S):
        self._seen: dict[tuple[str, str], tuple[dict, float]] = {}
        self._last_report = time.monotonic()
        threading.Thread(target=self._end_when_idle, args=(idle_exit_s,), daemon=True).start()

    def report(self, deployment: str, replica: str, state: dict) -> None:
        self._last_report = time.monotonic()
        self._seen[(deployment, replica)] = (state, self._last_report)

    def replicas(self, deployment: str) -> list[dict]:
        """The deployment's replicas heard from lately, by replica ID: {"replica": ID, **state}."""
        now = time.monotonic()
        for key in [k for k, (_, at) in self._seen.items() if now - at > STALE_S]:
            del self._seen[key]
        return [{"replica": r, **state} for (d, r), (state, _) in sorted(self._seen.items()) if d == deployment]

    def _end_when_idle(self, idle_exit_s: float) -> None:
        """Killed without a restart (an exit would count as a failure and restart it): a detached actor per deleted
        app would otherwise idle on the cluster for good, a worker process each."""
        while (idle := time.monotonic() - self._last_report) < idle_exit_s:
            time.sleep(idle_exit_s - idle)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def board(app_name: str, idle_exit_s: float = IDLE_EXIT_S):
    """The app's board, made by whichever replica or reader asks first (detached: it outlives any one replica)."""
    return ReplicaBoard.options(
        name=f"genrec-replicas-{app_name}", namespace="serve", lifetime="detached", get_if_exists=True
    ).remote(idle_exit_s)
