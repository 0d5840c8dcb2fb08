"""Text that cannot fit the model is refused before it is tokenized: megabytes of text must not stall the
engine (in a replica, tokenizing them blocked every other request long enough to fail health checks)."""

import pytest

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.errors import InvalidRequestError


class LongestText:
    """The engine's tokenizer, noting the longest text it was asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, *args, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture
def tokenized(engine, monkeypatch):
    spy = LongestText(engine.family.tokenizer)
    monkeypatch.setattr(engine.family, "tokenizer", spy)
    return spy


def test_a_huge_prompt_is_refused_untokenized(engine, tokenized):
    with pytest.raises(InvalidRequestError, match="refused untokenized") as info:
        engine.retrieve([RetrieveRequest(prompt="word " * 2_000_000, beam_width=2)])
    assert info.value.field == "prompt"
    assert tokenized.longest < 1000  # the megabytes never reached the tokenizer


def test_a_huge_candidate_text_is_refused_untokenized(engine, tokenized):
    with pytest.raises(InvalidRequestError, match="refused untokenized") as info:
        engine.score([ScoreRequest(prompt="user listened", candidates=[Candidate(text="news " * 2_000_000)])])
    assert info.value.field == "candidates[0].text"
    assert tokenized.longest < 1000


def test_text_within_the_bound_is_still_tokenized(engine):
    limit = engine.family.max_prompt_tokens
    with pytest.raises(InvalidRequestError, match="tokens; this model serves at most") as info:
        engine.retrieve([RetrieveRequest(prompt="ab " * (limit + 10), beam_width=2)])  # fits the bound, not the model
    assert info.value.field == "prompt"
