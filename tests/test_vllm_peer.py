"""vLLM as a peer: it loads `genrec tiny-model`'s directory and agrees with our forward pass; the benches run it.

The tests that run vLLM need its venv (`make peers`, not part of `make test`) and are skipped without it.
"""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from genrec.cli import app, main
from genrec_bench.peer_vllm import VllmPeer, peers_venv
from tests.conftest import random_prompt

needs_vllm = pytest.mark.skipif(
    not (peers_venv() / "bin" / "python").exists(),
    reason=f"no vLLM peers venv at {peers_venv()}: run `make peers` to run the vLLM comparison tests",
)


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory):
    """A tiny model of a head size vLLM's CPU attention supports (64; the default tiny model's 16 is not)."""
    out = tmp_path_factory.mktemp("head64") / "model"
    args = ["tiny-model", str(out), "--items", "200", "--levels", "3", "--codebook", "8", "--user-dim", "0"]
    args += ["--hidden", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--intermediate", "256"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_the_peers_venv_is_the_one_make_peers_makes(monkeypatch):
    """`make peers` puts it at the repository's root (PEERS ?= .venv-peers): the bench looks there by default."""
    monkeypatch.delenv("GENREC_PEERS_VENV", raising=False)
    assert peers_venv() == Path(__file__).resolve().parents[1] / ".venv-peers"


def exit_2(monkeypatch, capsys, *argv) -> str:
    """`genrec ARGV` in this process: asserts exit code 2 and returns stderr."""
    monkeypatch.setattr("sys.argv", ["genrec", *map(str, argv)])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    return err


def test_refuses_head_size_vllm_cpu_lacks(tiny_dir, monkeypatch, capsys):
    err = exit_2(monkeypatch, capsys, "bench", "retrieve", "--model", tiny_dir, "--beam-width", "4", "--peer", "vllm")
    assert "vLLM's CPU attention does not support head size 16" in err and "--head-dim 64" in err


def test_refuses_vocabulary_below_twice_the_beam(head64_dir, monkeypatch, capsys):
    vocab = json.loads((head64_dir / "config.json").read_text())["vocab_size"]
    args = ["bench", "retrieve", "--model", head64_dir, "--beam-width", vocab // 2 + 1, "--peer", "vllm"]
    err = exit_2(monkeypatch, capsys, *args)
    assert f"crashes on this model's vocabulary of {vocab}" in err and f"beam width <= {vocab // 2}" in err


def test_refuses_unknown_peer_and_missing_venv(head64_dir, tmp_path, monkeypatch, capsys):
    err = exit_2(monkeypatch, capsys, "bench", "score", "--model", head64_dir, "--peer", "sglang")
    assert "unknown peer 'sglang'" in err
    monkeypatch.setenv("GENREC_PEERS_VENV", str(tmp_path / "nowhere"))
    err = exit_2(monkeypatch, capsys, "bench", "score", "--model", head64_dir, "--peer", "vllm")
    assert "run `make peers` first" in err


@needs_vllm
def test_vllm_next_token_logprobs_equal_ours(head64_dir):
    from genrec.api import RetrieveRequest
    from genrec.engine import Engine

    engine = Engine.from_pretrained(head64_dir)
    generator = torch.Generator().manual_seed(7)
    prompts = [random_prompt(engine, n, generator) for n in (5, 70, 300)]
    top = 20
    with VllmPeer(head64_dir, engine.model.config, "cpu", "float32", 400, rows=len(prompts)) as peer:
        theirs = peer.call({"task": "next_token", "prompts": prompts, "top": top})
    for prompt, logprobs, greedy in zip(prompts, theirs["logprobs"], theirs["greedy"], strict=True):
        prefilled = engine.runner.prefill_alone(engine.prepare(RetrieveRequest(prompt_token_ids=prompt)))
        ours = prefilled.last_logits.float().log_softmax(-1)
        best = ours.topk(top)
        assert greedy == int(best.indices[0])
        assert {int(t) for t in logprobs} == set(best.indices.tolist())
        for token, logprob in logprobs.items():
            assert abs(logprob - float(ours[int(token)])) <= 1e-3, (token, logprob, float(ours[int(token)]))


def bench(tmp_path, *args) -> dict:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", *args, "--repeats", "1", "--peer", "vllm", "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())["vllm"]


@needs_vllm
def test_bench_retrieve_with_vllm_peer(head64_dir, tmp_path):
    args = ["retrieve", "--model", head64_dir, "--prompt-len", "70", "--beam-width", "4", "--no-hf-baseline"]
    peer = bench(tmp_path, *map(str, args))
    assert peer["vllm"] and peer["options"]["max_logprobs"] >= 8  # 2 x beam width: vLLM asks that many
    assert peer["ratios"]["vllm_over_genrec"] > 0 and peer["beams"] == 4
    assert 0 <= peer["beams_not_in_catalog"] <= 4


@needs_vllm
def test_bench_score_with_vllm_peer(head64_dir, tmp_path):
    peer = bench(tmp_path, "score", "--model", str(head64_dir), "--prefix-len", "70", "--candidates", "10")
    assert peer["ratios"]["vllm_mode"] in peer["ratios_per_mode"]
    assert all(r["vllm_over_genrec_fastest_rounds"] > 0 for r in peer["ratios_per_mode"].values())
    # Both of vLLM's ways agree with genrec's one-pass scores, and its prefix cache served the shared prompt.
    assert all(diff <= 1e-3 for diff in peer["max_abs_logprob_diff"].values()), peer
    assert all(cached >= 9 * 64 for cached in peer["vllm_cached_prompt_tokens"].values()), peer
