"""`make bench`: Leasehold benchmarks, each figure against a ceiling measured in the same run."""
