import os
import shutil
import subprocess
from dataclasses import replace

import pytest
import torch

from genrec.testing.tiny import HSTUSpec, ModelSpec, write_hstu_dir, write_model_dir

TINY = ModelSpec(items=300, levels=3, codebook=8, user_dim=6, seed=1)
# The same model as Qwen2 (q/k/v biases, no q/k norm), with tied embeddings like Qwen2.5-0.5B to 3B.
QWEN2_TINY = replace(TINY, architecture="qwen2", tie_word_embeddings=True)

# The integration tier (`make test` runs it, `make test-fast` skips it): tests that start Ray, Serve, a Ray job,
# a redis-server or the whole demo. A test is in it when it uses one of these fixtures, lives in one of these
# modules, or is marked `integration` itself.
INTEGRATION_FIXTURES = {"ray_cluster", "serve_url", "redis_url"}
INTEGRATION_MODULES = {"test_serving", "test_batch_jobs", "test_demo_e2e"}
# `make test` runs two pytest-xdist workers, each module whole on one (--dist loadfile): each worker starts the
# session's local Ray cluster (and Serve) once, when its first test needs it. (Held to one worker, one cluster, these
# tests would take longer: on 2026-12-06 they took 1,056 s of the suite's 1,801 test-seconds.)


def pytest_collection_modifyitems(items):
    for item in items:
        on_session_cluster = bool(INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())))
        if on_session_cluster or _module(item) in INTEGRATION_MODULES:
            item.add_marker(pytest.mark.integration)


def _module(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if item.module else ""


def pytest_configure(config):
    """Each pytest process runs torch on one thread: `make test` runs two xdist workers on two cores, and a worker's
    second OpenMP thread only waits on the first while the other worker computes (CPU-bound checks of the GPU path
    took twice as long: test_compile_budget 121 s against 63 s). Ray's workers, jobs and the demo's processes keep
    their own settings; a test that sets threads restores them."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny") / "model", TINY)


@pytest.fixture(scope="session")
def engine(tiny_dir):
    """The session's shared engine keeps no prefixes between calls (prefix_cache_bytes=0), so no test's results
    depend on what ran before it; the prefix cache has tests of its own (tests/test_prefix_cache.py)."""
    from genrec.engine import Engine, SchedulerConfig

    return Engine.from_pretrained(tiny_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))


# The equivalence tests of every fast path run on each decoder architecture: they take `arch_dir`, `arch_engine`
# and `arch_hf_model` (qwen3: the session's `tiny_dir`, `engine` and `hf_model` themselves).
@pytest.fixture(scope="session", params=["qwen3", "qwen2"])
def architecture(request):
    return request.param


@pytest.fixture(scope="session")
def arch_dir(architecture, request, tmp_path_factory):
    if architecture == "qwen3":
        return request.getfixturevalue("tiny_dir")
    return write_model_dir(tmp_path_factory.mktemp(f"tiny-{architecture}") / "model", QWEN2_TINY)


@pytest.fixture(scope="session")
def arch_engine(architecture, arch_dir, request):
    from genrec.engine import Engine, SchedulerConfig

    if architecture == "qwen3":
        return request.getfixturevalue("engine")
    return Engine.from_pretrained(arch_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))


@pytest.fixture(scope="session")
def arch_hf_model(architecture, arch_dir, request):
    """transformers' own class for the architecture (Qwen3ForCausalLM, Qwen2ForCausalLM): the reference."""
    from transformers import AutoModelForCausalLM

    if architecture == "qwen3":
        return request.getfixturevalue("hf_model")
    model = AutoModelForCausalLM.from_pretrained(str(arch_dir), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    return model


# The tiny HSTU ranking model the ranking tests share.
HSTU_TINY = HSTUSpec(items=120, hidden=32, layers=2, heads=2, head_dim=8, max_positions=512, actions=3, time_buckets=6)


@pytest.fixture(scope="session")
def hstu_dir(tmp_path_factory):
    return write_hstu_dir(tmp_path_factory.mktemp("hstu") / "model", HSTU_TINY)


@pytest.fixture(scope="session")
def ranker(hstu_dir):
    """An HSTU engine, keeping no prefixes between calls (like `engine`)."""
    from genrec.engine import Engine, SchedulerConfig

    return Engine.from_pretrained(hstu_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


class ManualClock:
    """A scheduler's clock that moves only when told: deadline tests are exact and take no real time."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def random_prompt(engine, length, generator):
    """Ordinary tokens (below the semantic-ID range, no special tokens)."""
    first_semantic = int(engine.family.trie.token[0].min())
    specials = set(engine.family.tokenizer.all_special_ids)
    pool = torch.tensor([t for t in range(first_semantic) if t not in specials])
    return pool[torch.randint(0, len(pool), (length,), generator=generator)].tolist()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (starting one costs ~10 s here)."""
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    # Metrics reach the node's Prometheus endpoint every second, not every 10 s (Ray's default): the tests that read
    # a counter or gauge there wait for it.
    system = {"metrics_report_interval_ms": 1000}
    # address="local": a Ray of this worker's own, even while a test of the other worker runs a `ray start` cluster
    # (ray.init() with no address joins any local cluster it finds running).
    options = dict(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=system)
    ray.init(address="local", namespace="genrec-tests", **options)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server on 127.0.0.1 and a free port; installed with apt if the machine lacks it."""
    from genrec_bench.cache import LocalRedis

    if shutil.which("redis-server") is None:
        subprocess.run(["apt-get", "update", "-q"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], check=True, capture_output=True)
    with LocalRedis() as url:
        yield url


# The bearer token of the Serve tests' auth-on app. Set before Ray starts: replicas read it from the
# environment of the node, as a production deployment does (from a secret).
API_TOKEN_ENV = "GENREC_TEST_API_TOKEN"
os.environ.setdefault(API_TOKEN_ENV, "test-token-7f3a9c")


@pytest.fixture(scope="session")
def serve_url(ray_cluster):
    """Ray Serve on the session's Ray, HTTP on 127.0.0.1 and a free port; apps are added per test module."""
    from ray import serve

    from genrec_bench.common import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def openonerec(tmp_path_factory):
    """A tiny checkpoint in OpenOneRec's layout, as downloaded (no genrec/ files): a WrittenCheckpoint."""
    from genrec.testing.open_layouts import write_openonerec_dir
    from tests.open_checkpoints import OPEN_SPEC

    return write_openonerec_dir(tmp_path_factory.mktemp("openonerec") / "OneRec-tiny", OPEN_SPEC)


@pytest.fixture(scope="session")
def minionerec(tmp_path_factory):
    """A tiny checkpoint in MiniOneRec's layout, as downloaded (no genrec/ files): a WrittenCheckpoint."""
    from genrec.testing.open_layouts import write_minionerec_dir
    from tests.open_checkpoints import OPEN_SPEC

    return write_minionerec_dir(tmp_path_factory.mktemp("minionerec") / "MiniOneRec-tiny", OPEN_SPEC)
