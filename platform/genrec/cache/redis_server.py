"""A private redis-server on 127.0.0.1 and a free port, for benchmarks and tests (a real server)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


class LocalRedis:
    """`with LocalRedis() as url:` starts redis-server (installing it with apt when `install`), then stops it."""

    def __init__(self, install: bool = False):
        self.install = install
        self.server: subprocess.Popen | None = None
        self.workdir: str | None = None

    def __enter__(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None and self.install:
            subprocess.run(["apt-get", "update", "-q"], check=False, capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], check=True, capture_output=True)
            binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install it (apt-get install redis-server) or pass a URL")
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
