"""A `ray start --head` cluster with its dashboard, as `ray job submit` and `serve deploy` talk to one, on ports and
a temp dir of its own (apart from the tests' session Ray, which runs without a dashboard); every process of it
ends with the block."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

RAY_BIN = str(Path(sys.executable).parent / "ray")


READY_PATHS = ("/api/version", "/api/serve/applications/")
HEAD_OUTPUT = "ray-start.out"  # in the cluster's temp dir


@contextlib.contextmanager
def dashboard_cluster(num_cpus: int = 2, attempts: int = 2):
    """Yields (dashboard address, the environment its clients run with). A head that exits while it starts is
    started once more, on new ports: a port chosen free may be taken before Ray binds it, and on a loaded machine
    `ray start --block` has exited while it started (CI-like clean clone 2026-12-07); its output says why."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    for attempt in range(1, attempts + 1):
        head, temp, address = _start_head(env, num_cpus)
        try:
            exited = _wait_until_ready(head, address)
        except BaseException:
            _remove(head, temp)
            raise
        if exited is None:
            break
        output = _output(temp)
        _remove(head, temp)
        assert attempt < attempts, f"ray start --head exited (rc {exited}), {attempts} times; its output:\n{output}"
    try:
        yield address, env
    finally:
        _remove(head, temp)


def _start_head(env: dict, num_cpus: int) -> tuple[subprocess.Popen, str, str]:
    gcs, dashboard, agent_http, agent_grpc, metrics, node_manager, objects, runtime_env, client = free_ports(9)
    temp = tempfile.mkdtemp(prefix="gr-", dir="/tmp")  # short: Ray's socket paths live under it
    head_cmd = [RAY_BIN, "start", "--head", "--block", f"--num-cpus={num_cpus}", "--disable-usage-stats"]
    head_cmd += [f"--temp-dir={temp}", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}"]
    head_cmd += [f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}"]
    head_cmd += [f"--metrics-export-port={metrics}", f"--node-manager-port={node_manager}"]
    head_cmd += [f"--object-manager-port={objects}", f"--runtime-env-agent-port={runtime_env}"]
    head_cmd += [f"--ray-client-server-port={client}"]
    # Its own session: every process of this cluster can be ended by this group id, and only those.
    with open(Path(temp) / HEAD_OUTPUT, "wb") as output:
        head = subprocess.Popen(head_cmd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    return head, temp, f"http://127.0.0.1:{dashboard}"


def _wait_until_ready(head: subprocess.Popen, address: str) -> int | None:
    """None once the dashboard answers; the head's exit code if it exits first."""
    deadline = time.monotonic() + 180  # a readiness bound: a loaded 2-core machine once took over 90 s
    while head.poll() is None:
        try:
            # Its Serve API too: a loaded machine's dashboard answered /api/version, then dropped `serve deploy`'s
            # first request to it (RemoteDisconnected, CI-like clean clone 2026-12-07)
            if all(httpx.get(f"{address}{path}", timeout=30).status_code == 200 for path in READY_PATHS):
                return None
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the dashboard did not come up"
        time.sleep(0.5)
    return head.returncode


def _output(temp: str, tail: int = 4000) -> str:
    return (Path(temp) / HEAD_OUTPUT).read_text(errors="replace")[-tail:]


def _remove(head: subprocess.Popen, temp: str) -> None:
    stop_cluster(head, temp)
    shutil.rmtree(temp, ignore_errors=True)


def job_submit(address: str, env: dict, job: list[str], working_dir: Path, timeout_s: float = 600):
    """`ray job submit` of `job`, finished. The dashboard answers before its agent can take jobs ("No available
    agent to submit job, please try again later" on a loaded machine): the submission is tried again then."""
    command = [RAY_BIN, "job", "submit", "--address", address, "--working-dir", str(working_dir), "--", *job]
    deadline = time.monotonic() + 300
    while True:
        done = subprocess.run(command, env=env, cwd=working_dir, capture_output=True, text=True, timeout=timeout_s)
        if "No available agent to submit job" not in done.stderr + done.stdout or time.monotonic() > deadline:
            return done
        time.sleep(2)


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def stop_cluster(head: subprocess.Popen, temp: str) -> None:
    """End every process of the cluster: they share the head's process group (and no other process does). SIGTERM
    first, then SIGKILL after 2 s: on SIGTERM the raylet and the GCS linger ~10 s before they exit (nothing of the
    test's cluster is kept, its temp dir is removed after)."""
    for sig, wait_s in ((signal.SIGTERM, 2), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while cluster_processes(temp) and time.monotonic() < deadline:
            time.sleep(0.2)
    head.wait()
    assert not cluster_processes(temp), "processes of the test's cluster survived"


def cluster_processes(temp: str) -> list[int]:
    """Processes whose command line names the cluster's temp dir (all of its Ray processes do)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and temp.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found
