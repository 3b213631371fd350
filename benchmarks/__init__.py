"""csframework's benchmarks: ``python -m benchmarks`` measures every figure of the README's table."""
