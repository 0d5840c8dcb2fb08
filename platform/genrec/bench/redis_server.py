"""A private redis-server on 127.0.0.1 and a free port, for `genrec bench cache` and the tests (a real server).

It only starts an installed redis-server; installing one is the caller's business (the tests' fixture does).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


class LocalRedis:
    """`with LocalRedis() as url:` starts redis-server, then stops it."""

    def __init__(self):
        self.server: subprocess.Popen | None = None
        self.workdir: str | None = None

    def __enter__(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server not found: install it (e.g. apt-get install redis-server) or pass --redis-url"
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.workdir = tempfile.mkdtemp(prefix="genrec-redis-")
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.server = subprocess.Popen(
            [*args, "--dir", self.workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            _wait_for(port)
        except BaseException:
            self.__exit__()
            raise
        return f"redis://127.0.0.1:{port}/0"

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(10)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_for(port: int, seconds: float = 10.0) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + seconds
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
