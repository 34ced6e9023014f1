"""Release sign-off and sweeps: a release manifest (``manifest``), its cells and the inputs that
make a receipt current (``cells``), ``harness signoff`` (``signoff``) and ``harness sweep``
(``sweep``, local processes or Ray). Sits on top of compare, contracts and evidence; the CLI only
parses and prints (docs/release.md)."""
