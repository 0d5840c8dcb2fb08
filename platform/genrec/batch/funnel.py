"""run_funnel: the nightly funnel, retrieve (or recommend) then rank, as two Ray Data stages chained in one
dataset, each with its own actor pool. Stage 2 commits each shard: resume and idempotence stay per shard."""

from __future__ import annotations

from dataclasses import replace

from genrec.batch.funnel_spec import FunnelSpec, RankingExecution
from genrec.batch.funnel_worker import RankStage, RetrieveStage
from genrec.batch.pipeline import Stage, Summary, run_stages
from genrec.batch.recommend import check_generator, embedding_cache
from genrec.batch.spec import Execution
from genrec.model.directory import ModelDir


def run_funnel(
    spec: FunnelSpec, execution: Execution = Execution(), ranking: RankingExecution = RankingExecution()
) -> Summary:
    check_generator(spec.model)
    ranker_version = ModelDir.open(spec.ranker).version
    stages = [
        Stage(RetrieveStage, execution, embedding_cache(spec)),
        Stage(RankStage, ranking.over(execution), lambda: {"ranker_version": ranker_version}),
    ]
    return replace(run_stages(spec, stages), ranker_version=ranker_version)
