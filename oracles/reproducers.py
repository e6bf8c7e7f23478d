"""Runs the reproducers of a known-bugs registry (golden/known-oracle-bugs.toml,
golden/known-backend-bugs.toml): each returns True while the pinned stack still misbehaves.
Exit 0 when every named bug still shows, 1 when one no longer does (retire its entry), 2 when a
reproducer cannot run."""

import sys
import tomllib
from pathlib import Path


def run(registry: Path, reproducer_for) -> None:
    """Runs the reproducer `reproducer_for(entry)` of every entry of `registry` (or of the ids
    named on the command line), prints one line per bug and exits with the status above."""
    bugs = tomllib.loads(registry.read_text())["bug"]
    wanted = set(sys.argv[1:])
    status = 0
    for bug in bugs:
        if wanted and bug["id"] not in wanted:
            continue
        try:
            still = reproducer_for(bug)()
        except Exception as e:  # a reproducer that cannot run is an error, not a retirement
            print(f"ERROR   {bug['id']}: {type(e).__name__}: {e}")
            status = max(status, 2)
            continue
        print(f"{'still  ' if still else 'FIXED  '} {bug['id']}")
        if not still:
            status = max(status, 1)
    sys.exit(status)
