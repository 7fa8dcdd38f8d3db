"""What the command line needs besides parsing: a Ctrl-C that always stops the run (and takes
back the files it wrote), and errors raised in the user's own code reported at their place.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT arrives. In a
weakref callback or a ``__del__`` (the profiler's saved-tensor bookkeeping has both), the
exception is printed as "Exception ignored in ..." and dropped, and the run went on to write its
file. So the handler also records the signal, the command checks that record between passes and
before every write, and a dropped interrupt is only late, never lost.
"""

from __future__ import annotations

import signal
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

_state = {"interrupted": False}
_written: list[Path] = []

# Frames in these installed packages are neither the user's model nor memfit: skipped when
# looking for where an error came from; torch's layers (torch/nn/modules/*.py) are the model's.
_LIBRARIES = ("torch", "ortools", "pulp", "pandas", "numpy", "tqdm", "matplotlib", "google")
_MEMFIT_DIR = Path(__file__).resolve().parent
_MODEL_FILES = {_MEMFIT_DIR / "zoo.py", _MEMFIT_DIR / "hf.py"}  # the built-in models
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def install_interrupt_handler() -> None:
    """From now on SIGINT raises KeyboardInterrupt and is remembered even if that is swallowed."""
    _state["interrupted"] = False
    _written.clear()

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        _state["interrupted"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    default_hook = sys.unraisablehook

    def quiet_dropped_interrupt(info: sys.UnraisableHookArgs) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt):  # that one is remembered: no noise
            default_hook(info)

    sys.unraisablehook = quiet_dropped_interrupt


def interrupted() -> bool:
    return _state["interrupted"]


def check_interrupt() -> None:
    """Raise KeyboardInterrupt if a SIGINT arrived, even one whose exception was swallowed."""
    if _state["interrupted"]:
        raise KeyboardInterrupt


def write_output(save: Callable[[Path], None], path: str | Path) -> None:
    """Write one output file of this run, unless the run was interrupted; remember it so that an
    interrupt later in the run removes it again."""
    check_interrupt()
    target = Path(path)
    save(target)
    _written.append(target.resolve() if target.is_symlink() else target)


def remove_outputs() -> None:
    """An interrupted run leaves no file of its own behind."""
    for path in _written:
        path.unlink(missing_ok=True)
    _written.clear()


def user_code_error(exc: BaseException) -> str | None:
    """A one-line report of an exception raised in the user's model, factory, loss or scenario
    module, naming the file and line; None when memfit's own code raised it (a bug: show the
    traceback). The deepest frame that is not library plumbing decides."""
    if isinstance(exc, SyntaxError) and exc.filename and _kind(exc.filename) == "model":
        return f"SyntaxError in {exc.filename}:{exc.lineno}: {exc.msg}"
    layer = None  # the deepest torch layer (nn.Linear.forward ...): reported if no user frame calls it
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        kind = _kind(frame.filename)
        if kind == "layer":
            layer = layer or frame
            continue
        if kind == "memfit":
            frame = layer
        if kind in ("memfit", "model"):
            if frame is None:
                return None
            text = str(exc).strip()
            message = text.splitlines()[0] if text else ""
            return f"{type(exc).__name__} in {frame.filename}:{frame.lineno} ({frame.name}): {message}"
    return None


def _kind(filename: str) -> str:
    """'model' (the user's code, a built-in model), 'layer' (a torch layer), 'memfit' or 'library'."""
    if filename.startswith("<"):
        return "library"
    path = Path(filename).resolve()
    if path in _MODEL_FILES:
        return "model"
    if path.is_relative_to(_MEMFIT_DIR):
        return "memfit"
    parts = path.parts
    if "site-packages" in parts or "dist-packages" in parts:
        package = parts[max(parts.index(p) for p in ("site-packages", "dist-packages") if p in parts) + 1]
        if package == "torch":
            layer = "nn" in parts and "modules" in parts and path.name != "module.py"
            return "layer" if layer else "library"
        return "library" if package in _LIBRARIES else "model"
    if path.is_relative_to(_STDLIB):
        return "library"
    return "model"

