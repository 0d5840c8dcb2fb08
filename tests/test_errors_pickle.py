"""genrec errors cross process boundaries (Ray Serve handles, Ray Data): they must survive pickling."""

import pickle

from genrec.errors import CatalogError, InvalidRequestError, ModelDirectoryError, Overloaded, RequestTimeout
from genrec.serving.http_errors import CatalogNotServed


def test_errors_round_trip_with_their_fields():
    for error in (
        InvalidRequestError("candidates[3].item_id", "unknown item 'x'"),
        ModelDirectoryError("/models/a", "config.json is missing"),
        CatalogError("/models/a/genrec/catalog.parquet", "duplicate item_ids"),
        Overloaded("queue full", retry_after_s=2.5),
        RequestTimeout("late"),
        CatalogNotServed("/models/a/catalog-1.parquet", "catalog file is missing"),  # raised by a replica
    ):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error)
        assert str(back) == str(error)
        assert back.__dict__ == error.__dict__
