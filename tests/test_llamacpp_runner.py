"""The llama.cpp command line the opt-in run (`make llamacpp`) builds for each setting.

ggml's CPU thread pools busy-wait between graphs unless told otherwise; in speculative decoding the target's pool
then spins through the drafter's turn on a small CPU. Every pool the command creates must be told not to poll, with
the thread counts the config asks for. Where llama.cpp has been built here (`.llamacpp/`), its own `--help` must
list every flag the command passes.
"""

import subprocess
from pathlib import Path

import pytest

from medusa_like.engines.llamacpp.runner import PLAIN, SERVER, Setting, executable, prompt_command, run_prompt
from medusa_like.engines.llamacpp.server import run_batched, server_command

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


# ---------------------------------------------------------------------------------------------------------------------
# llama-server, for batches 8 and 32 (engines/llamacpp/server.py)


def server_for(setting: Setting | None, slots: int = 8, threads: int = 2) -> list[str]:
    return server_command(Path("bin"), Path("target.gguf"), setting, slots, 1024, threads, port=8123)


@pytest.mark.parametrize("setting", [None, *SETTINGS[1:]], ids=lambda s: "plain" if s is None else s.name)
def test_server_has_a_slot_per_request_and_no_busy_waiting(setting):
    given = options(server_for(setting, slots=32))
    assert given["-np"] == "32" and given["-c"] == str(32 * 1024)
    assert {flag: given.get(flag) for flag in POLL_FLAGS} == dict.fromkeys(POLL_FLAGS, "0")
    assert {flag: given.get(flag) for flag in THREAD_FLAGS} == dict.fromkeys(THREAD_FLAGS, "2")
    assert given.get("--spec-type") == (None if setting is None else setting.spec_type)


def test_plain_decoding_alone_keeps_ggmls_spinning_thread_pools():
    """The evaluation's method (l) runs llama.cpp as it ships: no polling flag, the same threads."""
    command = server_command(Path("bin"), Path("target.gguf"), None, 1, 1024, 2, port=8123, busy_wait=True)
    given = options(command)
    assert not any(arg.startswith("--poll") for arg in command)
    assert {flag: given.get(flag) for flag in THREAD_FLAGS} == dict.fromkeys(THREAD_FLAGS, "2")


def test_the_built_server_accepts_every_flag_passed():
    binary = executable(ROOT / ".llamacpp", SERVER)
    if not binary.is_file():
        pytest.skip(f"llama-server is not built here ({binary}); `make llamacpp` builds it")
    usage = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    listed = usage.stdout + usage.stderr
    flags = {arg for setting in [None, *SETTINGS] for arg in server_for(setting) if arg.startswith("-")}
    unknown = sorted(flag for flag in flags if f"{flag} " not in listed and f"{flag}," not in listed)
    assert not unknown, f"llama-server --help does not list {unknown}"


@pytest.mark.slow
def test_server_drafts_in_batches_and_is_lossless_alone(tmp_path):
    """The default target's GGUF in llama-server: n-gram drafting gives plain decoding's tokens one request at a time,
    and drafts and accepts at batch 1 and 3 on prompts that repeat themselves. (With several requests in flight, which
    rows share a target batch depends on timing, and llama.cpp's quantised products are not batch-invariant: equality
    there is reported by the benchmark, not asserted.)"""
    binary = executable(ROOT / ".llamacpp", SERVER)
    if not binary.is_file():
        pytest.skip(f"llama-server is not built here ({binary}); `make llamacpp` builds it")
    from transformers import AutoTokenizer

    from medusa_like.targets import default_target_dir, default_target_gguf

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    texts = ["one two three four " * 4 + "one two", "a b c d e f " * 4 + "a b", "red green blue " * 5 + "red"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    short_ngrams = ("--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "4")  # defaults: 12 and 48
    settings = [("plain", None), ("ngram", Setting("ngram", "ngram-simple", extra=short_ngrams))]
    plain, ngram = run_batched(binary, default_target_gguf(), prompts, settings, [1, 3], threads=2,
                               max_new_tokens=24, ctx_per_slot=256, log_dir=tmp_path)  # fmt: skip
    assert ngram.outputs[1] == plain.outputs[1]
    assert ngram.batches[1]["equal_to_plain"] == len(prompts)
    for size in (1, 3):
        assert plain.batches[size]["tokens"] > 0 and plain.batches[size]["drafted"] == 0
        assert ngram.batches[size]["accepted"] > 0 and ngram.batches[size]["drafted"] >= ngram.batches[size]["accepted"]


def test_output_cut_inside_a_utf8_character_is_parsed(tmp_path):
    """llama.cpp prints each token's bytes as it comes, so its output can hold half a UTF-8 character; the figures
    after it are still read."""
    fake = tmp_path / "llama-speculative-simple"
    fake.write_bytes(
        b"#!/bin/sh\nprintf 'caf\\303 \\217\\n'\n"
        b"printf 'encoded   12 tokens in    0.100 seconds\\ndecoded   8 tokens in    0.200 seconds\\n' >&2\n"
        b"printf 'n_drafted = 6\\nn_accept  = 3\\n' >&2\n"
    )
    fake.chmod(0o755)
    figures = run_prompt(fake, Path("target.gguf"), "Hi", PLAIN, threads=2, max_new_tokens=8, ctx_size=512,
                         lock=str(tmp_path / "lock"))  # fmt: skip
    assert figures == {"prompt_tokens": 12, "prompt_seconds": 0.1, "tokens": 8, "seconds": 0.2, "drafted": 6,
                       "accepted": 3}  # fmt: skip
