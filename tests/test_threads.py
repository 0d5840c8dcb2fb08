"""An engine's CPU thread settings (genrec.threads): the thread count and the binding to cores are applied, by the
Serve replica and the batch actor from their options, and bad values are refused naming the setting at fault."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from genrec import threads as thread_settings
from genrec.batch import Execution, RecommendSpec
from genrec.batch.job_args import parse, run_job
from genrec.serving import engine_server
from genrec.serving.args import AppArgs, ReplicaOptions
from genrec.threads import Applied, apply_threads, available_cores, check_thread_settings, choose_cores

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="binding threads needs Linux")


@pytest.fixture
def restored():
    """Put back this (pytest) process's thread count and the cores of all its threads after the test."""
    threads = torch.get_num_threads()
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    torch.set_num_threads(threads)
    if cores is not None:
        thread_settings._bind_all_threads(cores)


def test_the_thread_count_is_set(restored):
    applied = apply_threads(1)
    assert torch.get_num_threads() == 1 and applied == Applied(threads=1, cores=None)


def test_no_setting_leaves_torch_as_it_is(restored):
    before = torch.get_num_threads()
    assert apply_threads(None) == Applied(threads=before, cores=None)
    assert torch.get_num_threads() == before


@linux_only
def test_pinning_binds_every_thread_of_the_process_to_the_chosen_cores(restored):
    available = available_cores()
    slot = len(available) - 1  # the last available core: not where an unbound process starts
    applied = apply_threads(1, pin=True, slot=slot)
    assert applied.cores == (available[-1],) and torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == {available[-1]}
    for tid in os.listdir("/proc/self/task"):
        assert os.sched_getaffinity(int(tid)) == {available[-1]}, tid
    # torch's threads started afterwards inherit the cores
    torch.ones(1 << 20).add_(1)
    for tid in os.listdir("/proc/self/task"):
        assert os.sched_getaffinity(int(tid)) == {available[-1]}, tid


@linux_only
def test_as_many_cores_as_threads_from_the_available_ones_with_a_warning(restored, caplog):
    available = available_cores()
    applied = apply_threads(len(available), pin=True)
    assert set(applied.cores) == set(available) == os.sched_getaffinity(0)
    assert applied.as_dict() == {"threads": len(available), "pinned_cores": available}
    assert "is every core this process may use" in caplog.text  # a binding that changes nothing


@linux_only
@pytest.mark.skipif(len(available_cores()) < 2, reason="needs a core left unbound")
def test_binding_fewer_threads_than_cores_does_not_warn(restored, caplog):
    apply_threads(1, pin=True)
    assert "is every core" not in caplog.text


def test_cores_are_chosen_consecutively_from_the_slot_wrapping():
    assert choose_cores(2, [0, 1, 2, 3], slot=0) == [0, 1]
    assert choose_cores(2, [0, 1, 2, 3], slot=3) == [0, 3]
    assert choose_cores(1, [4, 6], slot=7) == [6]
    assert choose_cores(3, [1, 2, 5], slot=123456) == [1, 2, 5]
    with pytest.raises(ValueError, match="3 threads pinned to distinct cores, but only 2"):
        choose_cores(3, [0, 1])


@pytest.mark.parametrize(
    ("threads", "pin", "fragment"),
    [
        (0, False, "threads=0: a number of threads, 1 or more"),
        (-2, False, "threads=-2"),
        (True, False, "threads=True"),
        ("2", False, "threads='2'"),
        (2.0, False, "threads=2.0"),
        (None, True, "pin needs threads"),
        (1, "yes", "pin='yes': true or false"),
    ],
)
def test_bad_settings_are_refused_by_name(threads, pin, fragment, restored):
    with pytest.raises(ValueError, match="^" + fragment.replace("(", r"\(")):
        check_thread_settings(threads, pin)
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="^" + fragment.replace("(", r"\(")):
        apply_threads(threads, pin)
    assert torch.get_num_threads() == before  # nothing applied


def test_the_callers_names_are_the_ones_refused():
    with pytest.raises(ValueError, match="^--pin needs --threads"):
        check_thread_settings(None, True, threads_name="--threads", pin_name="--pin")


