"""The benchmark harness: datasets, the interleaved runner and its report."""
