"""Running a check under Triton's interpreter: in a fresh Python with TRITON_INTERPRET=1, which must be set before
triton is imported (kernels keep the mode they were defined under)."""

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def interpreted(check, *args):
    """Run `check(*args)` (a module-level function, its imports inside it) in a fresh Python under Triton's interpreter."""
    script = f"import torch\n{textwrap.dedent(inspect.getsource(check))}\n{check.__name__}(*{args!r})\n"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
