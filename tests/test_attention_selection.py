"""The selection table (te_fuser/attention/backends/selection.py): which backend each kind of problem gets on
each device, with the hardware facts it reads (cuDNN version, torch's flash build, te_fuser's CUDA kernels)
set as on an H100 with torch 2.14.1; its sources against benchmarks/RESULTS.md; and the schema checks of the
private aten ops (a schema that moved makes its backend unavailable, with the reason, never a crash)."""

import pathlib
import re

import pytest
import torch

import te_fuser
from te_fuser.attention.backends import BACKENDS, PREFERENCES, Problem, choose, clear_cache
from te_fuser.attention.backends import cpu_flash, cudnn, flash, schema

def replace(problem, **fields):
    return problem._replace(**fields)


H100 = Problem(device="cuda", capability=(9, 0), isa=None, dtype=torch.bfloat16, head_dim=128, gqa=False,
               layout="dense", causal=True, square=True, single_key=False, dropout="none", positive_scale=True,
               empty=False, deterministic=False)
CPU = replace(H100, device="cpu", capability=None, isa="avx512_bf16")


@pytest.fixture(autouse=True)
def h100_facts(monkeypatch):
    """The facts an H100 with torch 2.14.1+cu130 gives (cuDNN 9.24, flash built, te_fuser's CUDA kernels)."""
    monkeypatch.setattr(cudnn, "cudnn_version", lambda: 92400)
    monkeypatch.setattr(flash, "flash_built", lambda: True)
    monkeypatch.setattr(te_fuser._extension, "has_cuda_kernels", lambda: True)
    for name in ("TE_FUSER_ATTENTION_BACKEND", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)
    clear_cache()
    yield
    clear_cache()
    schema.clear()


GPU_CASES = [
    # (what, problem, backend, a backend passed over and a word of its reason)
    ("dense bf16 d128 causal", H100, "cudnn", None),
    ("fp16 d64 GQA no mask", replace(H100, dtype=torch.float16, head_dim=64, gqa=True, causal=False), "cudnn", None),
    ("thd, one cu_seqlens", replace(H100, layout="packed"), "flash", ("cudnn", "dense batches only")),
    ("thd cross causal", replace(H100, layout="packed", square=False), "te_fuser", ("flash", "bottom right")),
    ("causal cross", replace(H100, square=False), "te_fuser", ("cudnn", "fewer queries than keys")),
    ("cross no mask", replace(H100, square=False, causal=False), "cudnn", None),
    ("padding mask", replace(H100, layout="padded"), "te_fuser", ("flash", "padded batches")),
    ("dropout", replace(H100, dropout="generator"), "flash", ("cudnn", "dropout")),
    ("dropout from a given seed", replace(H100, dropout="seeded"), "te_fuser", ("flash", "given seed")),
    ("deterministic", replace(H100, deterministic=True), "flash", ("cudnn", "deterministic")),
    ("a single key", replace(H100, single_key=True), "flash", ("cudnn", "single key")),
    ("head dim 256", replace(H100, head_dim=256), "cudnn", ("te_fuser", "head dims")),
    ("head dim 80", replace(H100, head_dim=80), "cudnn", ("te_fuser", "head dims")),
    ("head dim 20", replace(H100, head_dim=20), "unfused", ("flash", "multiples of 8")),
    ("float32", replace(H100, dtype=torch.float32), "unfused", ("te_fuser", "not torch.float32")),
    ("FP8 q/k/v", replace(H100, dtype=torch.float8_e4m3fn), "te_fuser", ("cudnn", "te_fuser's FP8 kernels")),
    ("a scale <= 0", replace(H100, positive_scale=False), "te_fuser", ("flash", "scale <= 0")),
    ("A100", replace(H100, capability=(8, 0)), "flash", ("cudnn", "supported, after flash")),
    ("Turing", replace(H100, capability=(7, 5)), "te_fuser", ("flash", "compute capability 8.0")),
    ("meta tensors", replace(H100, device="meta", capability=None), "te_fuser", ("cudnn", "supported")),
]


