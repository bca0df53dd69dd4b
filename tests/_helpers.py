from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]



def run_fgrpo(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600):
    """Run the installed ``fgrpo`` console script as a user would."""
    exe = Path(sys.executable).with_name("fgrpo")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, env=full_env, cwd=cwd or ROOT, timeout=timeout
    )
