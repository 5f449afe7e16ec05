"""The HTTP layer and the scheduler must import and run without torch; the one-process server without Ray."""

from __future__ import annotations

import subprocess
import sys


def test_app_and_scheduler_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import app.server, app.__main__, engine.scheduler, engine.chooser, engine.fake_engine\n"
        "from engine import chooser\n"
        "from engine.config import EngineConfig\n"
        "chooser.build(EngineConfig(model='fake'))\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
