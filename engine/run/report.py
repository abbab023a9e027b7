"""How a program ends when something fails: a mistake in one line, a bug in one line and a log.

The ``delayq`` command and the jobs run their body through :func:`run_main`:

* a :class:`~engine.core.errors.DelayQError` (bad input, configuration or set-up) prints
  ``prog: error: <what and how to fix it>`` and exits 2;
* Ctrl-C before the engine handles it prints ``prog: interrupted`` and exits 130;
* anything else is a bug: one line on stderr naming the error and the log file that holds the
  whole traceback (Python and, for a Spark error, the JVM's), exit 70 (``EX_SOFTWARE``).

:func:`setup_logging` sends log records to the console one line each (the traceback of a
record logged with ``exc_info`` goes only to the log file) and to that file with everything.
The JVM's log (``conf/log4j2.properties``) follows the same rule: one line per event on the
console, stack traces in ``spark.log`` in the same folder.

The folder is ``$DELAYQ_LOG_DIR``, by default ``delayq-logs`` in the temporary directory
(``$TMPDIR`` or ``/tmp``). A log file is only created when something is written to it, and a
program removes its own files older than a week when it starts.

Example:
    >>> log_file = setup_logging("delayq")  # doctest: +SKIP
    >>> sys.exit(run_main("delayq", lambda: 1 // 0, log_file))  # doctest: +SKIP
    delayq: internal error (a bug): ZeroDivisionError: integer division or modulo by zero;
    the traceback is in <log dir>/delayq-20261124T040102-4242.log
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from engine.core.errors import DelayQError

#: Exit codes: a mistake to fix (input, configuration, set-up), an interrupt, a bug.
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BUG = 70
#: The environment variable that chooses the log folder.
LOG_DIR_ENV = "DELAYQ_LOG_DIR"
#: The JVM's log file in that folder (see ``conf/log4j2.properties``).
JVM_LOG = "spark.log"
#: A program's log files older than this many days are removed when it starts.
KEEP_DAYS = 7
#: Loggers too chatty at INFO for the log file.
QUIET_LOGGERS = ("py4j", "urllib3", "kafka")


def log_dir() -> Path:
    """The folder of the log files: ``$DELAYQ_LOG_DIR``, else ``<tmp>/delayq-logs``.

    Example:
        >>> os.environ[LOG_DIR_ENV] = "/var/log/delayq"
        >>> str(log_dir())
        '/var/log/delayq'
        >>> del os.environ[LOG_DIR_ENV]
    """
    chosen = os.environ.get(LOG_DIR_ENV)
    # The JVM's log4j configuration falls back the same way: $TMPDIR, else /tmp.
    return Path(chosen) if chosen else Path(os.environ.get("TMPDIR") or "/tmp") / "delayq-logs"


class OneLineFormatter(logging.Formatter):
    """Formats a record on one line: an exception is named, its traceback left out.

    Example:
        >>> f = OneLineFormatter("%(levelname)s %(message)s", log_file=Path("x.log"))
        >>> try:
        ...     1 // 0
        ... except ZeroDivisionError as err:
        ...     failed = (type(err), err, None)
        ...     record = logging.LogRecord("t", 40, "", 0, "round failed", None, failed)
        >>> f.format(record)
        'ERROR round failed (ZeroDivisionError: integer division or modulo by zero; see x.log)'
    """

    def __init__(self, fmt: str, log_file: Path | None) -> None:
        super().__init__(fmt)
        self.log_file = log_file

    def format(self, record: logging.LogRecord) -> str:
        if self.log_file is None:  # no log file: the traceback stays on the console
            return super().format(record)
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            line = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        line = line.splitlines()[0] if line else line
        error = saved[0][1] if saved[0] else None
        if error is not None:
            said = summary(error)
            # (a message that quotes the error already: name its class only)
            told = "" if said in line else f": {said}"
            line += f" ({type(error).__name__}{told}; see {self.log_file})"
        return line


def _not_py4j_call_noise(record: logging.LogRecord) -> bool:
    """Drop py4j's "... while sending command." records from the console: a Ctrl-C in the
    middle of a call to the JVM logs one or two of them before the program says it was
    interrupted, and a call that really failed is reported by the error it raises. They
    stay in the log file.

    Example:
        >>> noise = logging.LogRecord("root", 40, "/x/py4j/java_gateway.py", 1,
        ...                           "KeyboardInterrupt while sending command.", None, None)
        >>> _not_py4j_call_noise(noise)
        False
    """
    return not (
        record.pathname.replace("\\", "/").endswith("py4j/java_gateway.py")
        and str(record.msg).endswith("while sending command.")
    )


class _Console(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes (a test may swap it)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def setup_logging(prog: str, level: int = logging.WARNING) -> Path:
    """Log to the console (``level`` and up, one line each) and to a new file (INFO and up).

    Args:
        prog: the program's name, the start of the file's name.
        level: the console's level.

    Returns:
        The log file (created when the first record is written to it).

    Example:
        >>> setup_logging("delayq").name  # doctest: +SKIP
        'delayq-20261124T040102-4242.log'
    """
    folder = log_dir()
    log_file = folder / f"{prog}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_delayq", False):
            root.removeHandler(handler)
    handlers: list[logging.Handler] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _remove_old(folder, prog)
        to_file = logging.FileHandler(log_file, delay=True, encoding="utf-8")
        to_file.setLevel(logging.INFO)
        to_file.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
        )
        handlers.append(to_file)
    except OSError:  # no log folder: the console gets the tracebacks too
        pass
    console = _Console()
    console.setLevel(level)
    console.addFilter(_not_py4j_call_noise)
    shown = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    console.setFormatter(OneLineFormatter(shown, log_file if handlers else None))
    handlers.append(console)
    for handler in handlers:
        handler._delayq = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(min(level, logging.INFO))
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return log_file


def _remove_old(folder: Path, prog: str) -> None:
    """Remove ``prog``'s log files older than :data:`KEEP_DAYS`."""
    cutoff = time.time() - KEEP_DAYS * 86_400
    for old in folder.glob(f"{prog}-*.log"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another process removed it
            continue


def summary(error: BaseException) -> str:
    """One line saying what failed: the first line of the message that says something.

    A py4j error from Spark starts with ``An error occurred while calling o42.save.``; the
    line after it names the Java exception.

    Example:
        >>> summary(ValueError("bad value\\nmore detail"))
        'bad value'
    """
    lines = [line.strip().lstrip(": ").strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line and not line.startswith("An error occurred while")]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def report_bug(prog: str, error: BaseException, log_file: Path, err: TextIO | None = None) -> int:
    """Write ``error``'s traceback to ``log_file``, say so in one line, return :data:`EXIT_BUG`.

    Example:
        >>> report_bug("delayq", RuntimeError("boom"), Path("x.log"))  # doctest: +SKIP
        delayq: internal error (a bug): RuntimeError: boom; the traceback is in x.log
        70
    """
    where = log_file
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("a", encoding="utf-8") as out:
            out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {prog} failed with a bug:\n")
            out.write("".join(traceback.format_exception(error)))
            jvm_trace = getattr(error, "_stackTrace", None)  # a Spark error's Java side
            if jvm_trace:
                out.write(f"JVM stack trace:\n{jvm_trace}\n")
    except OSError:
        where = Path("<no log file: the traceback follows>")
        traceback.print_exception(error, file=err or sys.stderr)
    jvm_log = log_dir() / JVM_LOG
    also = f" (Spark's log: {jvm_log})" if jvm_log.exists() else ""
    print(
        f"{prog}: internal error (a bug): {type(error).__name__}: {summary(error)}; "
        f"the traceback is in {where}{also}",
        file=err or sys.stderr,
    )
    return EXIT_BUG


def run_main(prog: str, body: Callable[[], int], log_file: Path) -> int:
    """Run a program's body; return its exit code, or the one its failure calls for.

    Args:
        prog: the name errors start with.
        body: the program; returns its exit code.
        log_file: where a bug's traceback goes (from :func:`setup_logging`).

    Example:
        >>> run_main("delayq", lambda: 0, Path("x.log"))
        0
    """
    try:
        return body()
    except DelayQError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # a bug: one line here, the traceback in the log
        return report_bug(prog, error, log_file)


__all__ = [
    "EXIT_BUG",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "LOG_DIR_ENV",
    "OneLineFormatter",
    "log_dir",
    "report_bug",
    "run_main",
    "setup_logging",
    "summary",
]
