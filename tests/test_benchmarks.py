"""The benchmarks (the checkout's `benchmarks` package): one command line read off each function's signature, the
harness's timing loop and output, and each benchmark's measurement on tiny random models (what it times, never how
fast: tests time nothing)."""

import json

import pytest
import torch

from benchmarks import (
    attention,
    core,
    draft,
    first_call,
    linear,
    lookup,
    plot_results,
    prefill,
    products,
    verify,
    vocab,
)
from benchmarks.command_line import ENTRIES, call, main, parser_for
from benchmarks.harness import Report, median_ms, show, table
from medusa_like.decoding.tree import DynamicTreeSpec
from medusa_like.drafters.lookup_sources import OutputStore
from medusa_like.forward import PROFILER_NAME
from medusa_like.forward.cpu import fp32_linear, tree_attention
from medusa_like.model import MedusaLikeModel
from medusa_like.tiny import tiny_chat_target

from .conftest import tiny_target

# ---------------------------------------------------------------------------------------------------------------------
# The command line and the harness


def test_every_entry_has_a_one_line_summary_and_a_command_line():
    for name, function in ENTRIES.items():
        assert function.__doc__.strip().splitlines()[0].endswith(".")
        parser_for(name, function).format_help()  # every annotation converts


def test_options_are_read_off_the_signature():
    arguments = parser_for("draft", draft.run).parse_args(["--trees", "chain4,d2k4n4", "--linears", "nn.Linear"])
    assert arguments.trees == ("chain4", "d2k4n4") and arguments.linears == "nn.Linear"
    assert arguments.steps == 60 and arguments.drafter is None  # defaults kept, `str | None` included
    with pytest.raises(SystemExit):
        parser_for("draft", draft.run).parse_args(["--linears", "linear"])  # not one of the choices
    arguments = parser_for("verify", verify.run).parse_args(["--nodes", "3,1", "--threads", "2"])
    assert arguments.nodes == (3, 1) and arguments.threads == 2
    with pytest.raises(SystemExit):
        parser_for("vocab", vocab.run).parse_args([])  # --data has no default: required


def test_positional_parameters_and_star_args_are_positional(tmp_path):
    def run(root, *rest: str, depth: int = 2) -> Report:
        """Positional."""
        return Report({"root": root, "rest": list(rest), "depth": depth})

    arguments = parser_for("x", run).parse_args(["here", "a=1", "b=2", "--depth", "3"])
    assert call(run, arguments).result == {"root": "here", "rest": ["a=1", "b=2"], "depth": 3}


def test_show_prints_the_tables_and_notes_and_writes_the_figures(tmp_path, capsys):
    out = tmp_path / "x.json"
    figures = show(Report({"ms": [1.5]}, [table("title", ["name", "ms"], [["a", "1.5"]])], ["a note"], out=out))
    assert json.loads(out.read_text()) == figures == {"ms": [1.5]}
    printed = capsys.readouterr().out
    assert "title" in printed and "a note" in printed and f"wrote {out}" in printed


def test_an_expected_failure_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["first_call", "--targets", "default,gemma4"])
    assert exit_.value.code == 1
    assert "error: targets: unknown ['gemma4']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["no_such_benchmark"])
    main([])  # the list
    assert "first_call" in capsys.readouterr().out


def test_median_ms_warms_up_then_times_each_call():
    calls = []
    assert median_ms(lambda: calls.append(1), repeats=3, warmup=2) >= 0 and len(calls) == 5
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        median_ms(lambda: None, repeats=0)


# ---------------------------------------------------------------------------------------------------------------------
# Each benchmark's measurement


class Event:
    def __init__(self, key: str, self_us: float):
        self.key, self.self_cpu_time_total = key, self_us


def test_split_puts_each_operator_in_one_part_per_forward():
    events = [
        Event("aten::mm", 4000.0),
        Event("mkldnn::_linear_pointwise", 2000.0),
        Event("aten::_scaled_dot_product_flash_attention_for_cpu", 1000.0),
        Event("medusa_like::bf16_linear", 2000.0),  # the compiled CPU step's own kernels, called out of its package
        Event("medusa_like::tree_attention", 1000.0),
        Event("aten::mul", 600.0),
        Event("aten::linear", 400.0),  # the wrapper's own time: dispatch, not the product
        Event("## Call CompiledFxGraph fkxz2id5etogh4vw ##", 3000.0),  # a compiled step's generated code (GPUs)
        Event(PROFILER_NAME, 1000.0),  # the compiled package's call (CPUs)
    ]
    parts = verify.split(events, forwards=2)
    assert parts == pytest.approx({"products": 4.0, "attention": 1.0, "compiled": 2.0, "rest": 0.5, "total": 7.5})


@pytest.fixture(scope="module")
def chat_model():
    target, tokenizer = tiny_chat_target("llama", hidden_size=64, num_layers=2)
    return MedusaLikeModel.from_pretrained(target, drafter="lookup", tokenizer=tokenizer, tuned_layers=True)


