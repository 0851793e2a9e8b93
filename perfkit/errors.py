"""User-facing errors.

A `PerfkitError` is bad input or a missing capability the user can fix (a malformed config, an impossible
workload, a GPU feature that is absent). The CLI prints its message on one line and exits with code 2, without a
traceback. Anything else is a bug and keeps its traceback.
"""


class PerfkitError(Exception):
    """User-facing error: the CLI prints its message on one line and exits 2."""
