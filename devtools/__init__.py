"""Development tools that generate or check documentation from the code (not in the wheel; run
from a checkout: ``python -m devtools.doc_tables``)."""