@pytest.mark.slow
def test_where_time_goes_on_a_tiny_target(chat_model):
    rows = verify.where_time_goes(chat_model.forward, [1, 3], repeats=2)
    assert [r["nodes"] for r in rows] == [1, 3]
    for r in rows:
        # the few-row layers' kernels and SDPA are found by the names `split` knows; an eager step runs no compiled code
        assert r["products"] > 0 and r["attention"] > 0 and r["wall_ms"] > 0 and r["compiled"] == 0


def test_core_times_the_forward_by_the_cost_measurement_and_decodes_every_tree(chat_model):
    ms = core.forward_ms(chat_model, [1, 4], prefix_len=16, repeats=1)
    assert len(ms) == 2 and all(m > 0 for m in ms)
    rows = core.decode_speed(chat_model, ["none", "chain"], num_prompts=1, max_new_tokens=4)
    assert [r["method"] for r in rows] == ["hf_generate", "none", "chain"]
    assert rows[0]["tau"] == pytest.approx(1.0)  # transformers: one token a forward
    assert all(r["tokens_per_s"] > 0 and r["tau"] >= 1 for r in rows)


def test_draft_steps_draft_the_same_trees_twice():
    target = tiny_target("llama")
    eagle3 = draft.random_drafter(target, draft_vocab_size=32, seed=0)
    prompt = torch.arange(1, 17)
    spec = DynamicTreeSpec(depth=2, top_k=2, num_nodes=4)
    with torch.inference_mode():
        first, second = (draft.bench_tree(target, eagle3, prompt, spec, steps=10, warmup=1) for _ in range(2))
    assert first["drafts"] == second["drafts"] and first["depth"] == 2
    assert first["ms_per_depth"] == pytest.approx(first["ms_per_step"] / 2)


def test_lookup_steps_draft_from_the_store():
    target = tiny_target("llama")
    pattern = list(range(3, 40))
    store = OutputStore(max_tokens=10_000)
    store.add(pattern * 4)
    context = (pattern * 12)[:400]
    times, nodes = lookup.time_steps(target, store, context, nodes=8, depth=4, steps=20)
    assert len(times) == len(nodes) == 20 and max(nodes) > 1  # a repeating context drafts


def test_prefill_and_training_read_and_linear_verify_on_a_tiny_target():
    target = tiny_target("llama")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    assert prefill.prefill_ms(target, ids[:1]) > 0 and prefill.read_ms(target, ids) > 0
    assert "nn.Linear" in prefill.prefill_targets(target)
    assert len(linear.verify_ms(target, [1, 2, 3])) == 3
    with pytest.raises(ValueError, match="--compile-read times training's read: give --batch too"):
        prefill.run(compile_read=True)  # refused before the target is loaded


