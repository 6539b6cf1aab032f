"""``python -m leasehold``: the ``leasehold`` command."""

from leasehold.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
