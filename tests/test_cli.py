from __future__ import annotations

import pytest

from app.server.cli import engine_config, parse_args, server_config


def test_defaults_serve_the_default_model_on_localhost_8000() -> None:
    args = parse_args([])
    assert (args.model, args.host, args.port) == ("SmolLM2-135M-Instruct", "127.0.0.1", 8000)
    assert args.max_batch_size >= 16
    assert args.dtype == "auto"
    assert args.served_model_name is None
    assert engine_config(args).kv_cache_dtype == "auto"


def test_flags_are_parsed() -> None:
    args = parse_args(["--model", "fake", "--port", "9001", "--served-model-name", "m", "--max-batch-size", "4"])
    assert (args.model, args.port, args.served_model_name, args.max_batch_size) == ("fake", 9001, ["m"], 4)


def test_served_model_names_and_the_embedding_model_flags() -> None:
    args = parse_args(["--served-model-name", "chat", "gpt-4o-mini", "--embedding-model-name", "emb", "e5",
                       "--embedding-model", "none", "--max-embedding-inputs", "16"])  # fmt: skip
    config = server_config(args)
    assert (config.served_model_name, config.model_aliases) == ("chat", ("gpt-4o-mini",))
    assert (config.embedding_model_names, config.max_embedding_inputs) == (("emb", "e5"), 16)
    assert engine_config(args).embedding_model == "none"
    defaults = parse_args([])
    assert engine_config(defaults).embedding_model == "default" and server_config(defaults).model_aliases == ()


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "int4"])


def test_kv_cache_dtype_reaches_the_engine() -> None:
    assert engine_config(parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "fp8"])


def test_quantization_and_prefix_caching_reach_the_engine() -> None:
    config = engine_config(parse_args(["--quantization", "native", "--no-prefix-caching"]))
    assert config.quantization == "native" and not config.prefix_caching
    defaults = engine_config(parse_args([]))
    assert defaults.quantization == "auto" and defaults.prefix_caching
    for mode in ("none", "int8"):
        assert engine_config(parse_args(["--quantization", mode])).quantization == mode
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "fp8"])


def test_threads_and_batch_invariance_reach_the_engine() -> None:
    defaults = engine_config(parse_args([]))
    assert defaults.threads is None and defaults.batch_invariant == "auto"
    config = engine_config(parse_args(["--threads", "3", "--batch-invariant", "on"]))
    assert config.threads == 3 and config.batch_invariant == "on"
    assert engine_config(parse_args(["--threads", "auto"])).threads is None
    for bad in (["--threads", "0"], ["--threads", "two"], ["--threads", "-1"], ["--batch-invariant", "yes"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_pinned_team_has_no_governor_and_auto_is_capped_by_omp_num_threads(monkeypatch) -> None:
    from engine.chooser import team_size, thread_team
    from engine.core import cpu
    from engine.core.config import EngineConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert team_size(EngineConfig(threads=5)) == 5
    assert team_size(EngineConfig()) == cpu.cpu_budget()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a cluster replica's share of the machine
    assert team_size(EngineConfig()) == 1
    import torch

    before = torch.get_num_threads()
    try:
        assert thread_team(EngineConfig(threads=1)) is None and torch.get_num_threads() == 1
        governor = thread_team(EngineConfig())
        assert governor is not None and governor.max_threads == 1
    finally:
        torch.set_num_threads(before)


def test_the_flag_table_in_docs_names_every_flag_and_its_default() -> None:
    """docs/operating.md's table of flags against the parser: the same flags, and where the table gives a plain
    default (a number or a backticked word), the parser's."""
    import re
    from pathlib import Path

    from app.server import cli

    actions = {opt: a for a in cli.build_parser()._actions for opt in a.option_strings if opt.startswith("--")}
    actions.pop("--help")
    table = (Path(__file__).resolve().parent.parent / "docs" / "operating.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `--")]
    documented: dict[str, str] = {}
    for cells in rows:
        for flag in re.findall(r"`(--[a-z-]+)`", cells[0]):
            documented[flag] = cells[1].strip()
    assert set(documented) == set(actions)
    for flag, default in documented.items():
        plain = re.fullmatch(r"`([\w.]+)`|(\d+(?:\.\d+)?)(?: \(.*\))?", default)
        if plain and actions[flag].default is not None:
            assert str(actions[flag].default).removesuffix(".0") == (plain.group(1) or plain.group(2)), flag


def test_several_chat_models_from_model_flags_and_a_folder(tmp_path) -> None:
    """``--model`` again and ``--models-dir`` (its GGUFs by name, after the ``--model`` ones, none twice); with
    several models ``--served-model-name`` gives one name each; the first model is the engine's."""
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("not a model")
    args = parse_args(["--model", str(tmp_path / "b.gguf"), "--models-dir", str(tmp_path), "--keep-alive", "0",
                       "--max-loaded-models", "1"])  # fmt: skip
    assert args.models == [(None, str(tmp_path / "b.gguf")), (None, str(tmp_path / "a.gguf"))]
    assert engine_config(args).model == str(tmp_path / "b.gguf")
    config = server_config(args)
    assert (config.keep_alive_s, config.max_loaded_models, config.served_model_name) == (0.0, 1, None)
    named = parse_args(["--model", "fake", "--model", "fake", "--served-model-name", "x", "y"])
    assert named.models == [(("x",), "fake"), (("y",), "fake")] and server_config(named).served_model_name == "x"
    assert parse_args(["--served-model-name", "x", "y"]).models == [(("x", "y"), "SmolLM2-135M-Instruct")]
    for bad in (["--model", "fake", "--model", "fake", "--served-model-name", "x"],
                ["--models-dir", str(tmp_path / "missing")],
                ["--model", "fake", "--model", "fake", "--replicas", "2"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)
