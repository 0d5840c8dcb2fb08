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
