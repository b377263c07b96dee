"""Run one command under one Prefect server: `python -m pipelines.prefect_session CMD [ARGS...]`.

Each stage reports its flow run to PREFECT_API_URL. Without one, a stage starts a server of its own and
stops it when its flow returns: ~8 s of every stage on a 2-core CPU (measured: `wait_for_health` 8.1 s of a
`pipelines.train` run), 13 times in the default DAG. `make repro` runs `dvc repro` (or the profile runner)
under this instead: one server for all its stages, started on a free port of 127.0.0.1 with its db under
PREFECT_HOME (default .prefect/, where the stages' own servers keep theirs), stopped when the command ends,
however it ends (it dies with this process, SIGKILL included). With PREFECT_API_URL already set (a shared
server, e.g. `make schedule`'s) the command runs as it is. Exits with the command's code.
"""

from __future__ import annotations

import subprocess
import sys

from pipelines.common import prefect_api


def main(argv: list[str] | None = None) -> int:
    cmd = list(sys.argv[1:] if argv is None else argv)
    if not cmd or cmd[0].startswith("-"):
        print("usage: python -m pipelines.prefect_session CMD [ARGS...]", file=sys.stderr)
        return 2
    with prefect_api():  # sets PREFECT_API_URL in this environment, which the command inherits
        try:
            proc = subprocess.Popen(cmd)
        except OSError as err:  # e.g. no such program
            print(f"error: cannot run {cmd[0]!r}: {err}", file=sys.stderr)
            return 2
        interrupted = False
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # Ctrl-C reached the command too (same process group): let it stop
                if interrupted:  # its own way; a second one stops it
                    proc.terminate()
                interrupted = True


if __name__ == "__main__":
    sys.exit(main())
