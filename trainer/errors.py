"""Errors a user can fix, found inside the workers (a run folder not shared by every node, a
disk too full for the next checkpoint, a prompt longer than the model's context).

Raised on every rank alike (from decisions agreed over the group), printed by each rank as one
`error: ...` line and its exit code (2 for bad input); the launcher shows that line as the run's failure.
"""

from launcher.run_folder import BAD_INPUT_EXIT_CODE


class RunError(RuntimeError):
    """The message is the whole story, in one line: what, the value, and the fix."""

    def __init__(self, message: str, exit_code: int = BAD_INPUT_EXIT_CODE):
        super().__init__(message)
        self.exit_code = exit_code
