"""kernel.tlsfiles: TLS files are checked at start, naming the file."""

from pathlib import Path

import pytest

from kernel.tlsfiles import check_tls_files
from leasehold.local.procs import make_tls


def test_good_files_pass_and_bad_ones_are_named(tmp_path: Path):
    tls = make_tls(tmp_path / "tls")
    check_tls_files(str(tls.cert), str(tls.key), str(tls.ca))
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match="junk.pem is not a PEM CA certificate bundle"):
        check_tls_files(ca=str(junk))
    with pytest.raises(ValueError, match="not a PEM certificate chain and its unencrypted, matching private key"):
        check_tls_files(str(tls.cert), str(junk))
    with pytest.raises(ValueError, match="not a PEM certificate chain"):
        check_tls_files(str(tls.cert), str(tls.ca.with_name("ca.key")))  # another key: no match
    with pytest.raises(ValueError, match="go together"):
        check_tls_files(cert=str(tls.cert))
