"""Errors a user can fix, found inside the workers (a run folder not shared by every node, a
disk too full for the next checkpoint, a prompt longer than the model's context).

Raised on every rank alike (from decisions agreed over the group), printed by each rank as one
`error: ...` line and exit code 2; the launcher shows that line as the run's failure.
"""


class RunError(RuntimeError):
    """The message is the whole story, in one line: what, the value, and the fix."""
