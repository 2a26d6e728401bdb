"""ptxtrain._triton_direct: Triton launches that skip the binder after a specialization's first."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ptxtrain import _triton_direct as td  # noqa: E402


def test_int_features_follow_triton_specialization():
    # specialized ints: equality to 1, divisibility by 16, int32 / int64 / uint64 range
    f = [td._feature(v, 1) for v in (1, 16, 32, 17, 18, 2**31, 2**63)]
    assert f[1] == f[2]  # 16 and 32: both divisible by 16, int32
    assert f[3] == f[4]  # 17 and 18: neither
    assert len({f[0], f[1], f[3], f[5], f[6]}) == 5  # 1, %16, other, int64, uint64 all differ
    # do_not_specialize: only the range
    assert td._feature(1, 2) == td._feature(48, 2) == td._feature(17, 2)
    assert td._feature(17, 2) != td._feature(2**40, 2)
    # constexprs by value; bools are not ints
    assert td._feature(64, 0) != td._feature(128, 0)
    assert td._feature(True, 1) != td._feature(1, 1)
    assert td._feature([1], 0) is None  # unhashable constexpr: no direct launch
    assert td._feature(object(), 1) is None


def test_tensor_feature_is_dtype_and_alignment():
    x = torch.zeros(8, dtype=torch.float32)
    assert td._feature(x, 1) == td._feature(torch.ones(4), 1)
    assert td._feature(x[1:], 1) != td._feature(x, 1)  # 4-byte offset: not 16-byte aligned
    assert td._feature(x.half(), 1) != td._feature(x, 1)


def test_falls_back_to_the_kernel_when_not_a_jit_function(monkeypatch):
    calls = []

    class Fake:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k)) or "ran"

    launcher = td.DirectLauncher(Fake())
    assert launcher((3,), 1, 2, B=4) == "ran"
    assert calls == [((3,), (1, 2), {"B": 4})]
    assert launcher.direct_launches == 0


def test_enabled_reads_the_switch(monkeypatch):
    monkeypatch.setenv("PTXTRAIN_TRITON_DIRECT", "0")
    assert not td.enabled()
    monkeypatch.setenv("PTXTRAIN_TRITON_DIRECT", "1")
    assert td.enabled() == triton.__version__.startswith(td._VERSIONS)


def test_direct_returns_one_launcher_per_kernel():
    a, b = object(), object()
    assert td.direct(a) is td.direct(a)
    assert td.direct(a) is not td.direct(b)


if os.environ.get("TRITON_INTERPRET") != "1":

    @triton.jit(do_not_specialize=["n_rows"])
    def _axpb_kernel(x_ptr, out_ptr, n, n_rows, a, B: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x * a + B + n_rows, mask=mask)


@pytest.mark.gpu
@pytest.mark.skipif(not td.enabled(), reason="direct launches are off for this Triton")
def test_gpu_direct_launches_compute_what_triton_launches_do():
    launcher = td.DirectLauncher(_axpb_kernel)
    # Each case: n, n_rows, a, B. The second and later launches of one key go direct.
    cases = [
        (1000, 3, 2.0, 1),
        (1000, 7, 0.5, 1),  # same key: n_rows is do_not_specialize, a a float
        (1008, 5, 2.0, 1),  # n divisible by 16: a new key, through Triton
        (1024, 9, 3.0, 1),  # same key as 1008
        (1, 2, 1.5, 1),  # n == 1: Triton's constant, a new key
        (1000, 3, 2.0, 2),  # another constexpr: new key
        (999, 2**31, 2.0, 1),  # int64 n_rows: new key
    ]
    direct_before = []
    for n, n_rows, a, b in cases:
        x = torch.randn(n + 3, device="cuda")[3:]  # offset 12 bytes: unaligned pointer
        for xv in (x, torch.randn(n, device="cuda")):
            out = torch.empty_like(xv)
            direct_before.append(launcher.direct_launches)
            launcher((triton.cdiv(n, 128),), xv, out, n, n_rows, a, B=b, BLOCK=128)
            # (Triton may fuse x * a + B into one FMA: fp32's default tolerance covers it)
            torch.testing.assert_close(out, xv * a + b + float(n_rows))
    # Direct launches: the second case both times (key of the first), and the fourth.
    steps = [j - i for i, j in zip(direct_before, [*direct_before[1:], launcher.direct_launches])]
    assert steps == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0], steps


@pytest.mark.gpu
@pytest.mark.skipif(not td.enabled(), reason="direct launches are off for this Triton")
@pytest.mark.parametrize(("m", "n", "k"), [(13, 300, 640), (1, 512, 256), (2048, 768, 768)])
def test_gpu_triton_gemm_direct_is_bitwise_the_bound_launch(m, n, k, monkeypatch):
    """The Triton FP8 GEMM launched direct (its second call on a shape) writes bitwise what the
    Triton-bound launch writes, for fresh operands at new addresses."""
    from ptxtrain.gemm import triton as tg
    from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8

    def run():
        torch.manual_seed(m * n + k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        return tg.fp8_gemm_nt(per_token_cast_to_fp8(x), per_block_cast_to_fp8(w))

    monkeypatch.setenv("PTXTRAIN_TRITON_DIRECT", "0")
    want = run()
    monkeypatch.setenv("PTXTRAIN_TRITON_DIRECT", "1")
    before = tg._LAUNCH.direct_launches
    got = [run() for _ in range(3)]
    assert tg._LAUNCH.direct_launches >= before + 2  # the 2nd and 3rd at least
    for g in got:
        assert torch.equal(g, want)
