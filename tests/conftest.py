import pytest
import torch

from genrec.model.tiny import ModelSpec, write_model_dir

TINY = ModelSpec(items=300, levels=3, codebook=8, user_dim=6, seed=1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny") / "model", TINY)


@pytest.fixture(scope="session")
def engine(tiny_dir):
    from genrec.engine import Engine

    return Engine.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def random_prompt(engine, length, generator):
    """Ordinary tokens (below the semantic-ID range, no special tokens)."""
    first_semantic = int(engine.trie.token[0].min())
    specials = set(engine.tokenizer.all_special_ids)
    pool = torch.tensor([t for t in range(first_semantic) if t not in specials])
    return pool[torch.randint(0, len(pool), (length,), generator=generator)].tolist()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (starting one costs ~10 s here)."""
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, namespace="genrec-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on 127.0.0.1 and a free port; installed with apt if the machine lacks it."""
    import shutil
    import socket
    import subprocess
    import time

    binary = shutil.which("redis-server")
    if binary is None:
        subprocess.run(["apt-get", "update", "-q"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], check=True, capture_output=True)
        binary = shutil.which("redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path_factory.mktemp("redis")
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    server.terminate()
    server.wait(10)
