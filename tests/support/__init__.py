"""Fakes and helpers shared by the tests: a clock a test moves by hand (:mod:`.clock`), waiting for
a condition instead of sleeping a fixed time (:mod:`.waiting`), and the sample policy as a bundle
file (:mod:`.policies`; the ``policy_file`` fixture of tests/conftest.py), a recording stand-in for
an asyncio transport (:mod:`.transport`), and a backend that reads headers CGI-style, as many
backends behind a gateway do (:mod:`.cgi_backend`)."""
