"""Text that cannot fit the model is refused before it is tokenized: megabytes of text must not stall the
engine (in a replica, tokenizing them blocked every other request long enough to fail health checks)."""

import time

import pytest

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.errors import InvalidRequestError


def test_a_huge_prompt_is_refused_untokenized(engine):
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="refused untokenized") as info:
        engine.retrieve([RetrieveRequest(prompt="word " * 2_000_000, beam_width=2)])
    assert info.value.field == "prompt"
    assert time.perf_counter() - started < 0.5


def test_a_huge_candidate_text_is_refused_untokenized(engine):
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="refused untokenized") as info:
        engine.score([ScoreRequest(prompt="user listened", candidates=[Candidate(text="news " * 2_000_000)])])
    assert info.value.field == "candidates[0].text"
    assert time.perf_counter() - started < 0.5


def test_text_within_the_bound_is_still_tokenized(engine):
    limit = engine.max_prompt_tokens
    with pytest.raises(InvalidRequestError, match="tokens; this model serves at most") as info:
        engine.retrieve([RetrieveRequest(prompt="ab " * (limit + 10), beam_width=2)])  # fits the bound, not the model
    assert info.value.field == "prompt"
