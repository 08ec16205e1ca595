"""The llama.cpp command line the opt-in run (`make llamacpp`) builds for each setting.

ggml's CPU thread pools busy-wait between graphs unless told otherwise; in speculative decoding the target's pool
then spins through the drafter's turn on a small CPU. Every pool the command creates must be told not to poll, with
the thread counts the config asks for. Where llama.cpp has been built here (`.llamacpp/`), its own `--help` must
list every flag the command passes.
"""

import subprocess
from pathlib import Path

import pytest

from medusa_like.evaluation.llamacpp_runner import PLAIN, Setting, executable, prompt_command

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [PLAIN, Setting("eagle3-q8_0 d3", "draft-eagle3", Path("drafter.gguf"), 3), Setting("lookup", "ngram-mod")]
# every ggml thread pool llama-speculative-simple can create: target and drafter, one token and batched
POLL_FLAGS = ("--poll", "--poll-batch", "--poll-draft", "--poll-batch-draft")
THREAD_FLAGS = ("-t", "-tb", "-td", "-tbd")


def options(command: list[str]) -> dict[str, str]:
    """Each flag of `command` mapped to the value after it (a flag given twice keeps its last value)."""
    return {flag: value for flag, value in zip(command, command[1:], strict=False) if flag.startswith("-")}


def command_for(setting: Setting, threads: int = 2) -> list[str]:
    return prompt_command(Path("bin"), Path("target.gguf"), "Hi", setting, threads, max_new_tokens=8, ctx_size=512)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_no_thread_pool_busy_waits(setting):
    given = options(command_for(setting))
    assert {flag: given.get(flag) for flag in POLL_FLAGS} == dict.fromkeys(POLL_FLAGS, "0")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_target_and_drafter_get_the_configured_threads(threads):
    given = options(command_for(SETTINGS[1], threads))
    assert {flag: given.get(flag) for flag in THREAD_FLAGS} == dict.fromkeys(THREAD_FLAGS, str(threads))
    assert given["--spec-type"] == "draft-eagle3" and given["--spec-draft-n-max"] == "3"


def test_the_built_llamacpp_accepts_every_flag_passed():
    binary = executable(ROOT / ".llamacpp")
    if not binary.is_file():
        pytest.skip(f"llama.cpp is not built here ({binary}); `make llamacpp` builds it")
    usage = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    listed = usage.stdout + usage.stderr
    flags = {arg for setting in SETTINGS for arg in command_for(setting) if arg.startswith("-")}
    unknown = sorted(flag for flag in flags if f"{flag} " not in listed and f"{flag}," not in listed)
    assert not unknown, f"llama-speculative-simple --help does not list {unknown}"
