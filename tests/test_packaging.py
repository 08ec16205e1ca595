"""The package as a user installs it: a wheel built in isolation from the sources the package needs, installed into a
fresh virtual environment (no access to this environment's packages), first without extras, where every console
script names the extra it needs in one line, then with the `train` extra, where `medusa-train`, `medusa-export` and
`medusa-evaluate` run a tiny model from a temporary working directory outside the checkout.

Dependencies are pinned to the versions of this environment (so the fresh one runs what the rest of the suite tested,
torch's CPU build included, from the local wheels and package indexes pip is configured with); nothing else about the
installation is bypassed. Building that environment installs torch: minutes, so the test is marked `slow`.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import distributions
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from medusa_like.apps import EXTRA_HINT, MISSING_EXTRA_STATUS
from medusa_like.apps.config_checks import ConfigError
from medusa_like.apps.export import export
from medusa_like.targets import default_target_gguf

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("medusa-train", "medusa-evaluate", "medusa-tree-search", "medusa-export", "medusa-distill")
PACKAGE = "medusa_like"
# Run in the installed environment: calls each console script's entry point with --help, as the script would, and
# prints {script: [exit status, what it wrote to stderr]}; the library itself (`import medusa_like`) must import.
CALL_EVERY_SCRIPT = """
import contextlib, importlib.metadata, io, json, sys
import medusa_like
outcomes = {}
for entry in importlib.metadata.distribution("medusa_like").entry_points.select(group="console_scripts"):
    sys.argv, stderr, status = [entry.name, "--help"], io.StringIO(), 0
    with contextlib.redirect_stderr(stderr):
        try:
            entry.load()()
        except SystemExit as exit:
            status = exit.code
    outcomes[entry.name] = [status, stderr.getvalue()]
print(json.dumps(outcomes))
"""


def run(*cmd, cwd: Path, env: dict | None = None, expect: int = 0, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run `cmd` with this environment's variables less what would point Python at the checkout; assert its status."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR", "VIRTUAL_ENV")}
    result = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == expect, (
        f"{cmd} exited {result.returncode}, expected {expect}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def pinned_versions(path: Path) -> Path:
    """A pip constraints file pinning every distribution of this environment (this package excepted) to its version."""
    pins = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions() if d.metadata["Name"]}
    pins.pop(PACKAGE.replace("_", "-"), None)
    path.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    return path


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """The package's wheel, built with pip's build isolation (setuptools from the package index) from a copy of its
    sources (the checkout gets no build/ directory), beside wheels of everything it and its `train` extra depend on,
    in one resolution; the installs below read only this directory."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / PACKAGE, src / PACKAGE, ignore=ignore)
    shutil.copytree(ROOT / "conf", src / "conf", ignore=ignore)
    out = tmp_path_factory.mktemp("wheelhouse")
    pins = pinned_versions(out.parent / "pins.txt")
    run(sys.executable, "-m", "pip", "wheel", "-q", "-c", pins, "-w", out, f"{src}[train]", cwd=src)
    return out


@pytest.fixture(scope="module")
def wheel(wheelhouse) -> Path:
    (path,) = wheelhouse.glob(f"{PACKAGE}-*.whl")
    return path


@pytest.mark.slow
def test_wheel_ships_the_package_and_its_configs_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {PACKAGE}  # the checkout's benchmarks/, train/ and eval/ stay out
    assert not [n for n in names if "/benchmarks/" in n]
    configs = {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    assert {n.removeprefix(f"{PACKAGE}/conf/") for n in names if n.startswith(f"{PACKAGE}/conf/")} == configs
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / PACKAGE).rglob("*.py")}
    assert modules <= set(names), f"modules left out of the wheel: {sorted(modules - set(names))}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert all(f"{script} = {PACKAGE}.apps:" in text for script in SCRIPTS)


def install(python: Path, requirement, wheelhouse: Path) -> None:
    """Install `requirement` into the environment of `python` with this environment's pip (--python: the new one
    needs no pip of its own), from the wheelhouse alone; modules are compiled when first imported, not all at once."""
    pip = (sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile")
    run(*pip, "--no-index", "--find-links", wheelhouse, requirement, cwd=wheelhouse)


def write_inputs(tmp: Path) -> dict[str, Path]:
    """What a user brings: conversations to train on, questions to evaluate on, and a tokenizer directory (the
    default target's, read from its GGUF by this environment) for the tiny model."""
    chats = tmp / "chats.jsonl"
    rows = [
        {
            "id": str(i),
            "messages": [
                {"role": "user", "content": f"Count to {i}."},
                {"role": "assistant", "content": " ".join(map(str, range(i + 3)))},
            ],
        }
        for i in range(16)
    ]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    questions = tmp / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["Count to 5."]}) + "\n")
    gguf = default_target_gguf()
    tokenizer = tmp / "tokenizer"
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tokenizer)
    return {"chats": chats, "questions": questions, "tokenizer": tokenizer}


