"""What every `autotune` command shares: options, clean errors, atomic writes, output.

Expected failures (bad file, unreadable database, ...) print one line to stderr and
exit with status 1, never a traceback.
"""

from __future__ import annotations

import math
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from flashtune._env import interpreting
from flashtune.exceptions import FlashtuneError

NO_GPU = ("no CUDA GPU found: `autotune {cmd}` runs kernels. Run it on a machine with a CUDA "
          "GPU, or pass --interpret to use Triton's CPU interpreter (slow; its timings are "
          "not GPU timings).")

class FiniteRange(click.FloatRange):
    """A float range that also refuses NaN and infinities (which pass click's own range)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None,
                ) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


class LeadMs(click.ParamType):
    """"auto", or a GPU wait in ms from 0 to 1000 (:func:`flashtune.timing.lead_for`)."""

    name = "auto|ms"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None,
                ) -> Any:
        if isinstance(value, float) or value == "auto":
            return value
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and 0 <= ms <= 1000):
            self.fail(f"{value!r} is neither 'auto' nor a number of ms from 0 to 1000",
                      param, ctx)
        return ms


class PresetNames(click.ParamType):
    """One preset name, or several joined by commas (``standard,gpt2``): each must be a
    preset, none empty. The value stays the text; :func:`shape_set` splits it."""

    name = "preset[,preset...]"

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None,
                ) -> Any:
        parts = str(value).split(",")
        bad = [p for p in parts if p not in self.names]
        if bad:
            self.fail(f"{bad[0]!r} is not a preset; presets: {', '.join(self.names)} "
                      "(several: joined by commas)", param, ctx)
        return str(value)


# Seconds for budgets, timeouts and leases: positive, finite, at most 30 days.
SECONDS = FiniteRange(min=0, max=30 * 86400, min_open=True)
# Candidates per direction: a million is beyond any budget (one trial takes >= milliseconds).
TRIALS = click.IntRange(min=1, max=1_000_000)
# Optuna's samplers seed numpy's generator, which takes 0 .. 2**32 - 1.
SEED = click.IntRange(min=0, max=2**32 - 1)
# Problem sizes: what the kernels index in int32 within a head.
SIZE = click.IntRange(min=1, max=2**31 - 1)
# Input files (--shapes, --bench, import): a tuning export of every shape ever tuned is a
# few megabytes; a larger file is a mistake, and a special file could be read forever.
MAX_INPUT_BYTES = 64 << 20


def read_input(path: str, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular file (or stdin for '-'), at most ``limit``; OSError otherwise,
    naming the file: a FIFO, a device (/dev/zero) or a directory is refused unread."""
    if path == "-":
        data = sys.stdin.buffer.read(limit + 1)
    else:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: {what} must be a regular file")
        if st.st_size > limit:
            raise OSError(f"{path}: {what} is {st.st_size} bytes; the limit is {limit}")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path}: {what} is larger than the limit of {limit} bytes")
    return data


db_option = click.option(
    "--db", "db_url", metavar="URL", default=None,
    help="Database path or SQLAlchemy URL (default: $FLASHTUNE_DB, else tuning.db in the "
         "user data directory; `autotune info` shows it).")


def search_options(trials_help: str, time_help: str) -> Callable[[Any], Any]:
    """``--direction``, ``--trials`` and ``--time-budget``: what to tune and for how long."""
    def apply(fn: Any) -> Any:
        fn = click.option("--time-budget", type=SECONDS, default=None, metavar="S",
                          help=time_help)(fn)
        fn = click.option("--trials", type=TRIALS, default=None, help=trials_help)(fn)
        return click.option("--direction", type=click.Choice(["fwd", "bwd", "both"]),
                            default="both", show_default=True)(fn)
    return apply

# Seconds a SIGTERM or SIGINT may wait for the main thread before :func:`exit_when_stuck`
# ends the process (``FLASHTUNE_SIGNAL_GRACE``): longer than one implementation's timings
# of a long shape, or a FlexAttention compile, take.
SIGNAL_GRACE_S = 20.0


