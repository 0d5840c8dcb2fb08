"""Test models and plain references: tiny checkpoints with the real architectures (`genrec tiny-model`, the demo,
the tests and benchmarks), open-project layouts, and plain-Python views of the catalog for baselines."""
