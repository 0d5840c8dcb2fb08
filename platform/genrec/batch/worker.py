"""The Ray Data callable class: one Engine per actor; each call runs whole shards, read to committed.

Nothing here imports Ray: Ray Data constructs the class once per actor and calls it with batches of shard
descriptors. A shard is read, validated row by row, run through the engine in ONE call (so its results
depend on the shard alone, never on scheduling) and committed; a shard already committed is skipped. The rows the
driver found to repeat an earlier row's user_id (the shard's `repeats`) are refused, whatever else they hold.
Each job's worker (RecommendWorker, RankWorker) says which columns it reads, how rows become requests, which
engine call runs them and how results become its output table.
"""

from __future__ import annotations

import pyarrow as pa

from genrec.batch.output import OutputDir
from genrec.batch.results import errors_table
from genrec.batch.rows import Parsed, RowError
from genrec.batch.shards import InputLayout, Shard, ShardReader, UsersInput
from genrec.batch.spec import JobSpec
from genrec.errors import GenrecError, InvalidRequestError

REPORT = pa.schema(
    [
        ("shard", pa.int64()),
        ("users", pa.int64()),
        ("rows", pa.int64()),
        ("errors", pa.int64()),
        ("skipped", pa.bool_()),
    ]
)


class ShardWorker:
    layout: InputLayout  # the columns the job reads
    results: str  # its output folder

    def __init__(
        self,
        spec: JobSpec,
        model_version: str,
        run_id: str,
        threads: int | None = None,
        kv_budget_bytes: int | None = None,
        pin_threads: bool = False,
    ):
        from genrec.engine import Engine, SchedulerConfig
        from genrec.threads import apply_threads

        # Before the model loads, so that torch's threads start on their cores.
        self.threads = apply_threads(threads, pin_threads, threads_name="--threads", pin_name="--pin-threads")
        self.spec, self.model_version, self.run_id = spec, model_version, run_id
        # No prefix cache: a shard's results must depend on its rows alone, not on the shards before it.
        scheduler = SchedulerConfig(kv_budget_bytes=kv_budget_bytes, prefix_cache_bytes=0)
        self.engine = Engine.from_pretrained(
            self.model_dir(), device=spec.device, scheduler=scheduler, **spec.engine_kwargs()
        )
        self.reader = ShardReader(UsersInput(spec.users, self.layout))
        self.out = OutputDir(spec.out, self.results)

    def model_dir(self) -> str:
        """The model this worker's engine runs."""
        return self.spec.model

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self.run(Shard.from_row(row)) for row in batch.to_pylist()], schema=REPORT)

    def run(self, shard: Shard) -> dict:
        done = self.out.counts(shard)  # a retried task, or a late duplicate of a shard
        skipped = done is not None
        if not skipped:
            done = self.out.commit(shard, *self.compute(shard))
        return {"shard": shard.index, "users": shard.rows, "rows": done.rows, "errors": done.errors, "skipped": skipped}

    def compute(self, shard: Shard) -> tuple[pa.Table, pa.Table]:
        table = self.reader.read(shard)
        user_ids = table.column("user_id").combine_chunks()
        parsed = self.parse(table, user_ids)
        _refuse_repeats(parsed, shard)
        self._check_against_model(parsed)
        results = self.infer(parsed.requests) if parsed.requests else []
        return (
            self.results_table(user_ids, parsed.positions, results),
            errors_table(user_ids, sorted(parsed.errors, key=lambda e: e.position), shard.start, self.run_id),
        )

    def parse(self, table: pa.Table, user_ids: pa.Array) -> Parsed:
        """The shard's rows as requests, bad rows as errors."""
        raise NotImplementedError

    def infer(self, requests: list) -> list:
        """One engine call over the shard's valid requests."""
        raise NotImplementedError

    def results_table(self, user_ids: pa.Array, positions: list[int], results: list) -> pa.Table:
        """The output rows of the results (of the requests of shard rows `positions`)."""
        raise NotImplementedError

    def _check_against_model(self, parsed: Parsed) -> None:
        """Move requests the model refuses (too long, unknown item, wrong embedding size) to the errors."""
        keep = []
        for request, position in zip(parsed.requests, parsed.positions, strict=True):
            try:
                self.engine.prepare(request)
                keep.append((request, position))
            except InvalidRequestError as err:
                parsed.errors.append(RowError(position, err.field, err.problem))
            except GenrecError as err:
                parsed.errors.append(RowError(position, "request", str(err)))
        parsed.requests = [r for r, _ in keep]
        parsed.positions = [p for _, p in keep]


def _refuse_repeats(parsed: Parsed, shard: Shard) -> None:
    """The shard's repeats as errors (field user_id, naming the user's row), in place of a request or another error."""
    if not shard.repeats:
        return
    refused = {r.position: r.reason for r in shard.repeats}
    kept = [(q, p) for q, p in zip(parsed.requests, parsed.positions, strict=True) if p not in refused]
    parsed.requests, parsed.positions = [q for q, _ in kept], [p for _, p in kept]
    parsed.errors = [e for e in parsed.errors if e.position not in refused]
    parsed.errors += [RowError(position, "user_id", reason) for position, reason in refused.items()]
