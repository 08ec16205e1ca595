"""Shared fixtures: tiny random targets of several families, built from configs (nothing downloaded), and the
reference every losslessness test compares with: transformers' own greedy on an untouched copy (`stock_greedy`)."""

import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from medusa_like.apps.config_checks import register_resolvers
from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.draft_tree import DraftTree, grow_dynamic, grow_static
from medusa_like.decoding.tree import DynamicTreeSpec
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads
from medusa_like.forward.cpu import bf16_linear, extension, fp32_linear, tree_attention
from medusa_like.forward.cpu.machine import machine_identity
from medusa_like.io import user_cache_dir
from medusa_like.targets import DEFAULT_TARGET, weights_fingerprint
from medusa_like.tiny import tiny_model

VOCAB = 97
HIDDEN = 32
SLIDING_WINDOW = 6  # far below the test sequence lengths, so sliding layers really slide
FAMILIES = ("llama", "qwen2", "mistral", "gemma3")

# Tiny models gain nothing from intra-op threads, and OpenMP workers spinning on a busy machine make each small matmul
# far slower.
torch.set_num_threads(1)

# Row plans and cost models measured by the tests stay out of the user's cache (one directory, `io.user_cache_dir`);
# the default target converted there already is linked in, not converted again, and so are the kernels the session
# built first (pytest-xdist's workers load the controller's: `pytest_configure`).
# A process a test starts that imports this module (a DDP rank unpickling the test's code) keeps that test's directory.
_USER_CACHE = user_cache_dir()
_TEST_CACHE = (
    None if os.environ.get("PYTEST_CURRENT_TEST") else Path(tempfile.mkdtemp(prefix="medusa_like_test_cache_"))
)
_SESSION_KERNELS = "MEDUSA_LIKE_TEST_KERNELS"  # the directory of the kernels the session's first process built
if _TEST_CACHE is not None:
    os.environ["MEDUSA_LIKE_CACHE_DIR"] = str(_TEST_CACHE)
    if (_USER_CACHE / DEFAULT_TARGET / "config.json").is_file():
        (_TEST_CACHE / DEFAULT_TARGET).symlink_to(_USER_CACHE / DEFAULT_TARGET)
    if os.environ.get(_SESSION_KERNELS):
        (_TEST_CACHE / "kernels").symlink_to(os.environ[_SESSION_KERNELS])


def required_kernels() -> list:
    """The kernels this machine must build: on an x86 CPU with AVX2 and a C++ compiler, the fp32 products' and the
    attention's, and the bf16 products' where the CPU has AVX512-BF16. Elsewhere a kernel's tests skip, saying why."""
    if fp32_linear.cpu_unsupported() is not None or extension.compiler_missing() is not None:
        return []
    kernels = [fp32_linear.KERNEL, tree_attention.KERNEL]
    if bf16_linear.cpu_unsupported() is None:
        kernels.append(bf16_linear.KERNEL)
    return kernels


def pytest_configure(config):
    """The kernels this machine must build (`required_kernels`), built now by the session's first process, where a
    failed build fails the session with the compiler's output: the library would fall back (SDPA, nn.Linear) and
    their tests would skip, so the suite would pass without them. pytest-xdist's workers load the same builds (the
    library builds them in the background on first use, for later processes: a test process would run without)."""
    kernels = required_kernels()
    if hasattr(config, "workerinput"):
        for kernel in kernels:
            kernel.load()  # the controller's build, linked in: milliseconds
        return
    failed = [(kernel, why) for kernel in kernels if (why := kernel.load()) is not None]
    if failed:
        if _TEST_CACHE is not None:
            shutil.rmtree(_TEST_CACHE, ignore_errors=True)  # pytest_unconfigure does not run after this error
        builds = "\n\n".join(f"{why}\n{kernel.error or ''}" for kernel, why in failed)
        raise pytest.UsageError(
            f"{len(failed)} kernel(s) failed to build on a machine meant to build them (an x86 CPU with AVX2 and a "
            f"C++ compiler, $CXX else c++); the compiler said:\n\n{builds}"
        )
    if _TEST_CACHE is not None:
        (_TEST_CACHE / "kernels").mkdir(exist_ok=True)
        os.environ[_SESSION_KERNELS] = str(_TEST_CACHE / "kernels")  # for pytest-xdist's workers, started next


