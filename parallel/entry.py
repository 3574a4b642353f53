"""How a failure reaches the user, for every entry point in launch/ (one wrapper, used by all of them).

    ConfigError         `config error: ...` in one line (rank 0 only under torchrun), exit status 2
    RunError            `error: ...` in one line, exit status 1
    WorkerFailed        the failed worker's traceback once, then `error: worker rank R failed: ...`, exit 1
    Reported            the failed workers have said why, one line each (out of GPU memory): nothing more, exit 1
    Interrupted, Ctrl-C `interrupted ...` in one line, exit status 130
    Preempted           `preempted (SIGTERM): saved step N in ...` in one line, exit status 75 (Note [preemption])
    any other error     in a torchrun worker: one line (torchrun's summary has the traceback), exit 1;
                        elsewhere it is a bug and keeps its traceback
"""
from __future__ import annotations

import atexit
import difflib
import functools
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Callable, NoReturn

from parallel.config import ConfigError, RunError
from parallel.launcher import Interrupted, Reported, WorkerFailed, ran_a_worker, report_worker_error, under_torchrun
from parallel.preemption import PREEMPTED, Preempted


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


# `group=option` on the command line (a sweep's `a,b` too); not `+group=`, `~group`, `group.key=` or a sweep function.
_CHOICE = re.compile(r"^(?P<group>[a-z_]+)=(?P<options>[\w.,/-]+)$")


def check_choices(argv: list[str], conf: Path) -> None:
    """A config group's option that no config file holds, as a ConfigError naming the valid ones (Hydra's own
    message says the same in a paragraph, exit status 1): before Hydra composes anything. The groups are conf/'s
    folders; a `--config-dir DIR` (`-cd`) adds its own options. Then the settings' keys and values
    (`check_settings`)."""
    dirs = [conf]
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(Path(argv[i + 1]))
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.partition("=")[2]))
    for arg in argv:
        m = _CHOICE.match(arg)
        if m is None or not any((d / m["group"]).is_dir() for d in dirs):
            continue
        valid = sorted({p.stem for d in dirs if (d / m["group"]).is_dir() for p in (d / m["group"]).glob("*.yaml")})
        for option in m["options"].split(","):
            if option not in valid:
                raise ConfigError(f"{m['group']}={option}: no such {m['group']} (valid: {', '.join(valid)})")
    check_settings(argv, {p.name for d in dirs if d.is_dir() for p in d.iterdir() if p.is_dir()})


# `key=value` setting a config value (not `+key=`, `~key`, a flag or a group's option, which _CHOICE reads).
_SETTING = re.compile(r"^(?P<key>[a-z_]\w*(?:\.\w+)*)=(?P<value>.*)$")


def check_settings(argv: list[str], groups: set[str] = frozenset()) -> None:
    """A setting of a key no schema has, or of a value its type cannot take (`trainer.stepz=5`,
    `trainer.steps=abc`, `plan.by_module=maybe`), as a ConfigError naming the key, the rule and the valid keys
    (Hydra's own message says it in a paragraph, exit status 1): before Hydra composes anything. The groups
    that take keys beyond their schema (a `_target_`'s arguments, the strategy's keys) are checked where they
    are read; a sweep (`a,b`), a sweep function, an interpolation or a quoted value is left to Hydra.
    `groups`: the config groups, whose `group=option` check_choices reads."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, ValidationError

    from parallel.config import schema

    root = schema()
    for arg in argv:
        m = _SETTING.match(arg)
        if m is None or m["key"].startswith("hydra.") or m["key"] in groups:
            continue
        key, value = m["key"], m["value"]
        swept = "," in value and not (value.startswith("[") and value.endswith("]"))
        if not value or swept or any(c in value for c in "()$'\"*?"):
            continue
        try:
            OmegaConf.merge(root, OmegaConf.from_dotlist([arg]))
        except ConfigKeyError:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(root, parent) if parent else root
            fields = [str(k) for k in node.keys()] if node is not None else []
            close = difflib.get_close_matches(leaf, fields, n=1)
            hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
            raise ConfigError(f"{key}={value}: no such key{f' of {parent}' if parent else ''}{hint} (valid: "
                              f"{fields})") from None
        except ValidationError as e:
            raise ConfigError(f"{key}={value}: {str(e).splitlines()[0]}") from None


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
        except Reported:
            sys.exit(1)
        except Interrupted as e:
            print(e, file=sys.stderr)
            sys.exit(130)
        except Preempted as e:
            if _rank0():
                print(e, file=sys.stderr)
            sys.exit(PREEMPTED)
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


# Note [ending a worker]
# A process that has run a worker (parallel.launcher._work) ends without the
# interpreter's finalization. Finalization destroys what is still alive in an
# order nobody controls: C++ objects of torch.distributed (gloo's worker threads
# holding asynchronous work and its tensors, whose release needs the GIL) may go
# after the interpreter has started tearing down, and the process aborts after
# its run has ended ("terminate called without an active exception", SIGABRT,
# exit status 1 instead of 0). The worker already releases its run and drains the
# group before destroying it (launcher._close_group); ending with os._exit once
# everything is written removes the hazard, and ~1 s of teardown, by
# construction. Nothing is lost: the run's files are closed, @record has written
# a failed worker's error file before the exception reached the wrapper, the
# atexit handlers (logging's flush among them) run, and stdout and stderr are
# flushed. A process that ran no worker (a config error, --cfg) exits normally.
# Forked workers already end this way (multiprocessing's fork ends with os._exit).


def exit_with(main: Callable) -> NoReturn:
    """Run an entry point (wrapped by `reported`) and exit with its status: Note [ending a worker]."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if not ran_a_worker():
            raise
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        if not ran_a_worker():
            raise
        traceback.print_exc()
        code = 1
    if not ran_a_worker():
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter would run first at exit (logging.shutdown flushes the logs)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written to it
            pass
    os._exit(code)
