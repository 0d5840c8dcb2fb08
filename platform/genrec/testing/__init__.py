"""Test models: tiny checkpoints with the real architectures (`genrec tiny-model`, the demo, the tests and
benchmarks) and the open projects' checkpoint layouts."""