def pytest_unconfigure(config):
    """The tests' cache directory goes with the session, in every process: pytest-xdist's workers end without running
    atexit handlers (a directory per worker was left in the temporary folder by each run)."""
    if _TEST_CACHE is not None:
        shutil.rmtree(_TEST_CACHE, ignore_errors=True)


def flat_cost(target, per_node_ms: float = 0.0, nodes=(1, 2, 4, 8, 16, 32, 64)) -> CostModel:
    """A cost model of `target`'s eager step on this machine where verifying n nodes costs 10 ms + `per_node_ms` * n."""
    times = [10.0 + per_node_ms * n for n in nodes]
    identity = dict(machine=machine_identity(), step="eager")
    return CostModel(list(nodes), times, weights_fingerprint(target), str(target.dtype), target.device.type, **identity)


@pytest.fixture
def fp32_kernel_off(monkeypatch):
    """fp32 targets on `nn.Linear` and SDPA, as on CPUs without AVX2 (where the fp32 kernel does not run,
    `fp32_linear.py`)."""
    monkeypatch.setattr(fp32_linear, "unavailable", lambda: "the fp32 kernel is switched off by the test")


def at_one_and_two_threads(fn, *args):
    """`fn(*args)` computed with one torch thread, then with two (a kernel's output must not depend on the split)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(*args)
        torch.set_num_threads(2)
        return one, fn(*args)
    finally:
        torch.set_num_threads(threads)


def tiny_target(family: str, seed: int = 0, **overrides):
    """A tiny random target of `family` with the tests' vocabulary and real sliding windows."""
    vocab_size = overrides.pop("vocab_size", VOCAB)
    return tiny_model(family, vocab_size, seed, **{"sliding_window": SLIDING_WINDOW, **overrides})


def random_heads(
    num_heads: int = 4, num_layers: int = 1, shared: bool = True, seed: int = 0, hidden: int = HIDDEN, std: float = 0.5
) -> MedusaHeads:
    """Heads with every parameter random (zero-initialised blocks would make broken code pass), so their proposals
    are wrong in varied ways."""
    heads = MedusaHeads(HeadsConfig(hidden, VOCAB, num_heads, num_layers, shared))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return heads.eval()


# ---------------------------------------------------------------------------------------------------------------------
# Configs: composed the way the entry points compose them, pointed at a temporary directory

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_config(name: str, out_dir: Path, *overrides: str, data_dir: Path | None = None):
    """`conf/<name>.yaml` with `overrides`, its run directory `out_dir` and its data under `data_dir`. An evaluation
    starts with an empty lookup store unless `overrides` seed it (seeding reads ShareGPT: seconds per test), and runs
    the eager step unless they compile it (compiling takes a while: the compiled step's tests ask for it)."""
    if name == "eval":
        overrides = ("drafter.seed_store=0", "target.compile=false", *overrides)
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(name, return_hydra_config=True, overrides=list(overrides))
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(out_dir)
        cfg.paths.data_dir = str(data_dir or Path(out_dir) / "data")
        if "trainer" in cfg:
            cfg.trainer.enable_progress_bar = False
        if cfg.get("callbacks"):
            cfg.callbacks.pop("progress_bar", None)
    return cfg


TINY_TRAIN = ("model=tiny_llama", "data=tiny", "logger=none", "distill.progress=false")


@pytest.fixture
def train_cfg(tmp_path):
    """`train_cfg(*overrides)`: the training config on the tiny llama and the tiny data, no logger; its run directory
    is this test's `tmp_path` unless `out_dir` names another."""

    def compose(*overrides: str, out_dir: Path | None = None, data_dir: Path | None = None):
        return compose_config("train", out_dir or tmp_path, *TINY_TRAIN, *overrides, data_dir=data_dir)

    return compose


@pytest.fixture
def eval_cfg(tmp_path):
    """`eval_cfg(*overrides)`: the evaluation config on the tiny llama, run in `tmp_path` unless `out_dir` says."""

    def compose(*overrides: str, out_dir: Path | None = None):
        return compose_config("eval", out_dir or tmp_path, "model=tiny_llama", *overrides)

    return compose


