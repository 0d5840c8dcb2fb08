"""A batch worker whose engine hits a bug on chosen rows: what a row's data can do to a real engine (an exception
that is no GenrecError), put where the tests choose. Ray Data imports this module on its actors.

    a history holding FAILS_TO_RUN     the ranker's model raises while prefilling it (a RuntimeError, mid-run)
    a history holding FAILS_TO_PREPARE the ranker raises while preparing it (a ZeroDivisionError)
    a prompt of FAILS_PROMPT_TOKENS    the retriever's model raises while prefilling it
"""

from genrec.batch.worker import ShardWorker

FAILS_TO_RUN, FAILS_TO_PREPARE = "item-000119", "item-000118"  # the last items of HSTU_TINY's catalog
FAILS_PROMPT_TOKENS = 7


def history_items(request) -> set[str]:
    return {e.item_id for e in getattr(request, "history", None) or ()}


def inject_faults(engine, fails_to_run: str = FAILS_TO_RUN, fails_to_prepare: str = FAILS_TO_PREPARE) -> None:
    """The engine's family (an instance) raises on the chosen requests; every other request runs as ever."""
    family = engine.family
    prepare, context_embeds = family.prepare, family.context_embeds

    def faulty_prepare(request, kind):
        if fails_to_prepare in history_items(request):
            raise ZeroDivisionError("injected: preparing this history")
        return prepare(request, kind)

    def faulty_context_embeds(prepared, start=0, stop=None):
        request = prepared.request
        tokens = getattr(request, "prompt_token_ids", None)
        if fails_to_run in history_items(request) or (tokens is not None and len(tokens) == FAILS_PROMPT_TOKENS):
            raise RuntimeError("injected: prefilling this context")
        return context_embeds(prepared, start, stop)

    family.prepare, family.context_embeds = faulty_prepare, faulty_context_embeds


class FaultyWorker(ShardWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inject_faults(self.engine)
