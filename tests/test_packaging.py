"""The package installs from a wheel and runs from any directory: configs inside, console scripts, no `train`/`eval`.

The wheel is built from a copy of the sources that the package needs (pyproject.toml, setup.py, README.md,
medusa_like/, conf/), installed into a fresh virtual environment that sees this environment's dependencies through a
.pth file, and run from a temporary directory outside the checkout.
"""

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from medusa_like.apps.export import export
from medusa_like.cli import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("medusa-train", "medusa-evaluate", "medusa-tree-search", "medusa-export", "medusa-distill")


def run(*cmd, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{cmd} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the package's sources (the checkout gets no build/ directory)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "medusa_like", src / "medusa_like", ignore=ignore)
    shutil.copytree(ROOT / "conf", src / "conf", ignore=ignore)
    out = tmp_path_factory.mktemp("wheels")
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, src, cwd=src)
    (path,) = out.glob("medusa_like-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed; dependencies come from this environment's site-packages."""
    env_dir = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", "--without-pip", env_dir, cwd=env_dir)
    python = env_dir / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=env_dir).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=env_dir)
    return env_dir


@pytest.mark.slow
def test_wheel_ships_the_package_and_its_configs_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"medusa_like"}
    configs = {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    assert {n.removeprefix("medusa_like/conf/") for n in names if n.startswith("medusa_like/conf/")} == configs
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "medusa_like").rglob("*.py")}
    assert modules <= set(names), f"modules left out of the wheel: {sorted(modules - set(names))}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert all(f"{script} = medusa_like.apps." in text for script in SCRIPTS)


@pytest.mark.slow
def test_installed_console_script_trains_a_drafter_outside_the_checkout(venv, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    help_text = run(venv / "bin" / "medusa-train", "--help", cwd=work).stdout
    assert "Powered by Hydra" in help_text and "tiny_llama" in help_text  # the packaged config groups are listed

    run_dir = tmp_path / "run"
    run(
        venv / "bin" / "medusa-train",
        "debug=fdr",
        "model=tiny_llama",
        "data=tiny",
        "logger=none",
        "distill.progress=false",
        "export_drafter=true",
        f"hydra.run.dir={run_dir}",
        cwd=work,
    )
    config_sources = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"][
        "config_sources"
    ]
    main_source = next(c for c in config_sources if c["provider"] == "main")
    assert Path(main_source["path"]).is_relative_to(venv)  # the packaged configs, not the checkout's conf/
    drafter = run_dir / "drafter"
    assert (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file()
    assert (work / "data").is_dir()  # the data directory follows the working directory, not the package


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dtype=bfloat", "config key dtype: expected a torch floating-point dtype name"),
        ("model.dtype=int8", "config key model.dtype: expected a torch floating-point dtype name"),
        ("overwrite=yes", "config key overwrite: expected true or false, got 'yes'"),
    ],
)
def test_export_checks_its_config_before_loading_anything(tmp_path, export_cfg, override, message):
    cfg = export_cfg("drafter.path=/nonexistent", override)
    with pytest.raises(ConfigError, match=message):
        export(cfg)
    assert not (tmp_path / "config.yaml").exists()  # refused before the run wrote anything
