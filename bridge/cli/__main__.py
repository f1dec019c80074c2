"""``python -m bridge.cli``: the ``phorge-bridge`` command without its console script."""

from bridge.cli.main import main

main()
