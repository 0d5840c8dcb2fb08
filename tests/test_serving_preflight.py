"""The app builder's checks before Serve replaces anything (genrec.serving.preflight): a model directory an engine
replica could not load, or a cache of another width than the model's projector, refuses the build with the file
named. No Ray cluster but for the last test (the redeploy under load is in tests/test_serving.py)."""

import json
import shutil

import pytest
from pydantic import ValidationError

from genrec.errors import ModelDirectoryError
from genrec.serving import preflight
from genrec.serving.app import build_app
from genrec.serving.args import AppArgs, EngineSection
from genrec.serving.preflight import DeployRefused, check_model_dir, engine_nodes
from genrec.testing.tiny import write_hstu_dir
from tests.conftest import TINY
from tests.test_serving_families import SPEC


@pytest.fixture(scope="module")
def hstu_dir(tmp_path_factory):
    return write_hstu_dir(tmp_path_factory.mktemp("hstu-preflight") / "model", SPEC)


def broken(source, tmp_path, name: str, how: str):
    """A copy of `source` with one file truncated to half, overwritten with junk, or deleted."""
    copy = shutil.copytree(source, tmp_path / "broken")
    target = copy / name
    if how == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif how == "junk":
        target.write_bytes(b"not what it should be\n" * 10)
    else:
        target.unlink()
    return copy


def test_good_directories_of_both_families(tiny_dir, hstu_dir):
    qwen3, hstu = check_model_dir(tiny_dir), check_model_dir(hstu_dir)
    assert (qwen3.family, qwen3.user_dim) == ("qwen3", TINY.user_dim)
    assert (hstu.family, hstu.user_dim) == ("hstu", None)


QWEN3_BREAKS = [
    ("config.json", "junk"),
    ("tokenizer.json", "junk"),
    ("genrec/catalog.parquet", "junk"),
    ("genrec/catalog.parquet", "truncate"),
    ("genrec/catalog.parquet", "delete"),
    ("model.safetensors", "truncate"),
    ("model.safetensors", "delete"),
    ("genrec/soft_token.safetensors", "truncate"),
]
HSTU_BREAKS = [
    ("config.json", "junk"),
    ("genrec/catalog.parquet", "junk"),
    ("model.safetensors", "truncate"),
]


@pytest.mark.parametrize(("name", "how"), QWEN3_BREAKS, ids=[f"{n}-{h}" for n, h in QWEN3_BREAKS])
def test_a_broken_qwen3_directory_is_refused_naming_the_file(tiny_dir, tmp_path, name, how):
    model_dir = broken(tiny_dir, tmp_path, name, how)
    with pytest.raises(ModelDirectoryError) as err:
        check_model_dir(model_dir)
    named = "tokenizer" if name == "tokenizer.json" else name.rsplit("/", 1)[-1]
    assert named in str(err.value) and str(model_dir) in str(err.value)
    with pytest.raises(DeployRefused, match=named):  # and the builder refuses the deploy with it
        build_app(AppArgs(retriever={"model_dir": str(model_dir)}))


@pytest.mark.parametrize(("name", "how"), HSTU_BREAKS, ids=[f"{n}-{h}" for n, h in HSTU_BREAKS])
def test_a_broken_hstu_directory_is_refused_naming_the_file(hstu_dir, tmp_path, name, how):
    model_dir = broken(hstu_dir, tmp_path, name, how)
    with pytest.raises(DeployRefused, match=name.rsplit("/", 1)[-1]):
        build_app(AppArgs(ranker={"model_dir": str(model_dir)}))


def test_a_mistyped_model_dir_and_a_missing_weight_shard_are_refused(tiny_dir, tmp_path):
    with pytest.raises(DeployRefused, match="model directory does not exist"):
        build_app(AppArgs(retriever={"model_dir": str(tmp_path / "modle")}))
    sharded = shutil.copytree(tiny_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002.st"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(DeployRefused, match="model-00002.st: weight shard is missing"):
        build_app(AppArgs(retriever={"model_dir": str(sharded)}))


def test_a_cache_of_another_width_than_the_projector_is_refused(tiny_dir, hstu_dir, tmp_path):
    cache = {"name": "users", "dim": TINY.user_dim + 2}
    wrong = f"cache.dim is {TINY.user_dim + 2} .* takes {TINY.user_dim}-d user vectors"

    def app(model_dir, cache) -> AppArgs:
        return AppArgs(retriever={"model_dir": str(model_dir)}, ingress={"cache": cache})

    with pytest.raises(DeployRefused, match=wrong):
        build_app(app(tiny_dir, cache))
    build_app(app(tiny_dir, {**cache, "dim": TINY.user_dim}))  # the right width builds
    no_projector = broken(tiny_dir, tmp_path, "genrec/soft_token.safetensors", "delete")
    with pytest.raises(DeployRefused, match="no soft-token projector"):
        build_app(app(no_projector, cache))
    with pytest.raises(DeployRefused, match="is an HSTU ranking model, not a Qwen3 semantic-ID model"):
        build_app(app(hstu_dir, cache))
    with pytest.raises(ValidationError, match="this app has no retriever"):  # an HSTU app takes no user vectors
        AppArgs(ranker={"model_dir": str(hstu_dir)}, ingress={"cache": cache})


def test_the_check_runs_on_a_node_that_can_host_an_engine():
    nodes = [
        {"NodeID": "head", "Alive": True, "Resources": {"CPU": 0.0}},  # cluster.yaml's head: no work on it
        {"NodeID": "cpu", "Alive": True, "Resources": {"CPU": 8.0}},
        {"NodeID": "gpu-dead", "Alive": False, "Resources": {"CPU": 8.0, "GPU": 1.0}},
        {"NodeID": "gpu", "Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}},
    ]
    assert engine_nodes(nodes, cpus=1, gpus=1) == ["gpu"]
    assert engine_nodes(nodes, cpus=1, gpus=0) == ["cpu", "gpu"]
    assert EngineSection(model_dir="/m", device="cuda").resources() == (1, 1)
    small = {"ray_actor_options": {"num_cpus": 0.5}}
    assert EngineSection(model_dir="/m", deployment=small).resources() == (0.5, 0)


def test_on_a_cluster_the_check_runs_on_an_engine_node_and_its_error_comes_back(ray_cluster, tiny_dir, tmp_path):
    """The builder's node cannot host an engine (as cluster.yaml's head): the check runs as a task on a node
    that can, and a broken directory's error crosses back naming the file. With no such node up (GPU workers
    scaled to zero), nothing is checked: no engine runs, so none can be lost."""
    model_dir = broken(tiny_dir, tmp_path, "model.safetensors", "truncate")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(preflight, "_this_node", lambda: "the-head")
        assert preflight.preflight(app(tiny_dir, num_cpus=0.1)) == {"retriever": check_model_dir(tiny_dir)}
        with pytest.raises(DeployRefused, match="model.safetensors: not a complete safetensors file"):
            preflight.preflight(app(model_dir, num_cpus=0.1))
    assert preflight.preflight(app(model_dir, num_gpus=1)) == {}


def app(model_dir, **resources) -> AppArgs:
    """A retriever app whose replicas reserve these resources (num_cpus, num_gpus)."""
    return AppArgs(retriever={"model_dir": str(model_dir), "deployment": {"ray_actor_options": resources}})
