"""Nightly batch ranking: users Parquet (history, candidates) -> one row per (user, candidate) in OUT/rankings/.

    python jobs/batch_rank.py --model HSTU_DIR --users USERS.parquet --out OUT_DIR [--rank-by TASK] [--actors N]
    ray job submit --working-dir . -- python jobs/batch_rank.py --model ... (absolute paths)

Each user's candidates get every task's probability (columns prob_<task>); --rank-by TASK orders them by that
task's probability, highest first (ties in the candidates' order); without it, rank is the candidates' order.
Rerun with the same arguments after a failure: committed shards are skipped, the rest are computed.
Exit status: 0, or 1 when the fraction of bad rows (repeated user_ids among them) passes --max-error-fraction,
or 2 for bad arguments (a model directory its engines could not load, e.g. a config.json that disagrees with
its tensors; an --out that cannot be written; --num-gpus that the cluster cannot give among them). Local paths
are made absolute here, on the driver, before any actor starts.
"""

import _need_genrec  # noqa: F401  (first: one clear line when this python lacks genrec)

from genrec.batch import Execution, RankSpec
from genrec.batch.job_args import main

if __name__ == "__main__":
    main(__doc__, (RankSpec, Execution))