@pytest.mark.parametrize("what, problem, expected, passed", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_rows(what, problem, expected, passed):
    choice = choose(problem)
    assert choice.backend == expected, str(choice)
    assert set(choice.passed_over) == set(BACKENDS) - {expected}
    if passed is not None:
        assert passed[1] in choice.passed_over[passed[0]], str(choice)


def test_cudnn_head_dim_limit_follows_the_cudnn_version(monkeypatch):
    monkeypatch.setattr(cudnn, "cudnn_version", lambda: 90100)
    choice = choose(replace(H100, head_dim=256))
    assert choice.backend == "flash" and "up to 128" in choice.passed_over["cudnn"]


CPU_CASES = [
    ("portable fp32", replace(CPU, isa="portable", dtype=torch.float32), "cpu_flash"),
    ("portable bf16 GQA", replace(CPU, isa="portable", gqa=True), "cpu_flash"),
    ("avx2 fp32", replace(CPU, isa="avx2", dtype=torch.float32), "te_fuser"),
    ("avx512_bf16 bf16", CPU, "te_fuser"),
    ("amx bf16", replace(CPU, isa="amx"), "cpu_flash"),
    ("amx fp16 cross", replace(CPU, isa="amx", dtype=torch.float16, square=False), "cpu_flash"),
    ("amx fp32", replace(CPU, isa="amx", dtype=torch.float32), "te_fuser"),
    ("amx FP8", replace(CPU, isa="amx", dtype=torch.float8_e4m3fn), "te_fuser"),
    ("amx bf16 padded", replace(CPU, isa="amx", layout="padded"), "te_fuser"),
    ("amx bf16 thd", replace(CPU, isa="amx", layout="packed"), "te_fuser"),
    ("amx bf16 dropout", replace(CPU, isa="amx", dropout="generator"), "te_fuser"),
    ("amx bf16 causal scale 0", replace(CPU, isa="amx", positive_scale=False), "te_fuser"),
    ("amx bf16 no key", replace(CPU, isa="amx", empty=True), "te_fuser"),
]


@pytest.mark.parametrize("what, problem, expected", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_cpu_rows(what, problem, expected):
    assert choose(problem).backend == expected, str(choose(problem))


def test_every_row_names_every_backend_once_and_its_source():
    for row in PREFERENCES:
        assert sorted(row.order) == sorted(set(row.order)) and set(row.order) <= set(BACKENDS), row
        assert row.source
        if row.device != "meta" and "not measured" not in row.source:
            assert re.search(r"20\d\d-\d\d-\d\d", row.source), row  # a date
            assert re.search(r"H100|Zen|Sapphire Rapids", row.source), row  # a device


def test_the_h100_row_quotes_the_figures_recorded_in_results():
    """Each TFLOP/s figure the sm_90 row cites is in benchmarks/RESULTS.md's GPU table."""
    results = (pathlib.Path(__file__).parents[1] / "benchmarks" / "RESULTS.md").read_text()
    gpu = results[results.index("## GPU"):]
    row = next(r for r in PREFERENCES if r.match == ((9, 0),))
    for cited in re.findall(r"(\d+) / (\d+) / (\d+)", row.source):
        te, flash_, cudnn_ = cited[2], cited[1], cited[0]
        line = next((ln for ln in gpu.splitlines() if re.search(rf"\| {te} .*\| {flash_} \| {cudnn_} \|", ln)), None)
        assert line is not None, f"cuDNN {cudnn_} / flash {flash_} / te_fuser {te} not in RESULTS.md"


# Schemas ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expected", [cudnn.EXPECTED_SCHEMAS, flash.DENSE_SCHEMAS, flash.PACKED_SCHEMAS,
                                      cpu_flash.EXPECTED_SCHEMAS])
def test_this_torch_has_the_schemas_te_fuser_was_written_for(expected):
    """torch 2.13.0 and 2.14.1 (the two builds CI runs) both have them."""
    schema.clear()
    assert schema.schema_problem(expected) is None


def test_any_accepted_form_of_a_schema_passes():
    """An op may list each torch release's form of its schema (flash's packed forward: torch 2.11's lacks
    block_table and num_splits); the one this torch has passes, and a miss names every accepted form."""
    found = str(torch.ops.aten._flash_attention_forward.default._schema)
    assert found in flash.PACKED_SCHEMAS["_flash_attention_forward"]
    older = "aten::_flash_attention_forward(Tensor query)"
    schema.clear()
    assert schema.schema_problem({"_flash_attention_forward": (older, found)}) is None
    schema.clear()
    problem = schema.schema_problem({"_flash_attention_forward": (older, "aten::_flash_attention_forward()")})
    assert f"found {found!r}, expected {older!r} or 'aten::_flash_attention_forward()'" in problem
    schema.clear()


def test_a_moved_schema_makes_its_backend_unavailable_with_the_reason(monkeypatch):
    schema.clear()
    moved = dict(cudnn.EXPECTED_SCHEMAS)
    moved["_scaled_dot_product_cudnn_attention"] = moved["_scaled_dot_product_cudnn_attention"].replace(
        "bool compute_log_sumexp", "bool compute_log_sumexp, bool return_lse_bhs")
    monkeypatch.setattr(cudnn, "EXPECTED_SCHEMAS", moved)
    choice = choose(H100)
    assert choice.backend == "flash"
    reason = choice.passed_over["cudnn"]
    assert f"aten::_scaled_dot_product_cudnn_attention in torch {torch.__version__} has a schema" in reason
    assert "found 'aten::_scaled_dot_product_cudnn_attention(Tensor query" in reason and "return_lse_bhs" in reason
    with pytest.raises(ValueError, match="'cudnn' \\(the module's attention_backend='cudnn'\\) cannot run .*schema"):
        choose(H100, "cudnn")


def test_a_missing_op_makes_its_backend_unavailable(monkeypatch):
    schema.clear()
    monkeypatch.setattr(flash, "PACKED_SCHEMAS", {"_flash_attention_forward_v9": "aten::_flash_attention_forward_v9()"})
    choice = choose(replace(H100, layout="packed"))
    assert choice.backend == "te_fuser"
    assert choice.passed_over["flash"] == f"torch {torch.__version__} has no aten::_flash_attention_forward_v9"
    assert choose(H100).backend == "cudnn"  # the dense ops are still there


def test_each_schema_is_checked_once(monkeypatch):
    schema.clear()
    checked = []
    real = schema._check
    monkeypatch.setattr(schema, "_check", lambda name, expected: checked.append(name) or real(name, expected))
    for problem in (H100, replace(H100, head_dim=64), replace(H100, layout="packed"),
                    replace(H100, dropout="generator")):
        clear_cache()
        choose(problem)
    assert sorted(checked) == sorted([*cudnn.EXPECTED_SCHEMAS, *flash.DENSE_SCHEMAS, *flash.PACKED_SCHEMAS])
