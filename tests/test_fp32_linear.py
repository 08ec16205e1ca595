"""The fp32 kernel of the eager few-row layers (forward/cpu/fp32_linear.py): fp32 products to rounding, the same
bits for a row at any row count and thread count, in its AVX512 and its AVX2 code alike, the layers that run it (oneDNN
for prompts), clear errors for inputs it does not take, and a failed build: the library falls back
with one line saying to what, the test suite fails with the compiler's error. Skipped where the CPU has no AVX2."""

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from medusa_like.forward import prepare_target
from medusa_like.forward.cpu import extension, fp32_linear, tree_attention
from medusa_like.forward.cpu.few_row_linear import (
    FP32_DOT,
    MAX_ROWS,
    ONEDNN,
    FewRowLinear,
    linear_kernel,
    onednn_packs_available,
    use_few_row_linears,
)
from medusa_like.model import MedusaLikeModel

from .conftest import at_one_and_two_threads, random_prompts, required_kernels, tiny_target

pytestmark = pytest.mark.skipif(fp32_linear.unavailable() is not None, reason=f"{fp32_linear.unavailable()}")

SHAPES = [(96, 64), (45, 37), (576, 1536), (33, 576), (1, 2)]  # [N, K]: N off the 32-output blocks
# the kernel as this CPU runs it (AVX512 where it has it), and its AVX2 code (what an AVX2-only CPU runs)
OPS = [fp32_linear.OP, fp32_linear.OP_AVX2]


def product(x, weight, bias=None, op=fp32_linear.OP):
    return fp32_linear.operator(op)(x, fp32_linear.pack(weight), bias, weight.shape[0])


def operands(n, k, rows=70, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_products_are_fp32_products_to_rounding(shape, op):
    x, weight, bias = operands(*shape)
    for b in (None, bias):
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())  # [M, N]
        # what the sum's roundings scale with: K + 1 additions, each off by at most half a unit of the running sum
        scale = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
        assert ((product(x, weight, b, op).double() - exact).abs() <= scale * (shape[1] + 1) * 2**-24).all()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_gets_the_same_bits_at_any_row_count(shape, op):
    x, weight, bias = operands(*shape)
    every = product(x, weight, bias, op)  # [70, N]
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, 31, 64):
        assert torch.equal(product(x[:rows], weight, bias, op), every[:rows])
    assert torch.equal(product(x[5:6], weight, bias, op), every[5:6])  # a row alone, taken from the middle
    assert torch.equal(product(x[None, :9], weight, bias, op)[0], every[:9])  # leading dims are rows too


@pytest.mark.parametrize("shape", SHAPES)
def test_avx512_and_avx2_cpus_compute_the_same_bits(shape):
    """Each output is one fused multiply-add a k, in order, in either vector width: a tree's tokens do not depend on
    which kind of CPU verified it (on an AVX2-only CPU both ops run the AVX2 code, and the check holds trivially)."""
    x, weight, bias = operands(*shape)
    for b in (None, bias):
        assert torch.equal(product(x, weight, b), product(x, weight, b, fp32_linear.OP_AVX2))


