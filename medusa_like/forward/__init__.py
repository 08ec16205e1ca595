"""The target's forward on this machine: the one room for what depends on the hardware, above the decoding core.

    prepared = prepare_target(target, compile="auto")   # the target prepared for this machine and dtype
    prepared.step                                       # its forward over n nodes (a `decoding.step.TargetStep`)
    prepared.cost_model()                               # this machine's cost model of that step
    prepared.use_profile(read_profile("profile.json"))  # run as a machine profile says (`profile.py`)

What lives here: the CPU kernels of an eager step's few rows (`cpu/`: few-row layers over this project's fp32 and
bf16 kernels, row-invariant tree attention), the compiled step (`compiled.py`, with `platform.py` saying what each device gets), the
cost model's measurement and on-disk cache (`cost_measure.py`, `cost_cache.py`), and the machine profile the tree
search writes and a model is handed (`profile.py`). The decoding loop, the drafters and the evaluation ask this room's
interface (`prepared.py`) and never name a kernel; the decoding core holds the cost model as plain data
(`decoding/cost_model.py`) and never imports this package.
"""

from .compile_cache import PROFILER_NAME
from .cpu import bf16_linear, fp32_linear, tree_attention
from .cpu.few_row_linear import PROFILED_PRODUCTS as FEW_ROW_PRODUCTS
from .cpu.read_kernel import check_read_kernel, use_read_kernel
from .platform import CompileUnsupported
from .prepared import PreparedTarget, TunedDrafter, prepare_target
from .profile import MachineProfile, ProfileError, ProfileMismatchError, read_profile, write_profile

# how a profile names the operators of the products (F.linear's, oneDNN's, the bf16 and fp32 kernels),
# of attention (SDPA, the compiled step's kernel) and the compiled step itself (benchmarks/verify.py)
PROFILED_PRODUCTS = (*FEW_ROW_PRODUCTS, bf16_linear.OP, fp32_linear.OP)
PROFILED_ATTENTION = ("scaled_dot_product", tree_attention.OP)

# use_read_kernel / check_read_kernel: how training's frozen target reads many rows at once (and its config check)
__all__ = [
    "PreparedTarget",
    "TunedDrafter",
    "prepare_target",
    "MachineProfile",
    "read_profile",
    "write_profile",
    "ProfileError",
    "ProfileMismatchError",
    "CompileUnsupported",
    "use_read_kernel",
    "check_read_kernel",
    "PROFILED_PRODUCTS",
    "PROFILED_ATTENTION",
    "PROFILER_NAME",
]
