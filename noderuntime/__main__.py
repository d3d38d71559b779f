"""``python -m noderuntime`` and the ``noderuntime`` console script: the command line.

A tracker replaces itself with one whose Python objects live on the C allocator
(:func:`noderuntime.operations.memory.system_allocator_environ`) before anything else is
imported: after the command line's imports the same re-execution cost 0.6 s of CPU at
every tracker's start.
"""

import os
import sys


def run() -> int:
    """Run the command named in ``sys.argv``."""
    # httpx imports its own command-line client (rich, click, pygments) wherever they are
    # installed: 40-70 ms of CPU at every start, for a client no command runs. An import
    # that finds None here fails, and httpx falls back to a stub for that case
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    argv = sys.argv[1:]
    words = [a for a in argv if a not in ("-v", "--verbose")]
    if words[:1] == ["tracker"] and not {"-h", "--help"} & set(argv):
        from noderuntime.operations.memory import system_allocator_environ

        environ = system_allocator_environ()
        if environ is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(sys.executable, [sys.executable, "-m", "noderuntime", *argv], environ)
    from noderuntime.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