@pytest.mark.parametrize("op", OPS)
def test_the_thread_count_changes_no_bit(op):
    one, two = at_one_and_two_threads(product, *operands(576, 1536), op)
    assert torch.equal(one, two)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, p, b, n: (x.bfloat16(), p, b, n), "must be float32"),
        (lambda x, p, b, n: (x, p[:, :-1].contiguous(), b, n), "is not of a"),
        (lambda x, p, b, n: (x, p.transpose(1, 2), b, n), r"contiguous \[N / 32, K, 32\]"),
        (lambda x, p, b, n: (x, p, b[:-1], n), "bias of"),
        (lambda x, p, b, n: (x, p, b, n + 40), "is not of a"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("op", OPS)
def test_inputs_it_does_not_take_are_refused_with_what_is_wrong(change, message, op):
    x, weight, bias = operands(45, 37, rows=3)
    with pytest.raises(RuntimeError, match=message):
        fp32_linear.operator(op)(*change(x, fp32_linear.pack(weight), bias, 45))


def test_fp32_layers_run_it_for_a_steps_rows_and_onednn_or_f_linear_for_a_prompts():
    """fp32 few-row layers keep the fp32 pack (and oneDNN's, for prompts, where it runs), compute up to MAX_ROWS rows
    on the kernel and more on oneDNN or F.linear, and say so in `linear_kernel` (what a cost model is keyed by); a
    compiled step's prompt reader (`fp32_kernel=False`) makes no fp32 pack."""
    target = tiny_target("llama")
    use_few_row_linears(target, fp32_kernel=False)
    assert all(
        not m.fp32_kernel and FP32_DOT not in m.packs.packs for m in target.modules() if isinstance(m, FewRowLinear)
    )
    use_few_row_linears(target)  # a target whose eager step decodes
    layers = [m for m in target.modules() if isinstance(m, FewRowLinear)]
    onednn = onednn_packs_available()
    assert layers and all(m.fp32_kernel and set(m.packs.packs) >= {FP32_DOT, *([ONEDNN] * onednn)} for m in layers)
    assert linear_kernel(target) == "few_row"
    layer = layers[0]
    for rows, op in [(1, "medusa_like::fp32_linear"), (MAX_ROWS, "medusa_like::fp32_linear"), (MAX_ROWS + 1, None)]:
        x = torch.randn(rows, layer.in_features)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            y = layer(x)
        ran = {event.key for event in profile.key_averages()}
        assert (op in ran) if op else ("medusa_like::fp32_linear" not in ran)
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_eager_fp32_tree_decoding_on_it_equals_the_targets_greedy(family):
    """The eager fp32 step (the Python API's default) on the kernel and `rows` attention: plain decoding, lookup,
    Medusa-style and chain trees give transformers' own greedy tokens of an untouched copy, every prompt (exact at any
    row count, not only up to near-ties; the bit-level check is tests/test_tree_attention.py's)."""
    from medusa_like.decoding.tree import BudgetedTreeSpec
    from medusa_like.drafters.lookup import LookupDrafter

    from .conftest import random_heads, stock_greedy, untouched_target

    prepared = prepare_target(tiny_target(family), compile=False)
    assert prepared.backend == "rows"
    heads = random_heads()
    prompts = random_prompts(6, seed=3, min_len=10, max_len=80)
    references = [torch.tensor(tokens) for tokens in stock_greedy(untouched_target(family), prompts, 30)]
    plain = MedusaLikeModel(prepared, None, heads)
    for prompt, reference in zip(prompts, references, strict=True):
        assert torch.equal(
            plain.generate(prompt, max_new_tokens=30, tree="none", eos_token_id=[]).new_tokens, reference
        )
    for drafter, tree in [(LookupDrafter(), BudgetedTreeSpec(None, 12, 8)), (heads, "medusa"), (heads, "chain")]:
        model = MedusaLikeModel(prepared, None, drafter)
        for prompt, reference in zip(prompts, references, strict=True):
            out = model.generate(prompt, max_new_tokens=30, tree=tree, eos_token_id=[], remember=False)
            assert torch.equal(out.new_tokens, reference)


@pytest.mark.slow
def test_a_first_process_builds_it_in_the_background_and_a_failed_build_is_not_tried_again(tmp_path, monkeypatch):
    """Where no build is cached, `unavailable` says so at once and starts one in a detached process (the Python API's
    first call does not wait for it), which leaves the library for later processes; a build that failed is named by
    later processes and not started again."""
    monkeypatch.setenv("MEDUSA_LIKE_CACHE_DIR", str(tmp_path))
    kernels = (fp32_linear.KERNEL, tree_attention.KERNEL)  # the products' and the attention's
    assert not any(k.built() for k in kernels)
    assert "being built" in fp32_linear.unavailable.__wrapped__()
    deadline = time.monotonic() + 300
    while not all(k.built() for k in kernels) and time.monotonic() < deadline:
        time.sleep(1)
    assert all(k.built() and k.build_failure() is None for k in kernels)
    kernel = fp32_linear.KERNEL
    (kernel.directory() / extension.BUILD_FAILED).write_text("a compiler error")
    monkeypatch.setattr(extension.subprocess, "Popen", lambda *a, **k: pytest.fail("a failed build started again"))
    assert fp32_linear.unavailable.__wrapped__() == "the fp32_linear kernel could not be built (a compiler error)"


# A C++ compiler whose every compile fails, as a broken toolchain's would; anything else it is asked (its version)
# the real one answers.
BROKEN_COMPILER = """#!/bin/sh
for arg in "$@"; do
  if [ "$arg" = "-c" ]; then echo "fp32_linear.cpp:1:1: error: a deliberately broken compiler" >&2; exit 1; fi
done
exec c++ "$@"
"""


@pytest.mark.slow
@pytest.mark.skipif(not required_kernels(), reason="not a machine meant to build the kernels (x86, AVX2, c++)")
def test_a_kernel_that_fails_to_build_fails_the_suite_with_the_compilers_error(tmp_path):
    """The test suite on a broken compiler, with a cache of its own (nothing built yet): it stops before any test
    with the compiler's error, rather than running with the kernels' tests skipped and SDPA attending."""
    compiler = tmp_path / "c++"
    compiler.write_text(BROKEN_COMPILER)
    compiler.chmod(0o755)
    session = ("PYTEST_CURRENT_TEST", "MEDUSA_LIKE_CACHE_DIR", "MEDUSA_LIKE_TEST_KERNELS")  # this session's cache
    env = {key: value for key, value in os.environ.items() if key not in session} | {"CXX": str(compiler)}
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "tests/test_io.py"]
    run = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, output[-2000:]
    assert "the fp32_linear kernel could not be built" in output and "error: a deliberately broken compiler" in output
    assert " passed" not in output  # no test ran


def test_a_failed_build_falls_back_with_one_line_saying_to_what_and_why(tmp_path, monkeypatch, caplog):
    """A build that failed here (kept in its build directory) leaves the eager fp32 step on nn.Linear and SDPA,
    logged once as one warning that names the kernel, the compiler's line and the fallback."""
    monkeypatch.setenv("MEDUSA_LIKE_CACHE_DIR", str(tmp_path))
    directory = fp32_linear.KERNEL.directory()
    directory.mkdir(parents=True)
    (directory / extension.BUILD_FAILED).write_text("fp32_linear.cpp:1:1: error: a deliberately broken compiler")
    with caplog.at_level(logging.INFO):
        why = fp32_linear.unavailable.__wrapped__()
    assert (
        why == "the fp32_linear kernel could not be built (fp32_linear.cpp:1:1: error: a deliberately broken compiler)"
    )
    lines = [record for record in caplog.records if record.name == fp32_linear.__name__]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    message = lines[0].getMessage()
    assert message.startswith(why) and "nn.Linear" in message and "SDPA" in message and "\n" not in message
