"""Whether this process's stderr is journald's stream: apart from the logging set-up
(nodeagent.logs) so that `nodeagent validate`, which needs only this answer, does not import
structlog (and asyncio with it): every CLI start pays for what it imports, ExecStartPre= too.
"""

from __future__ import annotations

import os
import sys


def stderr_is_the_journal() -> bool:
    """Whether fd 2 is the stream systemd connected to journald: $JOURNAL_STREAM holds its
    device and inode (systemd.exec(5)); a child whose stderr was redirected inherits the
    variable but not the stream, and must not prefix."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no real descriptor (captured, closed)
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))
