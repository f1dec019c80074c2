"""The one check that a directory is a Phorge checkout that can run, for the bench and tests.

``PHORGE_ROOT`` (the bench's ``--phorge-root``) names a Phorge checkout with arcanist
beside it; both the bench (``scripts/benchkit/phorge.py``, which runs ``bin/phd``) and
the PHORGE_ROOT tests (``tests/helpers/phorge_env.py``, which run ``bin/storage``,
``bin/worker`` and Phorge's own PHP) refuse early, with the reason, when it is not one,
or when PHP cannot run it. Each caller turns :class:`NotACheckout` into its own failure.

Only the standard library.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

# What a checkout has: its command-line tools, its library map, and arcanist's beside it.
REQUIRED = ("bin/phd", "bin/storage", "src/__phutil_library_map__.php")
ARCANIST_MAP = "arcanist/src/__phutil_library_map__.php"  # relative to the parent


class NotACheckout(Exception):
    """Phorge cannot run from the directory given; the message says what is missing."""


def check_checkout(root: Path | str, php_modules: Sequence[str] = ()) -> Path:
    """The checkout's resolved root, or :class:`NotACheckout` saying what is missing:
    files of the checkout or of arcanist, ``php`` itself, or the PHP extensions named in
    ``php_modules`` (``php -m``)."""
    root = Path(root).resolve()
    expected = [root / path for path in REQUIRED] + [root.parent / ARCANIST_MAP]
    missing = [str(path) for path in expected if not path.exists()]
    if missing:
        raise NotACheckout(
            f"PHORGE_ROOT={root} is not a Phorge checkout: missing {', '.join(missing)}"
        )
    if shutil.which("php") is None:
        raise NotACheckout(
            "php is not installed (apt-get install php-cli, or scripts/services.sh install)"
        )
    if php_modules:
        loaded = subprocess.run(["php", "-m"], capture_output=True, text=True).stdout.split()
        absent = [module for module in php_modules if module not in loaded]
        if absent:
            raise NotACheckout(f"PHP lacks {', '.join(absent)} (apt-get install php-mysql ...)")
    return root
