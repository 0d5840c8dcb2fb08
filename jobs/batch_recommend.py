"""Nightly batch recommendation: users Parquet -> one row per (user, rank) in OUT/recommendations/.

    python jobs/batch_recommend.py --model DIR --users USERS.parquet --out OUT_DIR [--score] [--actors N]
    ray job submit --working-dir . -- python jobs/batch_recommend.py --model ... (absolute paths)

Retrieves by default; --score recommends (retrieve, then label-score the items and the given candidates on the
same prefill); --order-by joint [--score-weight W] orders by the generator's and the label's log-probabilities
together (RecommendRequest.rank_by).

--ranker HSTU_DIR runs the online two-stage recommend's stages: stage 1 the recommend in beam order (the retrieved
items, then the row's given candidates kept as recommend keeps them; nothing scored unless --score), then a second
Ray Data stage (its own --rank-actors, --rank-cpus-per-actor): each user's items are ranked after the user's
`history` column (as jobs/batch_rank.py reads it) and ordered by --rank-task's
probability; the rows gain retrieval_rank (stage 1's order) and one prob_<task> column per ranker task. Items
the ranker does not know keep stage 1's order after the ranked ones; a user whose history the ranker refuses
is an error row.
Rerun with the same arguments after a failure: committed shards are skipped, the rest are computed.
Exit status: 0, or 1 when the fraction of bad rows (repeated user_ids among them) passes --max-error-fraction,
or 2 for bad arguments (a model directory its engines could not load, e.g. a config.json that disagrees with
its tensors; an --out that cannot be written; --num-gpus that the cluster cannot give among them). Local paths
are made absolute here, on the driver, before any actor starts.
"""

import _need_genrec  # noqa: F401  (first: one clear line when this python lacks genrec)

from genrec.batch import Execution, FunnelSpec, RankingExecution, RecommendSpec
from genrec.batch.job_args import main

if __name__ == "__main__":
    main(__doc__, (RecommendSpec, Execution), (FunnelSpec, Execution, RankingExecution))
