"""The HTTP layer, the scheduler and everything under engine/core must import and run without torch; the
one-process server without Ray."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import engine.core


def test_app_and_scheduler_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import app.server, app.__main__, engine.core.scheduler, engine.chooser, engine.core.fake_engine\n"
        "from engine import chooser\n"
        "from engine.core.config import EngineConfig\n"
        "chooser.build(EngineConfig(model='fake'))\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nothing_under_engine_core_imports_torch() -> None:
    modules = [f"engine.core.{info.name}" for info in pkgutil.iter_modules(engine.core.__path__)]
    assert "engine.core.planner" in modules and len(modules) >= 15
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
