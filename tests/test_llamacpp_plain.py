"""llama.cpp's plain decoding as the evaluation's method (l): left out with its reason where llama.cpp is not built,
converted once per set of weights by llama.cpp's own converter, and decoding the target's greedy tokens where built."""

import json
import logging
from pathlib import Path

import pytest
import torch

from eval.evaluate import evaluate
from medusa_like.engines.llamacpp import plain
from medusa_like.engines.llamacpp.runner import SERVER, executable
from medusa_like.evaluation.methods import LLAMACPP_PLAIN
from medusa_like.tiny import tiny_chat_target

BUILD = Path(__file__).resolve().parents[1] / ".llamacpp"


def needs(what: str):
    found = executable(BUILD, SERVER).is_file() if what == "server" else plain.converter(BUILD) is not None
    if not found:
        pytest.skip(f"llama.cpp's {what} is not here ({BUILD}); `make llamacpp-build` builds it")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (`make llamacpp-build`)")


@pytest.mark.slow
def test_named_but_not_built_it_is_left_out_and_the_report_says_why(tmp_path, eval_cfg, monkeypatch, caplog):
    monkeypatch.setenv("MEDUSA_LIKE_ROOT", str(tmp_path))  # where `default_cache` looks: no build there
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 12 times 7?"]}) + "\n")
    cfg = eval_cfg(f"data.path={questions}", "eval.max_new_tokens=4", "eval.sweep.prompts=0", "drafter.seed_store=0",
                   "tree=none", f"eval.methods=[hf_greedy,{LLAMACPP_PLAIN}]", f"out_dir={tmp_path / 'run'}",
                   "target.tuned_layers=false", "target.compile=false")  # fmt: skip
    with caplog.at_level(logging.WARNING):
        report = evaluate(cfg)
    assert f"names {LLAMACPP_PLAIN}, not run: llama.cpp is not built in {tmp_path / '.llamacpp'}" in caplog.text
    reason = report["setup"]["not_run"][LLAMACPP_PLAIN]
    assert (
        reason.startswith("llama.cpp is not built")
        and LLAMACPP_PLAIN not in report["speed"]["median_tokens_per_second"]
    )
    assert (
        f"Named but not run: (l) llama.cpp plain, same precision: {reason}"
        in (tmp_path / "run" / "report.md").read_text()
    )


def test_targets_llamacpp_cannot_run_get_a_reason_before_anything_is_built(tmp_path):
    target, _ = tiny_chat_target(num_layers=1)
    assert "not built" in plain.why_not(target, tmp_path)
    assert "no precision for a torch.float64 target" in plain.why_not(target.to(torch.float64), tmp_path)


@pytest.mark.slow
def test_each_set_of_weights_is_converted_once_into_a_file_named_by_them(tmp_path):
    """Same weights: the same file, not written again; another seed of the same config, or the same weights in
    bf16: a file of its own. (The build's sources are linked into an empty cache.)"""
    needs("converter")
    (tmp_path / "src").symlink_to(BUILD / "src")
    first, tokenizer = tiny_chat_target(num_layers=1, seed=0)
    path = plain.target_file(first, tokenizer, tmp_path)
    written = path.stat().st_mtime_ns
    again, _ = tiny_chat_target(num_layers=1, seed=0)
    assert plain.target_file(again, tokenizer, tmp_path) == path and path.stat().st_mtime_ns == written
    other, _ = tiny_chat_target(num_layers=1, seed=1)
    assert plain.target_file(other, tokenizer, tmp_path) != path
    half = plain.target_file(again.to(torch.bfloat16), tokenizer, tmp_path)
    assert half != path and half.name.endswith("-bf16.gguf")
    assert sorted(p.suffix for p in path.parent.iterdir()) == [".gguf", ".gguf", ".gguf", ".lock", ".lock", ".lock"]


@pytest.mark.slow
def test_it_decodes_the_targets_own_greedy_tokens(monkeypatch):
    """A tiny fp32 target in llama.cpp gives transformers' greedy tokens on every prompt, cut at the same EOS; the
    server is started once for every prompt."""
    needs("server")
    started = []

    class Counted(plain.LlamaServer):  # the real server, its starts counted
        def __enter__(self):
            started.append(self.port)
            return super().__enter__()

    monkeypatch.setattr(plain, "LlamaServer", Counted)
    target, tokenizer = tiny_chat_target(num_layers=2, seed=3)
    eos = [tokenizer.eos_token_id]
    run = plain.plain_runner(target, tokenizer, eos, threads=1, cache=BUILD)
    assert run is not None
    texts = ["Write a haiku about rain.", "What is 12 times 7?", "Name three colours.", "Say hello."]
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")["input_ids"]  # fmt: skip
        mask = torch.ones_like(ids)
        greedy = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos)
        tokens, stats = run(ids, 24)
        assert tokens == greedy[0, ids.shape[1] :].tolist() and stats is None
    assert len(started) == 1
