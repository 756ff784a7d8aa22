"""The one error class for refused input, and every exit status a job can end with.

[Note: bad input vs bugs]
A refusal (a config field with a bad value, a dataset or checkpoint that does not fit the job) is a
`UserInputError`: it is printed as one `error: ...` line, without a traceback, and the job exits
with `EXIT_BAD_INPUT`. Every other exception is a bug or a fault of the machine: it keeps its
traceback (with the rank that raised it) and the job exits with `EXIT_CRASH`. Never turn a builtin
`ValueError` from deep inside a library into a `UserInputError`: raise one where the input is
checked, naming the field, the bad value and the fix.
"""

from __future__ import annotations

EXIT_OK = 0  # finished: max_steps reached
EXIT_CRASH = 1  # an exception (a bug, a dead rank, a machine fault); its traceback is printed
EXIT_BAD_INPUT = 2  # refused input: one `error:` line names the field and the fix
EXIT_DIVERGED = 3  # a NaN/inf loss stopped the run before the optimizer step
EXIT_REQUEUE = 75  # stopped on a signal or the time limit after saving (EX_TEMPFAIL): requeue me


class UserInputError(ValueError):
    """Input the job refuses. The message names the field (or file), the bad value and the fix.

    It subclasses `ValueError` so config code that already raises `ValueError` for refusals can be
    moved over one place at a time; only `UserInputError` is caught as bad input."""


def record_status(status: int) -> None:
    """Append this process's exit status to $FRAMEWORK_STATUS_FILE when a launcher asks for it: a
    Kubernetes pod's entry reads the ranks' statuses, which torchrun's own exit status hides (see
    [Note: exit codes in a pod] in launcher_scripts/pod_entry.py)."""
    import os

    path = os.environ.get("FRAMEWORK_STATUS_FILE")
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        try:
            os.write(fd, f"{os.environ.get('RANK', '0')} {int(status)}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # the pod's entry then sees torchrun's status only
