"""Reproducible measurements of the testbed. Run each from the repository root as
`.venv/bin/python -m benchmarks.<name>` (capture, collectives, compression, fidelity, scale,
training; `--help` lists its options); each writes its table to
`benchmarks/results/<name>.md`."""
