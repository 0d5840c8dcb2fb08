"""The open checkpoints as downloaded plus `genrec catalog import`, served by the engine, equal transformers (issue
#30 item 8): constrained beam search against `generate(num_beams=..., prefix_allowed_tokens_fn=<the catalog's codes
with their wrappers and endings>, length_penalty=0)`, full-width beams against every code scored by teacher forcing,
label scoring against a plain forward; OpenOneRec's shared codes come back as all their items."""

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from genrec.api import Candidate, RetrieveRequest, ScoreRequest
from genrec.catalog_tools.importers import import_catalog, write_layout_preset
from genrec.engine import Engine, SchedulerConfig
from genrec.testing.open_layouts import alpaca_prompt, openonerec_messages, openonerec_prompt
from tests.open_checkpoints import fresh_copy, hf_constrained_beams, hf_sequence_logprobs

TOL = 1e-4


class Served:
    """One imported checkpoint: its engine, transformers' model and tokenizer, its catalog and code endings."""

    def __init__(self, model_dir):
        self.dir = model_dir
        self.engine = Engine.from_pretrained(model_dir, scheduler=SchedulerConfig(prefix_cache_bytes=0))
        self.hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.layout = self.engine.family.layout
        catalog = self.engine.catalog
        self.items = [(catalog.item_ids[i], tuple(catalog.code(i))) for i in range(len(catalog))]

    def codes(self) -> list[tuple]:
        """The distinct codes, in catalog order of their first item."""
        return list(dict.fromkeys(code for _, code in self.items))

    def sequences(self) -> list[list[int]]:
        """What the model generates for each code: the code, then its ending."""
        return [[*code, *self.layout.ending] for code in self.codes()]

    def code_of(self, sequence) -> tuple:
        return tuple(sequence[: len(sequence) - len(self.layout.ending)])

    def items_of(self, code) -> list[str]:
        return [item for item, c in self.items if c == code]


def by_code(result) -> list[tuple[tuple, float]]:
    """A retrieve result's codes in order with their logprob (the items of one code are adjacent)."""
    return [(code, next(g).logprob) for code, g in itertools.groupby(result.items, key=lambda i: tuple(i.semantic_id))]


@pytest.fixture(scope="module")
def oo(openonerec, tmp_path_factory):
    model_dir, item_map = fresh_copy(openonerec, tmp_path_factory.mktemp("oo"))
    import_catalog(model_dir, item_map)
    return Served(model_dir)


@pytest.fixture(scope="module")
def mo(minionerec, tmp_path_factory):
    model_dir, item_map = fresh_copy(minionerec, tmp_path_factory.mktemp("mo"))
    write_layout_preset(model_dir, "minionerec")
    import_catalog(model_dir, item_map)
    return Served(model_dir)


def oo_prompt(oo, openonerec, users=(0, 1, 2)):
    history = [openonerec.codes[str(1000 + u)] for u in users]
    return openonerec_prompt(oo.tok, history)  # the chat template, thinking off, then <|sid_begin|>


def mo_prompt(mo, minionerec, users=(0, 1, 2)):
    return mo.tok(alpaca_prompt([minionerec.codes[str(u)] for u in users]))["input_ids"]


def assert_beams_equal(got, want, served):
    assert [code for code, _ in got] == [served.code_of(seq) for seq, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) <= TOL


@pytest.mark.parametrize("beam_width", [4, 16])
def test_openonerec_beam_search_equals_transformers(oo, openonerec, beam_width):
    prompt = oo_prompt(oo, openonerec)
    (result,) = oo.engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=beam_width)])
    want = hf_constrained_beams(oo.hf, prompt, oo.sequences(), beam_width)
    assert result.codes == beam_width
    assert_beams_equal(by_code(result), want, oo)
    assert all(seq[-1] == oo.tok.convert_tokens_to_ids("<|sid_end|>") for seq, _ in want)


@pytest.mark.parametrize("beam_width", [4, 16])
def test_minionerec_beam_search_equals_transformers(mo, minionerec, beam_width):
    prompt = mo_prompt(mo, minionerec)
    (result,) = mo.engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=beam_width)])
    want = hf_constrained_beams(mo.hf, prompt, mo.sequences(), beam_width, eos=mo.tok.eos_token_id)
    assert_beams_equal(by_code(result), want, mo)


@pytest.mark.parametrize("which", ["oo", "mo"])
def test_full_width_beams_are_every_code_scored_by_teacher_forcing(which, request, openonerec, minionerec):
    served = request.getfixturevalue(which)
    prompt = oo_prompt(served, openonerec, (5,)) if which == "oo" else mo_prompt(served, minionerec, (5,))
    codes = served.codes()
    (result,) = served.engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=len(codes))])
    want = dict(zip(codes, hf_sequence_logprobs(served.hf, prompt, served.sequences()), strict=True))
    got = by_code(result)
    assert sorted(code for code, _ in got) == sorted(codes)
    assert max(abs(lp - want[code]) for code, lp in got) <= TOL
    assert [lp for _, lp in got] == sorted((lp for _, lp in got), reverse=True)