def test_more_pinned_threads_than_available_cores_are_refused(restored):
    too_many = len(available_cores()) + 1
    with pytest.raises(ValueError, match=f"^torch_threads={too_many} with pin_threads: only"):
        apply_threads(too_many, pin=True, threads_name="torch_threads", pin_name="pin_threads")


# The replica's options


def test_replica_options_take_the_binding_next_to_the_threads():
    options = AppArgs(retriever={"model_dir": "/m", "threads": 2, "pin_threads": True}).retriever.replica_options()
    assert (options.threads, options.pin_threads) == (2, True)
    assert ReplicaOptions().pin_threads is False  # unchanged by default
    assert "pin_threads" not in options.engine_kwargs()  # not an Engine option


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"pin_threads": True}, "pin_threads\n.*needs threads"),
        ({"threads": 0}, "threads"),
        ({"threads": True}, "threads"),
        ({"threads": 2, "pin_threads": "sometimes"}, "pin_threads"),
    ],
)
def test_bad_replica_thread_options_are_refused_at_deploy_by_name(fields, fragment):
    with pytest.raises(ValidationError, match=fragment):
        AppArgs(retriever={"model_dir": "/m", **fields})


class _Stop(Exception):
    pass


def test_the_engine_replica_applies_its_thread_options_before_loading(monkeypatch):
    calls = []

    def recording(threads, pin, **names):
        calls.append((threads, pin, names["threads_name"], names["pin_name"]))
        raise _Stop  # before the model loads: what was asked is all this test needs

    monkeypatch.setattr(thread_settings, "apply_threads", recording)
    options = AppArgs(retriever={"model_dir": "/m", "threads": 3, "pin_threads": True}).retriever.replica_options()
    with pytest.raises(_Stop):
        engine_server.EngineServer.func_or_class("/m", "cpu", options)
    assert calls == [(3, True, "threads", "pin_threads")]


# The batch job's


def _execution(*flags: str) -> Execution:
    _, (run,) = parse(((RecommendSpec, Execution),), ["--model", "m", "--users", "u", "--out", "o", *flags])
    return run


def test_the_batch_flags_reach_the_execution():
    assert (_execution().threads, _execution().pin_threads) == (None, False)
    run = _execution("--threads", "2", "--pin-threads")
    assert (run.threads, run.pin_threads) == (2, True)


def test_pinning_without_threads_is_one_line_naming_the_flags(capsys):
    with pytest.raises(SystemExit) as exited:
        run_job(lambda: _execution("--pin-threads") and 0)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "--pin-threads: needs threads" in err, err


def test_the_batch_actor_applies_its_thread_options_before_loading(monkeypatch):
    from genrec.batch.spec import JobSpec
    from genrec.batch.worker import ShardWorker

    calls = []

    def recording(threads, pin, **names):
        calls.append((threads, pin, names["threads_name"], names["pin_name"]))
        raise _Stop

    monkeypatch.setattr(thread_settings, "apply_threads", recording)
    job = SimpleNamespace(spec=JobSpec.model_construct(model="m", users="u", out="o", device="cpu"), model="m")
    with pytest.raises(_Stop):
        ShardWorker(job, "run", execution=Execution(threads=2, pin_threads=True))
    assert calls == [(2, True, "--threads", "--pin-threads")]


def test_bench_load_refuses_pin_without_threads_before_loading_a_model(monkeypatch):
    from genrec_bench import load
    from genrec_bench.cli import LoadOptions

    monkeypatch.setattr(load, "model_dir_for", lambda *a: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match="^--pin needs --threads"):
        load.run(LoadOptions(rates="1", duration=1.0, prompt_len=8, beam_width=2, candidates=4, burst=4, pin=True))


@pytest.mark.skipif(sys.platform != "linux", reason="Linux")
def test_the_bench_load_options(monkeypatch):
    from typer.testing import CliRunner

    from genrec.cli import app

    seen = {}

    def fake_run(options):
        seen["threads"], seen["pin"] = options.threads, options.pin
        return {"ok": True}

    monkeypatch.setattr("genrec_bench.load.run", fake_run)
    result = CliRunner().invoke(app, ["bench", "load", "--threads", "2", "--pin", "--rates", "1"])
    assert result.exit_code == 0, result.output
    assert seen == {"threads": 2, "pin": True}
    assert CliRunner().invoke(app, ["bench", "load", "--threads", "0"]).exit_code == 2
