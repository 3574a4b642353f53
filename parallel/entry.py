"""How a failure reaches the user, for every entry point in launch/ (one wrapper, used by all of them).

    ConfigError         `config error: ...` in one line (rank 0 only under torchrun), exit status 2
    RunError            `error: ...` in one line, exit status 1
    WorkerFailed        the failed worker's traceback once, then `error: worker rank R failed: ...`, exit 1
    Interrupted, Ctrl-C `interrupted ...` in one line, exit status 130
    any other error     in a torchrun worker: one line (torchrun's summary has the traceback), exit 1;
                        elsewhere it is a bug and keeps its traceback
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

from parallel.config import ConfigError, RunError
from parallel.launcher import Interrupted, WorkerFailed, report_worker_error, under_torchrun


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def reported(main: Callable) -> Callable:
    """Wrap an entry point's body: errors are printed as the table above says, and the process exits with
    the status that goes with them (or with what `main` returns, when it returns a status)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            code = main(*args, **kwargs)
        except ConfigError as e:
            if _rank0():
                print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
        except RunError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        except WorkerFailed as e:
            print(f"{e.traceback}\nerror: {e}", file=sys.stderr)
            sys.exit(1)
        except Interrupted as e:
            print(e, file=sys.stderr)
            sys.exit(130)
        except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: one line, from one
            if _rank0():
                print("interrupted", file=sys.stderr)
            sys.exit(130)
        except Exception as e:
            if not under_torchrun():
                raise
            sys.exit(report_worker_error(e))
        if isinstance(code, int):
            sys.exit(code)
        return code

    return wrapper
