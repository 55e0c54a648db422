"""One error type carrying an exit status, caught once in cli.main and printed as one line."""
from __future__ import annotations

EX_USAGE = 64  # sysexits: bad command-line input
EX_DATAERR = 65  # a session or file that is not what it claims to be
EX_NOINPUT = 66  # a session that does not exist
EX_UNAVAILABLE = 69  # a needed OS part (bcc, headers, tracefs) is missing
EX_SOFTWARE = 70
EX_IOERR = 74  # the session's disk failed or filled up
EX_TEMPFAIL = 75  # a session still being recorded: try again once it ends
EX_NOPERM = 77  # as the bcc tools: missing privileges


class KvprofError(Exception):
    def __init__(self, message: str, exit_code: int = 1, hint: str | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.hint = hint