@pytest.fixture
def export_cfg(tmp_path):
    """`export_cfg(*overrides)`: the export config on the tiny llama, run in `tmp_path`, writing to `tmp_path/out`."""

    def compose(*overrides: str):
        return compose_config(
            "export", tmp_path, "model=tiny_llama", "drafter.path=none", f"out={tmp_path / 'out'}", *overrides
        )

    return compose


def random_prompts(n: int, seed: int = 0, min_len: int = 2, max_len: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, VOCAB, (1, int(length)), generator=g) for length in lengths]


def greedy_reference(target, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The target's own greedy continuation through transformers' generate (on `target` as it is: a test's
    reference takes an untouched copy, `stock_greedy`)."""
    out = target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, input_ids.shape[1] :]


def untouched_target(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny target built again, as `tiny_target(family, seed, **overrides)` builds it, that nothing of this project
    has touched: transformers' own layers and attention. Tests compare against it, never against the object they
    decode with (whose layers `MedusaLikeModel` swaps in place) nor against this project's own greedy loop."""
    return check_untouched(tiny_target(family, seed, **overrides).to(dtype))


def check_untouched(model):
    """`model`, after checking that its forward is transformers' own: every module a class of transformers or torch
    (no few-row layer, no packed copy), its attention transformers' own, no hook on any module."""
    foreign = {
        type(m).__qualname__ for m in model.modules() if not type(m).__module__.startswith(("transformers.", "torch."))
    }
    hooked = [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    attention = model.config._attn_implementation
    if foreign or hooked or attention not in ("sdpa", "eager"):
        raise AssertionError(f"not an untouched target: modules {foreign}, hooks on {hooked}, attention {attention!r}")
    return model


def stock_greedy(model, prompts: list[torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """The reference of every test that says "equals the target's greedy": transformers' own `generate`, greedy, on an
    untouched target (`untouched_target`, or a model loaded again from the same files), for each prompt: exactly
    `max_new_tokens` tokens (an EOS does not stop it; the tests decode with `eos_token_id=[]`)."""
    check_untouched(model)
    return [greedy_reference(model, prompt, max_new_tokens).tolist() for prompt in prompts]


NEAR_TIE_STEPS = 4  # the widest margin at a first difference, in steps of the dtype at the row's largest logit


@torch.inference_mode()
def assert_greedy_or_near_tie(untouched, prompt: torch.Tensor, ours: list[int], reference: list[int]) -> None:
    """fp32: `ours` equals `reference` (`stock_greedy` of the `untouched` target) token for token. A lower precision,
    where two forwards of the same weights round apart: equal, or at the first difference the untouched target's
    logits after the prompt and the common prefix give the reference's token and ours within NEAR_TIE_STEPS steps of
    the dtype (its spacing at the row's largest logit): a wrong forward differs by whole logits."""
    check_untouched(untouched)
    if untouched.dtype == torch.float32 or ours == reference:
        assert ours == reference
        return
    assert len(ours) == len(reference), (ours, reference)  # eos_token_id=[]: both run to max_new_tokens
    index = next(i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b)
    ids = torch.cat([prompt[0], torch.tensor(reference[:index], dtype=torch.long, device=prompt.device)])[None]
    row = untouched(ids).logits[0, -1].float()  # [V]
    margin = float(row[reference[index]] - row[ours[index]])  # as the evaluation reports it
    step = torch.finfo(untouched.dtype).eps * 2 ** math.floor(math.log2(float(row.abs().max())))
    assert abs(margin) <= NEAR_TIE_STEPS * step, (index, margin, step, ours, reference)


def greedy_rows(target, count: int, seed: int, width: int = 48) -> list[dict]:
    """Training rows: random 4-token prompts and the target's greedy continuation (the loss on the continuation)."""
    rows = []
    for index, prompt in enumerate(random_prompts(count, seed=seed, min_len=4, max_len=4)):
        ids = torch.cat([prompt[0], greedy_reference(target, prompt, width - 4)])
        loss_mask = torch.ones(width, dtype=torch.long)
        loss_mask[:4] = 0
        rows.append(
            {"input_ids": ids, "attention_mask": torch.ones(width, dtype=torch.long), "loss_mask": loss_mask,
             "index": torch.tensor(index)}
        )  # fmt: skip
    return rows


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


class ScriptedProposer:
    """A test drafter for static trees: `propose_fn(generated tokens) -> [K, top_k]` gives the candidates of each depth
    (an oracle, or the target's likely tokens), placed as a trained drafter's would be."""

    feature_layers = None
    max_depth = None
    max_rank = None

    def __init__(self, propose_fn):
        self.propose_fn = propose_fn

    def begin(self, prompt_ids, features, root, capacity):
        self.generated, self.root = [int(root)], root

    def accept(self, tokens, features, bonus):
        self.generated += tokens[1:].tolist() + [int(bonus)]
        self.root = bonus

    def propose(self, spec) -> DraftTree:
        if spec.max_depth == 0:
            return DraftTree.from_static(spec, self.root.view(1))
        proposals = self.propose_fn(self.generated)[: spec.max_depth]  # [K, top_k]

        def expand(frontier, tokens, parents, depth):  # like Medusa heads: depth d's candidates whatever the parent
            candidates = proposals[depth - 1].expand(frontier.numel(), -1)  # [F, top_k]
            return candidates, torch.zeros(candidates.shape)

        return grow_static(spec, self.root, expand)


class OracleProposer:
    """Knows the target's continuation `truth`: after a node on the true path, rank 0 is the true next token with
    probability 0.9; every other candidate is a random wrong token. Works with static and dynamic trees."""

    feature_layers = None
    max_depth = None
    max_rank = None

    def __init__(self, truth: list[int], seed: int = 0):
        self.truth, self.generator = truth, torch.Generator().manual_seed(seed)

    def begin(self, prompt_ids, features, root, capacity):
        self.done, self.root = 1, root  # tokens of `truth` already generated

    def accept(self, tokens, features, bonus):
        self.done += tokens.numel()
        self.root = bonus

    def propose(self, spec) -> DraftTree:
        grow = grow_dynamic if isinstance(spec, DynamicTreeSpec) else grow_static
        return grow(spec, self.root, self._expand)

    def _expand(self, frontier, tokens, parents, depth):
        k = 4
        out = torch.randint(0, VOCAB, (frontier.numel(), k), generator=self.generator)
        logp = torch.log(torch.tensor([0.9] + [0.1 / (k - 1)] * (k - 1))).repeat(frontier.numel(), 1)
        for row, node in enumerate(frontier.tolist()):
            path = []
            while node >= 0:
                path.append(int(tokens[node]))
                node = int(parents[node])
            path = path[::-1]  # root first
            start = self.done - 1  # index of the root in truth
            on_truth = path == self.truth[start : start + len(path)]
            nxt = start + len(path)
            right = self.truth[nxt] if on_truth and nxt < len(self.truth) else -1
            out[row][out[row] == right] = (right + 1) % VOCAB  # wrong candidates stay wrong
            if right >= 0:
                out[row, 0] = right
        return out, logp


# ---------------------------------------------------------------------------------------------------------------------
# Order: under `make test`'s two workers (pytest-xdist, a file at a time) the longest files start first, so that both
# workers finish together; MEDUSA_LIKE_TEST_SHUFFLE=<seed> shuffles the files and the tests in each instead, to catch
# state one test leaves to another

LONGEST_FILES = ("test_training.py", "test_generate.py", "test_compiled.py", "test_sampling.py", "test_eval.py")


def pytest_report_header(config):
    """Which kind of machine ran the suite (a run's log then says which kind it passed on), and its order."""
    from medusa_like.forward.platform import native_bf16

    bf16 = "native bf16 (AMX or AVX512-BF16)" if native_bf16(torch.device("cpu")) else "no native bf16"
    shuffle = os.environ.get("MEDUSA_LIKE_TEST_SHUFFLE")
    order = f"shuffled, seed {shuffle}" if shuffle is not None else "longest files first"
    return [
        f"machine: {machine_identity()}, {os.cpu_count()} CPUs, {bf16}; CUDA: {torch.cuda.is_available()}; "
        f"test order: {order}"
    ]


def pytest_collection_modifyitems(config, items):
    seed = os.environ.get("MEDUSA_LIKE_TEST_SHUFFLE")
    if seed is not None:
        import random

        rng = random.Random(int(seed))
        files = sorted({item.path for item in items})
        rng.shuffle(files)
        rank = {path: i for i, path in enumerate(files)}
        keys = {id(item): (rank[item.path], rng.random()) for item in items}
        items.sort(key=lambda item: keys[id(item)])
        return
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order
