"""The app's replica board (genrec.serving.replicas) on a real Ray: detached, so it must end itself once its app's
replicas stop reporting (the app deleted or scaled to zero), and a new one takes its name."""

import time

import pytest

from genrec.serving.replicas import board

pytestmark = pytest.mark.integration


def _alive(app: str) -> bool:
    import ray

    try:
        ray.get_actor(f"genrec-replicas-{app}", namespace="serve")
        return True
    except ValueError:
        return False


def test_a_board_lives_while_replicas_report_and_ends_once_they_stop(ray_cluster):
    app, idle_exit_s = "board-idle", 2.0
    first = board(app, idle_exit_s)
    for _ in range(8):  # 4 s of reports, twice the idle limit
        first.report.remote("EngineServer", "r1", {"catalog_version": "v1"})
        time.sleep(0.5)
    assert ray_cluster.get(first.replicas.remote("EngineServer")) == [{"replica": "r1", "catalog_version": "v1"}]
    deadline = time.monotonic() + 30
    while _alive(app):
        assert time.monotonic() < deadline, "the board outlived its replicas' reports"
        time.sleep(0.2)
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        ray_cluster.get(first.replicas.remote("EngineServer"), timeout=30)
    second = board(app, idle_exit_s)  # the next reporter makes a new, empty board under the same name
    assert ray_cluster.get(second.replicas.remote("EngineServer")) == []
    ray_cluster.kill(second, no_restart=True)
