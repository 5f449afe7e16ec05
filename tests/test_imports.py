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
        "import app.server.app, app.__main__, engine.core.scheduler, engine.chooser, engine.core.fake_engine\n"
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


def test_cluster_flags_without_ray_are_a_clear_error_naming_the_extra() -> None:
    code = (
        "import importlib.util as util\n"
        "real = util.find_spec\n"
        "util.find_spec = lambda name, *rest: None if name == 'ray' else real(name, *rest)\n"
        "from app.__main__ import main\n"
        "main(['--model', 'fake', '--replicas', '2'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert "pip install 'smolserve[cluster]'" in result.stderr and "--replicas" in result.stderr


def test_ray_is_an_extra_not_a_core_dependency() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("ray") for dep in project["dependencies"])
    assert any(dep.startswith("ray[serve]") for dep in project["optional-dependencies"]["cluster"])
