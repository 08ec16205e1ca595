"""Every external engine behind its one interface (`engines.engine.Engine`): its command, comparison app and config
exist, it says in one line whether it can run here, and llama.cpp's says why not where its build tools are missing."""

import importlib

import pytest
from hydra import compose, initialize_config_dir

from medusa_like.engines.llamacpp import runner
from medusa_like.engines.registry import ENGINES
from medusa_like.engines.run_stamp import batch_entry, machine

from .conftest import CONF


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_has_its_command_app_and_config_and_says_whether_it_runs_here(name):
    engine = ENGINES[name]
    assert engine.name == name and engine.what
    assert (CONF.parent / "eval" / f"{name}.py").is_file()
    app = importlib.import_module(f"medusa_like.apps.{name}_comparison")
    assert callable(app.main) and callable(getattr(app, f"compare_{name}"))
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(name, overrides=["drafter.path=somewhere"])
    assert cfg.task_name == name and name in cfg
    reason = engine.unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason and "\n" not in reason)


def test_llamacpp_is_unavailable_without_a_build_or_its_build_tools(tmp_path, monkeypatch):
    monkeypatch.setattr(runner.shutil, "which", lambda tool: None if tool == "ninja" else f"/usr/bin/{tool}")
    assert runner.unavailable_reason(tmp_path) == "building llama.cpp needs ['ninja'] on PATH"
    built = runner.executable(tmp_path)
    built.parent.mkdir(parents=True)
    built.touch()
    assert runner.unavailable_reason(tmp_path) is None  # built already: no tools needed


def test_a_report_reads_batch_sizes_back_from_json_and_names_the_machine():
    assert batch_entry({"8": {"tokens": 1}}, 8) == {"tokens": 1} and batch_entry({8: {"tokens": 2}}, 8) == {"tokens": 2}
    assert batch_entry({}, 32) is None
    assert machine().endswith(" cores")
