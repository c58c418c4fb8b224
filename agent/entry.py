"""The ``libreyolo-agent`` command (pyproject's console script): ``supervise``, which lives as long
as the job, enters :func:`agent.supervise.main` without the rest of the CLI; every other command
goes to :func:`agent.cli.main`."""

from __future__ import annotations

import sys


def main() -> int:
    if sys.argv[1:2] == ["supervise"]:
        from agent.supervise import main as supervise

        return supervise(sys.argv[2:])
    from agent.cli import main as cli_main

    return cli_main()
