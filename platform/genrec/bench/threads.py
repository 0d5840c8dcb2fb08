"""`genrec bench threads`: an engine's thread settings on a busy machine, pinned against unpinned.

Each setting (torch threads, bound to cores or not) runs `genrec bench load` in its own process (a process's
binding cannot be undone), while `--background` busy processes keep the cores contended: with one per core about
cores + the engine's threads are runnable (3-4 on 2 cores). Settings alternate round by round so drifts in the
machine's load fall on all of them alike. The report gives, per setting, the medians over rounds of one request
alone, the saturation throughput and the latency at `--rate` (a setting that saturates below it queues: its
latencies grow with the run), the load seen during its runs, and ratios against the unpinned setting with as
many threads (and against torch's default: one thread per core, unpinned).

Binding as many threads as the machine has cores binds them to every core: that setting is a control (any
difference from unbound is noise). "bound per thread" is not an engine option: it sets libgomp's
OMP_PROC_BIND/OMP_PLACES (one core per thread, fixed at process start), measured here to see whether it is
worth one.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from genrec.bench.common import machine
from genrec.threads import available_cores


@dataclass(frozen=True)
class Setting:
    name: str
    threads: int
    pin: bool = False
    env: tuple[tuple[str, str], ...] = ()  # set at the process's start


PER_THREAD_BINDING = (("OMP_PROC_BIND", "close"), ("OMP_PLACES", "cores"))  # libgomp: thread i on core i


def settings_for(cores: int) -> list[Setting]:
    """One thread and one thread per core, each unpinned and pinned (and per-thread bound where >1 thread)."""
    chosen = [Setting("1 thread", 1), Setting("1 thread, pinned", 1, pin=True)]
    if cores > 1:
        chosen += [
            Setting(f"{cores} threads", cores),
            Setting(f"{cores} threads, pinned", cores, pin=True),
            Setting(f"{cores} threads, bound per thread", cores, env=PER_THREAD_BINDING),
        ]
    return chosen


class BackgroundLoad:
    """`count` processes spinning in pure Python, one core's worth of load each, until the block ends."""

    def __init__(self, count: int):
        self.count = count
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> BackgroundLoad:
        spin = "while True:\n    pass\n"
        try:
            for _ in range(self.count):
                self.processes.append(subprocess.Popen([sys.executable, "-c", spin]))
        except BaseException:
            self.__exit__()  # those already spinning end here too
            raise
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()


class LoadSampler:
    """Samples, every `interval_s` while running, the 1-minute load average and the number of runnable threads
    (/proc/loadavg's fourth field: an instant reading, where the average lags by a minute)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.averages: list[float] = []
        self.runnable: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            reading = read_loadavg()
            if reading is not None:
                self.averages.append(reading[0])
                self.runnable.append(reading[1])

    def summary(self) -> dict:
        return {
            "load_average_1m_mean": statistics.fmean(self.averages) if self.averages else None,
            "runnable_threads_mean": statistics.fmean(self.runnable) if self.runnable else None,
        }


def read_loadavg() -> tuple[float, int] | None:
    """(1-minute load average, runnable threads now besides the reader) from /proc/loadavg (whose count includes
    the thread reading it); None where there is none."""
    try:
        fields = Path("/proc/loadavg").read_text().split()
    except OSError:
        return None
    return float(fields[0]), int(fields[3].split("/")[0]) - 1


def load_command(
    setting: Setting, out: Path, rate: float, duration: float, burst: int, load_args: list[str]
) -> list[str]:
    command = [sys.executable, "-m", "genrec.cli", "bench", "load", "--rates", str(rate), "--duration", str(duration)]
    command += ["--burst", str(burst), "--threads", str(setting.threads), "--json", str(out), *load_args]
    return command + (["--pin"] if setting.pin else [])


def run_setting(setting: Setting, rate: float, duration: float, burst: int, load_args: list[str]) -> dict:
    """One `genrec bench load` run of `setting` in a fresh process; its figures and the load seen meanwhile."""
    env = {**os.environ, "OMP_NUM_THREADS": str(setting.threads), **dict(setting.env)}
    with tempfile.TemporaryDirectory() as tmp, LoadSampler() as sampler:
        out = Path(tmp) / "load.json"
        done = subprocess.run(
            load_command(setting, out, rate, duration, burst, load_args), env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"bench load for {setting.name!r} failed:\n{done.stderr[-2000:]}")
        report = json.loads(out.read_text())
    point = report["rates"][0]
    return {
        "sequential_s": report["sequential"]["seconds_per_request"],
        "saturation_qps": report["saturation"]["qps"],
        "p50_s": point["p50_s"],
        "p99_s": point["p99_s"],
        "pinned_cores": report["threads"]["pinned_cores"],
        **sampler.summary(),
    }


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per setting, the median of each figure over its rounds (None where a round had none)."""
    figures = ("sequential_s", "saturation_qps", "p50_s", "p99_s", "load_average_1m_mean", "runnable_threads_mean")
    summary = {}
    for name, rounds in runs.items():
        pinned = [r["pinned_cores"] for r in rounds if r["pinned_cores"] is not None]
        summary[name] = {"rounds": len(rounds), "pinned_cores": pinned or None}  # per round: the slot is the PID
        for figure in figures:
            values = [r[figure] for r in rounds if r[figure] is not None]
            summary[name][figure] = statistics.median(values) if values else None
    return summary


def ratios(summary: dict[str, dict], settings: list[Setting], default: str) -> dict[str, dict]:
    """Each setting against the unpinned one with as many threads, and against `default`: time ratios below 1
    and the throughput ratio above 1 mean better."""

    def against(name: str, base: str) -> dict:
        mine, theirs = summary[name], summary[base]
        out = {"baseline": base}
        for figure in ("saturation_qps", "sequential_s", "p50_s", "p99_s"):
            if mine[figure] is not None and theirs[figure]:
                out[figure] = mine[figure] / theirs[figure]
        return out

    unpinned = {s.threads: s.name for s in settings if not s.pin and not s.env}
    result = {}
    for setting in settings:
        entry = {"vs_torch_default": against(setting.name, default)} if setting.name != default else {}
        if setting.name != unpinned[setting.threads]:
            entry["vs_unpinned"] = against(setting.name, unpinned[setting.threads])
        result[setting.name] = entry
    return result


def run(
    background: int | None,
    rounds: int,
    rate: float,
    duration: float,
    burst: int,
    load_args: list[str],
    settle_s: float = 60.0,
) -> dict:
    cores = len(available_cores())
    background = cores if background is None else background
    settings = settings_for(cores)
    runs: dict[str, list[dict]] = {s.name: [] for s in settings}
    with BackgroundLoad(background):
        time.sleep(settle_s)  # the 1-minute load average climbs to the background's level
        for round_index in range(rounds):
            order = settings if round_index % 2 == 0 else settings[::-1]
            for setting in order:
                runs[setting.name].append(run_setting(setting, rate, duration, burst, load_args))
    summary = summarize(runs)
    default = next(s.name for s in settings if s.threads == cores and not s.pin and not s.env)
    return {
        "benchmark": "threads",
        "cores": cores,
        "background_processes": background,
        "rounds": rounds,
        "settle_s": settle_s,
        "offered_qps": rate,
        "load_args": load_args,
        "settings": summary,
        "ratios": ratios(summary, settings, default),
        "runs": runs,
        "machine": machine(),
    }
