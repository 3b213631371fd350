"""csframework's benchmarks: ``python -m benchmarks`` measures every figure of docs/design/figures.md."""
