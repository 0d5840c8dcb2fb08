"""genrec's stages for a Ray Data pipeline of the caller's own (genrec.data.processors): `Recommend` (with
`ranker`, the funnel) and `Rank`."""

from genrec.data.processors import Rank, Recommend

__all__ = ["Rank", "Recommend"]
