"""Run the user's script as ``__main__``, as ``python script.py`` would."""
from __future__ import annotations

import builtins
import importlib.machinery
import os
import runpy
import sys
import traceback
import types

from ..errors import SegmentDone

__all__ = ["run_main", "run_instrumented"]


def run_instrumented(path: str, code):
    """Run the instrumented `code` of `path` (hands-free mode) as ``__main__``."""
    from ..program.instrument import RUNTIME
    from . import handsfree

    # The globals `python script.py` gives a script: a script that reads
    # them (dir(__builtins__), __loader__) behaves as under plain python.
    main = types.ModuleType("__main__")
    main.__file__ = os.path.abspath(path)
    main.__builtins__ = builtins
    main.__cached__ = None
    main.__annotations__ = {}
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", main.__file__)
    main.__dict__[RUNTIME] = handsfree
    # Kept as __main__ after the run: objects the script defined pickle by name.
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


_FLOR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNPY = {runpy.__file__, "<frozen runpy>"}


def _users_frames(tb):
    """The traceback `tb` from the first frame that is not flor's or
    runpy's: what ``python script.py`` would show above the script's own."""
    first = tb
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.startswith(_FLOR + os.sep) or name in _RUNPY):
            return tb
        tb = tb.tb_next
    return first


def run_main(script, stderr, instrumented=None):
    """Run `script` as ``__main__`` (its `instrumented` code in hands-free
    mode), and return (exit status, the exception that ended it or None).
    A traceback (from the script's own frames), or the message of
    ``sys.exit("...")``, goes to `stderr` as Python would print it; Ctrl-C
    (KeyboardInterrupt) exits 130, as it does a shell's python."""
    try:
        if instrumented is not None:
            run_instrumented(script, instrumented)
        else:
            runpy.run_path(script, run_name="__main__")
    except SegmentDone:
        return 0, None
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=stderr)
            code = 1
        return code, (e if code else None)
    except BaseException as e:  # the script failed: report it as Python would
        traceback.print_exception(type(e), e, _users_frames(e.__traceback__), file=stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 1, e
    return 0, None