@contextmanager
def exit_when_stuck(report: Callable[[int], int]) -> Iterator[None]:
    """Within the block, a SIGTERM or SIGINT that the main thread has not acted on within
    ``$FLASHTUNE_SIGNAL_GRACE`` seconds (default :data:`SIGNAL_GRACE_S`) ends the process:
    ``report(signum)`` prints what was done so far and gives the exit status.

    Python runs its signal handlers (the KeyboardInterrupt of
    :func:`~flashtune.autotune.sweep.interrupt_on_sigterm`) only in the main thread, between
    two bytecodes. A main thread waiting on the GPU for a kernel that never ends (a
    barrier mistake hangs it) never gets there, so ``timeout``'s SIGTERM alone never ends
    the command, and what it measured is lost with the SIGKILL that follows. The C-level
    handler still writes the signal's number to the wakeup fd; a watcher thread reads it
    (torch and Triton release the GIL while they wait on the GPU)."""
    import signal
    import threading

    from flashtune._env import number

    grace = number("FLASHTUNE_SIGNAL_GRACE", SIGNAL_GRACE_S)
    grace = max(grace, 0.0) if math.isfinite(grace) else SIGNAL_GRACE_S
    r, w = os.pipe()
    os.set_blocking(w, False)
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    finished = threading.Event()
    lock = threading.Lock()  # held by whichever side ends the command

    def watch() -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data:
                    return  # the block ended
                sig = next((b for b in data if b in (signal.SIGTERM, signal.SIGINT)), None)
                if sig is not None:
                    break
        except OSError:
            return
        if finished.wait(grace):
            return
        with lock:
            if finished.is_set():
                return
            status = 128 + sig
            try:
                click.echo(f"no answer to {signal.Signals(sig).name} within {grace:g} s: the "
                           "main thread is blocked (waiting on a hung GPU kernel?); exiting "
                           "with what was done", err=True)
                status = report(sig)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)

    watcher = threading.Thread(target=watch, name="flashtune-signal-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:  # a watcher already reporting ends the process while we wait here
            finished.set()
        signal.set_wakeup_fd(old_fd)
        os.close(w)  # the watcher's read sees the end of the pipe
        watcher.join(timeout=5)
        if not watcher.is_alive():
            os.close(r)


@contextmanager
def json_stdout(enabled: bool) -> Iterator[Callable[[str], None]]:
    """Keep stdout for one JSON document: while it lasts (``enabled``), whatever else writes
    to this process's stdout (file descriptor 1), and every process started meanwhile,
    goes to stderr instead; the document goes out through the callable it yields. Triton,
    for one, prints a whole PTX listing to stdout when ptxas fails (a kill by a time limit
    included), which left ``autotune bench --json > out.json`` unreadable. Where stdout is
    not descriptor 1 (click's test runner), or without ``enabled``, the callable is
    ``click.echo`` and nothing is redirected."""
    try:
        real = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        real = False
    if not (enabled and real):
        yield click.echo
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)

    def emit(text: str) -> None:
        sys.stdout.flush()  # what was printed before goes out first, to stderr
        with os.fdopen(os.dup(saved), "w", encoding="utf-8") as f:
            f.write(text + "\n")

    try:
        yield emit
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextmanager
def clean_errors() -> Iterator[None]:
    """Turn expected failures into one line on stderr and exit status 1."""
    try:
        yield
    except (FlashtuneError, OSError) as e:
        text = " ".join(str(e).split()) or type(e).__name__
        raise click.ClickException(text) from None
    except Exception as e:
        # Optuna's storage (the tuner's study) and SQLAlchemy report a database that cannot
        # be written (read-only file, full disk, gone) with their own exceptions.
        if not type(e).__module__.startswith(("optuna", "sqlalchemy", "sqlite3")):
            raise
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        text = lines[0].strip() if lines else type(e).__name__
        raise click.ClickException(f"the database cannot be used: {text}") from None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, with the mode a
    plain ``open`` would give (0666 less the umask; mkstemp's own is 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def kernel_mode(cmd: str, interpret: bool) -> bool:
    """Choose GPU or Triton's interpreter before any kernel is defined; True = interpreter.

    TRITON_INTERPRET must be in the environment before flashtune.kernels is imported; if
    they were already imported without it, re-run this command in a fresh interpreter.
    """
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        mod = sys.modules.get("flashtune.kernels.attention")
        if mod is not None and not getattr(mod, "_INTERPRET", True):
            os.execv(sys.executable, [sys.executable, "-m", "flashtune.cli", *sys.argv[1:]])
    if interpreting():
        return True
    import torch

    if not torch.cuda.is_available():
        raise click.ClickException(NO_GPU.format(cmd=cmd))
    return False


def shape_set(preset: str | None, shapes: str | None, from_misses: bool,
               db_url: str | None) -> tuple[str, list[Any]]:
    """(description, problems) of the chosen shape set; the default is the standard preset."""
    from flashtune.autotune.presets import load_shapes
    from flashtune.autotune.presets import preset as get_preset

    chosen = [n for n, v in (("--preset", preset), ("--shapes", shapes),
                             ("--from-misses", from_misses)) if v]
    if len(chosen) > 1:
        raise click.UsageError(f"choose one shape set, got {' and '.join(chosen)}")
    try:
        if shapes:
            read_input(shapes, "a shapes file")  # a regular file of a sane size, or nothing
            return f"shapes file {shapes}", load_shapes(shapes)
        if from_misses:
            return "recorded misses", recorded_misses(db_url)
        name = preset or "standard"
        problems: list[Any] = []
        for part in name.split(","):  # several presets: their problems once each, in order
            problems += [p for p in get_preset(part) if p not in problems]
        return f"preset {name}", problems
    except (ValueError, OSError, FlashtuneError) as e:
        raise click.ClickException(" ".join(str(e).split())) from None


def recorded_misses(db_url: str | None) -> list[Any]:
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info
    from flashtune.exceptions import DatabaseMissingError

    try:
        with open_storage(db_url, read_only=True) as st:
            found = st.misses(device=device_info().fingerprint)
    except DatabaseMissingError:
        found = []
    if not found:
        raise ValueError("the database has no recorded dispatcher misses for this device; "
                         "run your model with flashtune first, or use --preset/--shapes")
    return [p for _, _, p in found]


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # A pipe or a file gets whole rows: wide tables wrap badly at rich's default 80 columns.
    width = None if stream.isatty() else 200
    return Console(file=stream, highlight=False, soft_wrap=False, width=width)


def shape_label(p: Any) -> str:
    return str(p.label())


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def shape_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    from flashtune.autotune.presets import PRESETS

    fn = click.option("--from-misses", is_flag=True,
                      help="The problems the dispatcher recorded as misses on this device.")(fn)
    fn = click.option("--shapes", type=click.Path(exists=True, dir_okay=False), default=None,
                      metavar="FILE", help="A YAML or JSON list of shapes (see docs).")(fn)
    fn = click.option("--preset", type=PresetNames(list(PRESETS)), default=None,
                      help="A named shape set, or several joined by commas (default: "
                           f"standard). Presets: {', '.join(PRESETS)}.")(fn)
    return fn


def where(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def db_file(url: str) -> str | None:
    """The SQLite file of ``url`` (None for a server or memory)."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    return os.path.abspath(u.database)
