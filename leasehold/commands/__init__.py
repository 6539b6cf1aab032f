"""The ``leasehold`` command line: one module per command group, one output convention."""
