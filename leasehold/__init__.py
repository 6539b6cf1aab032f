"""Operator tooling, one subpackage per job: ``leasehold.commands`` (the ``leasehold`` CLI) and
``leasehold.local`` (the local topology supervisor used by ``leasehold up``, ``make run``, the
end-to-end and chaos tests and the benchmarks). The services themselves never import this
package; the benchmarks (``bench/``), the chaos suite (``chaos/``) and the documentation
generators (``devtools/``) live beside it in the checkout, outside the wheel."""
