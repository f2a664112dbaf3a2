"""Block FP8 on a real GPU: the Triton kernel and a refit into an FP8 engine.

What the CPU suite cannot reach: ``execute.kernels.fp8_blocks`` quantizes blocks of many
regions in one launch; with every variant, its values and scales must equal, bit for
bit, the torch reference run on the CPU (``transforms.fp8.quantize_blocks``), on
shapes with partial edge blocks, row strips of a wider tensor (how q / k / v come out
of a fused QKV), stacked experts, all-zero blocks, bf16 / fp16 / fp32 sources, and
``testing.fp8_inputs.hard_blocks`` (every finite bf16 bit pattern; blocks at every
exponent, subnormals and signed zeros: the kernel divides by multiplying with a
reciprocal and correcting with an FMA, which must round exactly as IEEE division). A one-process
refit of a Megatron-style bf16 toy into a Hugging Face-named FP8 engine on CUDA goes
through the kernel (the sender-side steps are block tables) and gives ``o_proj``
exactly the CPU reference's quantization of ``linear_proj``; verify() agrees.
"""

from __future__ import annotations

import pytest
import torch

import torchrefit as tr
from torchrefit.execute.kernels import fp8_blocks
from torchrefit.testing import Mesh, ModelSpec, build_toy, run_world
from torchrefit.testing.fp8_inputs import hard_blocks
from torchrefit.transforms import quantize_blocks

pytestmark = pytest.mark.gpu

BLOCK = (128, 128)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _kernel_case(src: torch.Tensor, variant: str) -> bool:
    """Kernel on ``src`` (a CUDA view) against the CPU reference on its values."""
    lead, (rows, cols) = src.shape[:-2], src.shape[-2:]
    grid = tuple(lead) + (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    dst = torch.full(src.shape, float("nan"), device="cuda").to(torch.float8_e4m3fn)
    scale = torch.full(grid, -1.0, device="cuda")
    for table in fp8_blocks.BlockTable.build([(src, dst, scale)], BLOCK):
        fp8_blocks.launch(table, variant)
    want_q, want_s = quantize_blocks(src.cpu(), BLOCK)
    return torch.equal(_bits(dst.cpu()), _bits(want_q)) and torch.equal(scale.cpu(), want_s)


def test_kernel_equals_the_cpu_reference() -> None:
    if not fp8_blocks.available():
        pytest.skip("Triton is not usable here")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(300, 200, device="cuda", generator=g).to(torch.bfloat16)
    w[:128, :128] = 0  # the clamped scale
    fused = torch.randn(768, 256, device="cuda", generator=g).to(torch.bfloat16) * 1e-3
    experts = torch.randn(3, 130, 260, device="cuda", generator=g)
    w[3, 130:140] = -0.0
    cases = {"partial edges": w, "strip of a fused tensor": fused[256:384],
             "stacked": experts, "fp32": experts[1], "fp16": w.half() * 7,
             "whole blocks": fused[:, :256], "hard blocks": hard_blocks("cuda")}
    wrong = [(name, v) for v in fp8_blocks.VARIANTS for name, t in cases.items()
             if not _kernel_case(t, v)]
    assert wrong == []


SPEC = ModelSpec(layers=2, hidden=512, heads=4, groups=4, ffn=1024, vocab=1024, dtype=torch.bfloat16)


def _refit(rank: int, world: int) -> dict:
    from torchrefit.bench.hf_models import build_hf_destination

    torch.cuda.set_device(0)
    src = build_toy(SPEC, Mesh(1, ranks=1), 0, seed=1, device="cuda", random_init=True)
    dst = build_hf_destination(SPEC, torch.device("cuda"), fp8=True, block=BLOCK)
    r = tr.Refitter(src, dst, transport="nccl",
                    name_map=tr.maps.megatron_to_hf(num_heads=SPEC.heads, num_query_groups=SPEC.groups))
    report = r.refit()
    torch.cuda.synchronize()
    got = dict(dst.named_parameters())
    want_q, want_s = quantize_blocks(src.state_dict()["decoder.layers.0.self_attention.linear_proj.weight"]
                                     .cpu(), BLOCK)
    name = "model.layers.0.self_attn.o_proj.weight"
    verified = "ok"
    try:
        r.verify()
    except tr.VerificationError as e:
        verified = str(e)
    return {"o_proj": torch.equal(_bits(got[name].detach().cpu()), _bits(want_q))
            and torch.equal(got[name + "_scale_inv"].detach().cpu(), want_s),
            "tables": len(r._program.compiled.quantize.before.tables),
            "sender": report.fp8_on_sender, "verified": verified}


def test_refit_into_an_fp8_engine_goes_through_the_kernel() -> None:
    if not fp8_blocks.available():
        pytest.skip("Triton is not usable here")
    (got,) = run_world(_refit, 1, backend="nccl", timeout=180)
    assert got["o_proj"] and got["tables"] >= 1 and got["sender"] > 0 and got["verified"] == "ok", got