@pytest.mark.heavy  # three minutes of a core: a new environment, torch installed into it; in make test-all
def test_installed_wheel_names_its_extra_then_trains_exports_and_evaluates_outside_the_checkout(
    wheel, wheelhouse, tmp_path
):
    env_dir = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", env_dir, cwd=tmp_path)
    python, scripts = env_dir / "bin" / "python", env_dir / "bin"
    work = tmp_path / "work"
    work.mkdir()
    isolated = {"MEDUSA_LIKE_CACHE_DIR": str(tmp_path / "cache")}

    # 1. without extras: the library imports; every console script (its entry point, called as the script calls it)
    # says in one line which extra to install and exits 2, and so does one of the scripts run as a command
    install(python, wheel, wheelhouse)
    outcomes = json.loads(run(python, "-c", CALL_EVERY_SCRIPT, cwd=work, env=isolated).stdout)
    assert sorted(outcomes) == sorted(SCRIPTS)
    for script, (status, stderr) in outcomes.items():
        lines = stderr.strip().splitlines()
        assert status == MISSING_EXTRA_STATUS, (script, status, stderr)
        assert len(lines) == 1 and lines[0].startswith(f"error: {script} ") and EXTRA_HINT in lines[0], stderr
    result = run(scripts / "medusa-train", "--help", cwd=work, env=isolated, expect=MISSING_EXTRA_STATUS)
    assert result.stderr.strip() == outcomes["medusa-train"][1].strip()

    # 2. with the train extra, in the same environment
    install(python, f"{wheel}[train]", wheelhouse)
    inputs = write_inputs(tmp_path)
    tiny = ("model=tiny_llama", f"+model.loader.tokenizer={inputs['tokenizer']}")

    train_dir = tmp_path / "train"
    run(
        scripts / "medusa-train",
        "debug=fdr",
        *tiny,
        "drafter.module.aux_layer_ids=[0,1,2]",  # strictly increasing, as vLLM reads them (2 layers: default 1, 1, 0)
        "data=local",
        f"data.source={inputs['chats']}",
        "data.recipe=original",
        "data.val_fraction=0.25",
        "logger=none",
        "distill.progress=false",
        "export_drafter=true",
        f"hydra.run.dir={train_dir}",
        cwd=work,
        env=isolated,
    )
    sources = yaml.safe_load((train_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["config_sources"]
    main_source = next(c for c in sources if c["provider"] == "main")
    assert Path(main_source["path"]).is_relative_to(env_dir)  # the packaged configs, not the checkout's conf/
    drafter = train_dir / "drafter"
    assert (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file()
    assert (work / "data").is_dir()  # the data directory follows the working directory, not the package

    exported = tmp_path / "exported"
    run(
        scripts / "medusa-export",
        *tiny,
        f"drafter.path={drafter}",
        "format=eagle3",
        f"out={exported}",
        f"hydra.run.dir={tmp_path / 'export_run'}",
        cwd=work,
        env=isolated,
    )
    assert (exported / "config.json").is_file() and list(exported.glob("*.safetensors"))

    eval_dir = tmp_path / "eval"
    run(
        scripts / "medusa-evaluate",
        *tiny,
        f"drafter.path={drafter}",
        "drafter.mode=learned",
        "drafter.seed_store=0",
        "data.source=jsonl",
        f"data.path={inputs['questions']}",
        "tree=chain",
        "eval.max_new_tokens=8",
        "eval.sweep.prompts=0",
        "eval.warmup=false",
        "target.compile=false",  # the installed package, not the compiled step (tests/test_honest_eval.py)
        f"out_dir={eval_dir}",
        f"hydra.run.dir={tmp_path / 'eval_run'}",
        cwd=work,
        env=isolated,
    )  # exit 0: every method's tokens matched greedy decoding (a mismatch exits 1)
    report = json.loads((eval_dir / "report.json").read_text())
    assert report["summary"]["lossless"] is True, report["summary"]


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
