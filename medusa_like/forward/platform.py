"""What this machine can run fast: the compiler settings each device gets, native bf16, and why not where it can't.

    options, label = compile_settings(target)      # Inductor's config for this device, or CompileUnsupported(why)
    traced = traced_layers(module, tuned)           # the copy of a target or drafter the compiler traces
    native_bf16(device)                             # bf16 computed natively: CUDA, or a CPU with AMX / AVX512-BF16

On CPUs the compiled step freezes the weights and lets Inductor's C++ GEMM template compute the products
(`max_autotune` with the CPP backend alone; a product the template cannot compute falls back to ATen's packed linear):
the template packs each weight once and streams it at a few rows faster than ATen's packed linear and than eager BLAS
calls (`eval.bench products`; the figures in docs/cpu-kernels.md). With one choice a product, nothing is autotuned:
autotuning timed each product with its weight in cache, picked the template for every product of the default target,
and made the compile longer. Where torch's kernels run AVX512, the products of one input are
concatenated into one (`AVX512_OPTIONS`), and on every CPU the template's micro-kernels are declared noexcept
(`micro_kernels_noexcept`: the compiler then keeps their accumulators in registers). bf16 products on a CPU with a bf16
dot product (AVX512-BF16) run this project's kernel instead (`cpu/bf16_linear.py`): the template's bf16 products
multiply in fp32 and cost more than fp32's from five rows on. On CUDA the same graph runs under CUDA graphs, which
needs static shapes.
"""

import functools
import importlib.util
import platform

import torch
from torch import nn

from .cpu import bf16_linear
from .cpu.few_row_linear import onednn_bf16_packs_available, with_stock_linears


class CompileUnsupported(RuntimeError):
    """This platform cannot run the compiled step; the message says why (the eager step runs instead)."""


CPU_OPTIONS = {  # Inductor's options of the compiled step on CPUs
    "freezing": True,  # weights become constants: packed once for the GEMM template
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
}
# added where torch's CPU kernels run AVX512: the products of one input (q, k and v; gate and up) computed as one, which
# streamed the weights faster there at every row count measured, where on an AVX2-only CPU it was slower from 4 rows
# (`eval.bench products`; the figures in docs/cpu-kernels.md)
AVX512_OPTIONS = {"cpp.enable_concat_linear": True}


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 products are computed natively here (CUDA, or a CPU with AMX or AVX512-BF16)."""
    return device.type == "cuda" or (device.type == "cpu" and onednn_bf16_packs_available())


@functools.cache
def _cpp_compiler() -> str | None:
    """Why Inductor cannot build C++ kernels here, or None when it can (a C++ compiler on the PATH)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as err:  # Inductor raises several kinds when no compiler is found
        return f"no C++ compiler for Inductor ({err})"
    return None


@functools.cache
def parse_gemm_templates_once() -> None:
    """Inductor's C++ GEMM template parses its Jinja sources anew for every product it renders: thousands of parses
    for one forward of a 30-layer model, most of a CPU compile's time. The sources are constant strings, so the parsed
    template is kept per source (a Jinja template renders any number of times); the generated code is the same."""
    from torch._inductor.codegen.common import KernelTemplate

    parse = getattr(KernelTemplate, "_template_from_string", None)
    if parse is not None and not hasattr(parse, "cache_info"):
        KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=None)(parse))


# the end of the C++ GEMM template's micro-kernel signature (Inductor's `CppMicroGemmFP32Vec`, the kernel its fp32 and
# bf16 products run on AVX2 and AVX512 CPUs), and the same declared noexcept
MICRO_KERNEL_SIGNATURE_END = "    int64_t ldc\n) {"
NOEXCEPT_SIGNATURE_END = "    int64_t ldc\n) noexcept {"


@functools.cache
def micro_kernels_noexcept() -> bool:
    """Declare the C++ GEMM template's micro-kernels noexcept, so that the compiler keeps their accumulators in
    registers; whether the template now says so (False: this torch's template has another form, left as it is).

    The template computes a block of rows by a kernel function per row count. g++ inlines the small ones into the
    product's loop; in a kernel it does not inline (the 6-8-row ones of the 8 x 48 block it picks for fp32 on
    AVX512; AVX2's 4 x 24 kernels compile the same way when not inlined) it stores every accumulator to the stack at
    every step of the inner loop, because the function may throw. It cannot (loads, multiply-adds, stores), and
    declared noexcept it keeps them in registers: steps of more than four nodes get much cheaper, smaller ones stay
    as they were, and the logits stay bit for bit the same (docs/cpu-kernels.md, "The compiled step"; the A/B's
    figures are in that file's git history)."""
    import torch._inductor.kernel.mm  # noqa: F401  imports the GEMM templates in the order Inductor needs
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec

    template = getattr(CppMicroGemmFP32Vec, "TEMPLATE_KERNEL", "")
    if template.count(NOEXCEPT_SIGNATURE_END) == 1:
        return True
    if template.count(MICRO_KERNEL_SIGNATURE_END) != 1:
        return False
    CppMicroGemmFP32Vec.TEMPLATE_KERNEL = template.replace(MICRO_KERNEL_SIGNATURE_END, NOEXCEPT_SIGNATURE_END)
    return True


def compile_settings(target) -> tuple[dict, str]:
    """(Inductor options, a label for logs and cost models) of the compiled step for `target`'s device and dtype, or
    `CompileUnsupported` saying why it cannot run here."""
    device = target.device
    if device.type == "cpu":
        parse_gemm_templates_once()
        micro_kernels_noexcept()
        if platform.machine() not in ("x86_64", "AMD64"):
            raise CompileUnsupported(f"the C++ GEMM template is measured on x86 CPUs only, not {platform.machine()}")
        problem = _cpp_compiler()
        if problem:
            raise CompileUnsupported(problem)
        if target.dtype == torch.bfloat16 and bf16_linear.unavailable() is None:
            return dict(CPU_OPTIONS), f"inductor, {bf16_linear.LABEL}"
        if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            return {**CPU_OPTIONS, **AVX512_OPTIONS}, "inductor, C++ GEMM template, concatenated products"
        return dict(CPU_OPTIONS), "inductor, C++ GEMM template"
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise CompileUnsupported("Inductor needs triton on CUDA, which is not installed")
        return {"freezing": True, "triton.cudagraphs": True}, "inductor, CUDA graphs"
    raise CompileUnsupported(f"no compiled step for device {device.type!r}")


def traced_layers(module: nn.Module, tuned: bool) -> nn.Module:
    """What the compiler traces for `module` (a target, or a drafter beside it; `tuned`: its linear layers are this
    project's few-row ones): transformers' own layers (a copy sharing every weight, where few-row layers replaced
    them), and of those, the bf16 ones on a CPU that runs the dot-product kernel as `PackedLinear`s."""
    traced = with_stock_linears(module) if tuned else module
    if any(bf16_linear.runs_packed(child) for child in traced.modules()) and bf16_linear.unavailable() is None:
        return bf16_linear.with_packed_linears(traced)
    return traced
