"""The scheduler (and the shared protocol/config modules) must never import torch or transformers."""

from __future__ import annotations

import subprocess
import sys


def test_scheduler_side_never_imports_torch():
    code = (
        "import sys\n"
        "import crane_mp.config, crane_mp.protocol, crane_mp.scheduler.scheduler\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy.linalg') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
