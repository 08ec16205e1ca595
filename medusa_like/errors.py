"""Expected failures end a command with one line: around an entry point's work (a Hydra app's, a benchmark's, a Hydra
callback's), `one_line_errors` turns a bad input into `error: <message>` and exit status 1.

    with one_line_errors():
        train(cfg)

Expected failures (a missing file, a malformed dataset, a drafter for another target, a bad config value) are
`OSError`s and `ValueError`s; any other exception is a bug and keeps its traceback. `HYDRA_FULL_ERROR=1` shows the
full traceback for every error.
"""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

log = logging.getLogger(__name__)

EXPECTED_ERRORS = (OSError, ValueError)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Around an entry point's work: an expected failure ends the command with `error: <message>` and status 1."""
    try:
        yield
    except EXPECTED_ERRORS as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.debug("expected failure", exc_info=err)
        print(f"error: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        sys.exit(1)
