"""Redis adapters of the region agent (scripts, client, batching node adapter)."""