def test_openonerec_shared_codes_return_all_their_items_in_catalog_order(oo, openonerec):
    prompt = oo_prompt(oo, openonerec, (7, 8))
    codes = oo.codes()
    (result,) = oo.engine.retrieve([RetrieveRequest(prompt_token_ids=prompt, beam_width=len(codes))])
    assert result.codes == len(codes) and len(result.items) == len(oo.items)
    for code, group in itertools.groupby(result.items, key=lambda i: tuple(i.semantic_id)):
        assert [i.item_id for i in group] == oo.items_of(code)
    shared = next(code for code in codes if len(oo.items_of(code)) > 1)
    first, *others = oo.items_of(shared)
    (excluding,) = oo.engine.retrieve(
        [RetrieveRequest(prompt_token_ids=prompt, beam_width=len(codes), exclude_item_ids=[first])]
    )
    assert [i.item_id for i in excluding.items if tuple(i.semantic_id) == shared] == others


def test_openonerec_begin_token_is_appended_when_the_prompt_lacks_it(oo, openonerec):
    prompt = oo_prompt(oo, openonerec)
    begin = oo.tok.convert_tokens_to_ids("<|sid_begin|>")
    assert prompt[-1] == begin
    with_begin, without = oo.engine.retrieve(
        [RetrieveRequest(prompt_token_ids=p, beam_width=8) for p in (prompt, prompt[:-1])]
    )
    assert [i.item_id for i in without.items] == [i.item_id for i in with_begin.items]
    assert [i.logprob for i in without.items] == pytest.approx([i.logprob for i in with_begin.items], abs=TOL)


@torch.no_grad()
def hf_label_logprobs(served, prompt, rows, labels):
    pos, neg = (served.tok(w, add_special_tokens=False)["input_ids"][0] for w in labels)
    out = []
    for row in rows:
        logits = served.hf(torch.tensor([prompt + row])).logits[0, -1]
        out.append((torch.log_softmax(logits, -1)[pos].item(), torch.softmax(logits[[pos, neg]], -1)[0].item()))
    return out


@pytest.mark.parametrize("which", ["oo", "mo"])
def test_scoring_equals_a_plain_forward(which, request, openonerec, minionerec):
    served = request.getfixturevalue(which)
    prompt = oo_prompt(served, openonerec, (3,)) if which == "oo" else mo_prompt(served, minionerec, (3,))
    picked = [served.items[i] for i in (0, 5, 17)]
    (result,) = served.engine.score(
        [ScoreRequest(prompt_token_ids=prompt, candidates=[Candidate(item_id=item) for item, _ in picked])]
    )
    # Each item's row is its code and ending, as generated (the OpenOneRec prompt already ends with the begin token)
    rows = [[*code, *served.layout.ending] for _, code in picked]
    want = hf_label_logprobs(served, prompt, rows, served.layout.labels)
    assert served.layout.labels == (("是", "否") if which == "oo" else ("yes", "no"))
    assert [s.item_id for s in result.scores] == [item for item, _ in picked]
    assert max(abs(s.logprob - lp) for s, (lp, _) in zip(result.scores, want, strict=True)) <= TOL
    assert max(abs(s.prob - p) for s, (_, p) in zip(result.scores, want, strict=True)) <= TOL


def test_openonerec_chat_messages_run_as_its_own_template_renders_them(oo, openonerec):
    """A `messages` request is the checkpoint's chat template with thinking off; the engine appends the begin token
    the assistant's code starts with, so it retrieves what OpenOneRec's own prompt (template + begin) does."""
    from genrec.api import PromptRequest

    history = [openonerec.codes[str(1000 + u)] for u in (0, 1, 2)]
    messages = openonerec_messages(history)
    rendered = oo.engine.render_prompt(PromptRequest(messages=messages))
    assert rendered.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rendered.token_ids == oo_prompt(oo, openonerec)[:-1]  # all but the begin token the engine appends
    by_chat, by_ids = oo.engine.retrieve(
        [
            RetrieveRequest(messages=messages, beam_width=8),
            RetrieveRequest(prompt_token_ids=oo_prompt(oo, openonerec), beam_width=8),
        ]
    )
    assert [i.item_id for i in by_chat.items] == [i.item_id for i in by_ids.items]
    assert [i.logprob for i in by_chat.items] == pytest.approx([i.logprob for i in by_ids.items], abs=TOL)


def test_minionerec_text_prompt_runs_as_its_tokens(mo, minionerec):
    text = alpaca_prompt([minionerec.codes[str(u)] for u in (0, 1, 2)])
    by_text, by_ids = mo.engine.retrieve(
        [
            RetrieveRequest(prompt=text, beam_width=8),
            RetrieveRequest(prompt_token_ids=mo_prompt(mo, minionerec), beam_width=8),
        ]
    )
    assert [(i.item_id, i.logprob) for i in by_text.items] == [(i.item_id, i.logprob) for i in by_ids.items]