@pytest.mark.slow
def test_every_way_of_the_products_benchmark_computes_every_product_of_the_eager_chain():
    target = tiny_target("llama")
    module = products.products_of(target, layers=2)
    assert len(module.linears) == 14  # q, k, v, o, gate, up, down per layer
    ms, eager = products.way_ms(module, "eager", [2, 5], repeats=2)
    assert len(ms) == 2
    for way in ("aten", "template"):
        ms, out = products.way_ms(module, way, [2, 5], repeats=2)
        assert len(ms) == 2
        torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    x = torch.randn(2, module.hidden, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = module(x)
        for linear in module.linears:  # each product reaches the output: none is dead code a compiler may drop
            kept = linear.weight.clone()
            linear.weight.zero_()
            assert not torch.allclose(module(x), whole), linear
            linear.weight.copy_(kept)


@pytest.mark.skipif(fp32_linear.cpu_unsupported() is not None, reason=f"{fp32_linear.cpu_unsupported()}")
def test_the_kernel_ways_compute_the_eager_chains_products_with_the_same_bits_in_either_code():
    """kernel and kernel+avx2 run the fp32 kernel's two codes over packs of the chain's weights: the eager chain's
    products to fp32 rounding, and the same bits as each other (the AVX2 code is what an AVX2-only CPU runs)."""
    assert fp32_linear.KERNEL.load() is None
    module = products.products_of(tiny_target("qwen2"), layers=2)  # qwen2: biased q, k and v products
    assert any(linear.bias is not None for linear in module.linears)
    _, eager = products.way_ms(module, "eager", [3], repeats=1)
    outs = {}
    for way, op in products.KERNEL_WAYS.items():
        _, outs[way] = products.way_ms(products.kernel_copy(module, op), way, [3], repeats=1)
        torch.testing.assert_close(outs[way], eager, rtol=1e-4, atol=1e-5)
    assert torch.equal(outs["kernel"], outs["kernel+avx2"])


@pytest.mark.slow
def test_the_int8_way_streams_a_quarter_of_the_bytes_and_computes_the_int8_products():
    """template+int8 runs the weight-only int8 copies: a quarter of the fp32 bytes (plus a scale per output channel),
    the compiled output equal to the int8 copy's eager output, and the copy near the fp32 chain (int8 rounding)."""
    target = tiny_target("llama")
    module = products.products_of(target, layers=1)
    int8 = products.int8_copy(module)
    scales = sum(linear.out_features for linear in module.linears) * 4
    assert products.weight_bytes(int8) == products.weight_bytes(module) // 4 + scales
    assert all(linear.weight.dtype == torch.int8 for linear in int8.linears)
    _, eager = products.way_ms(int8, "eager", [3], repeats=1)
    _, compiled = products.way_ms(int8, "template+int8", [3], repeats=1)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    _, full = products.way_ms(module, "eager", [3], repeats=1)
    assert 0 < (eager - full).abs().max() < 0.05 * full.abs().max()


def test_the_drift_check_counts_rows_that_change_with_the_rows_beside_them():
    """A row that depends on the step's row count drifts in every row: the check can fail."""

    def row_count_dependent(query, key, value, visible, scale):
        return attention.sdpa_attention(query, key, value, visible, scale) + 1e-3 * query.shape[2]

    parents = attention.TREES["binary, 7 nodes"]
    assert attention.drifting_rows(row_count_dependent, parents, 40, 4, 2, 16, torch.float32) == len(parents)


@pytest.mark.slow
@pytest.mark.skipif(tree_attention.unavailable() is not None, reason=f"{tree_attention.unavailable()}")
def test_the_attention_benchmark_reports_no_drifting_row_for_the_steps_kernel():
    """Compiled over dynamic shapes (one graph, as the step's), in bf16, every row of every tree shape equals the same
    node's one-node step bit for bit, after each checked committed length; the report says so."""
    report = attention.run(nodes=(2,), committed=(40,), dtypes=("bfloat16",), heads=4, kv_heads=2, head_dim=16,
                           repeats=1, out=None)  # fmt: skip
    drift = report.result["drifting_rows"]["kernel, bfloat16"]
    assert drift == dict.fromkeys(attention.TREES, 0)
    assert set(report.result["ms"]) == {"sdpa, bfloat16", "kernel, bfloat16"}
    assert all(ms[0] > 0 for by_keys in report.result["ms"].values() for ms in by_keys.values())


def test_a_vocabulary_projection_is_timed():
    assert vocab.projection_ms(torch.randn(64, 16), nodes=2, repeats=3) > 0


def test_first_call_refuses_an_unknown_target():
    with pytest.raises(ValueError, match=r"unknown \['tiny'\]; known: \['default', 'gemma3-270m'\]"):
        first_call.run(targets=("tiny",))


def test_plot_results_draws_a_results_file_and_refuses_a_malformed_one(tmp_path):
    figures = {"sets": {"a": {"hf_greedy_stock": {"tokens_per_second": 10.0}, "lookup": {"tokens_per_second": 15.0,
                                                                                        "tau": 1.6}, "eagle3": None}}}  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(figures))
    report = plot_results.run(results=tmp_path / "r.json")
    assert (tmp_path / "speedup.png").stat().st_size > 0 and report.result["figure"] == str(tmp_path / "speedup.png")
    (tmp_path / "bad.json").write_text(json.dumps({"sets": {"a": {"m": {"tau": 1}}}}))
    with pytest.raises(ValueError, match="has no numeric tokens_per_second"):
        plot_results.run(results=tmp_path / "bad.json")
    with pytest.raises(ValueError, match="not both"):
        plot_results.run(results=tmp_path / "r.json", report=("a=b.json",))


def test_agreement_counts_equal_outputs_and_first_differences_and_refuses_other_prompts(tmp_path):
    """Each method of one evaluation against a reference method of another, prompt by prompt: equal outputs counted,
    the first differing token of the others (a shorter output differs where it ends); other prompts are refused."""
    from benchmarks import agreement

    def write(run, records):
        run.mkdir()
        (run / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return run

    def record(qid, greedy, fast):
        return {"question_id": qid, "turn": 1, "prompt_ids": [1, 2], "hf_greedy": {"tokens": greedy},
                "speculative": {"tokens": fast, "tau": 1.5}}  # fmt: skip

    fp32 = write(tmp_path / "fp32", [record("a", [5, 6, 7], [5, 6, 7]), record("b", [5, 6, 7], [5, 6, 7])])
    bf16 = write(tmp_path / "bf16", [record("a", [5, 6, 7], [5, 9, 7]), record("b", [5, 6], [5, 6, 7])])
    report = agreement.run(fp32, bf16, out=str(tmp_path / "agreement.json"))
    assert report.result["methods"]["hf_greedy"] == {"prompts": 2, "equal": 1, "first": [2]}
    assert report.result["methods"]["speculative"] == {"prompts": 2, "equal": 1, "first": [1]}
    other = write(tmp_path / "other", [record("a", [5], [5]), record("c", [5], [5])])
    with pytest.raises(ValueError, match="were evaluated on other prompts"):
        agreement.run(fp32, other)
    with pytest.raises(ValueError, match="method 'hf_greedy_stock' did not run on every prompt"):
        agreement.run(fp32, bf16, reference="hf_greedy_stock")
    with pytest.raises(FileNotFoundError, match="no prompts.jsonl"):
        agreement.run(tmp_path, bf16)
