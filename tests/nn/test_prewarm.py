"""``ptxtrain.nn.prewarm``: the FP8 kernels a step will compile, predicted from the model's
shapes, compiled on background threads."""

from __future__ import annotations

import os

import pytest
import torch

from ptxtrain.gemm import ptx
from ptxtrain.jit import nvrtc_available
from ptxtrain.model import DeepSeekV3Config, build_model, get_preset
from ptxtrain.model.deepseek import convert_model_to_fp8_training
from ptxtrain.nn import Fp8Linear, prewarm
from ptxtrain.quant import cuda as qcuda

# The tiny preset (every FP8 layer kind: dense MLP, MLA projections, shared and routed experts)
# with dim 256, so that an expert's [I, D] and [D, I] GEMMs differ (I = 128), and no MTP, whose
# rows differ from the main model's (the token count prewarm is given).
CONFIG = DeepSeekV3Config.from_dict({**get_preset("tiny").to_dict(), "dim": 256, "mtp_depth": 0})


def _model(recipe: str = "deepseek"):
    model = build_model(CONFIG, device="cpu", seed=0)
    convert_model_to_fp8_training(model, recipe)
    return model


def _gemms(jobs):
    return [args for kind, args in jobs if kind == "gemm"]


def test_every_fp8_gemm_of_the_step_is_predicted():
    model = _model()
    tokens = 4096
    jobs = prewarm.fp8_kernels(
        model, tokens, num_sms=132, gemm_backend=lambda *a: "ptx", grouped_ptx=lambda *a: True
    )
    # The quantizers first: each auto op's instantiation (its variant, FULL or not) for bf16,
    # with the recipe's scale rounding (deepseek: not pow2).
    quant = [args for kind, args in jobs if kind == "quant"]
    assert jobs[: len(quant)] == [("quant", args) for args in quant]
    assert quant == qcuda.auto_instantiations(torch.bfloat16, (False,))
    want = {(qcuda.VARIANTS[qcuda.SELECT[op]], full, (*qcuda.OP_MODES[op], False))
            for op in qcuda.AUTO_OPS for full in (False, True)}  # fmt: skip
    assert {(v, full, mode) for _, v, full, mode in quant} == want
    pow2 = prewarm.fp8_kernels(
        _model("deepseek_pow2"), tokens, num_sms=132, gemm_backend=lambda *a: "cublas",
        grouped_ptx=lambda *a: False,
    )  # fmt: skip
    assert [args for _, args in pow2] == qcuda.auto_instantiations(torch.bfloat16, (True,))
    gemms = set(_gemms(jobs))
    assert len(gemms) == len(_gemms(jobs))  # no duplicates
    # Each Fp8Linear: Fprop (M, N, K), Dgrad (M, K, N), Wgrad 1D1D (N, K, M), bf16 out, exactly
    # the arguments its launches compile (compile_args is what ptx._plan compiles).
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert linears
    for lin in linears:
        n, k = lin.out_features, lin.in_features
        for kind, m_, n_, k_ in (("1d2d", tokens, n, k), ("1d2d", tokens, k, n),
                                 ("1d1d", n, k, tokens)):  # fmt: skip
            want = ptx.compile_args(kind, m_, n_, k_, torch.bfloat16, False, 132)
            assert want in gemms, (lin, kind)
    # The routed experts: m-grouped Fprop / Dgrad over the expected padded rows (each expert's
    # share of tokens x top-k, 4096 x 2 / 8 = 1024 rows, already aligned) and the k-grouped
    # Wgrad, fp32 out; w1 and w3 run stacked ([E, 2I, D]: Fprop N = 2I, Dgrad K = 2I) with a
    # Wgrad each ([I, D]), w2 on its own.
    e, top_k, dim, inter = (CONFIG.n_routed_experts, CONFIG.n_activated_experts, CONFIG.dim,
                            CONFIG.moe_inter_dim)  # fmt: skip
    assert (e, top_k, dim, inter) == (8, 2, 256, 128)
    rows = 8 * 1024
    m_grouped = {(2 * inter, dim), (dim, 2 * inter), (dim, inter), (inter, dim)}
    for n, k in m_grouped:  # Fprop and Dgrad of the [w1; w3] stack, of w2 [E, D, I]
        assert ptx.compile_args("m_grouped", rows, n, k, torch.bfloat16, False, 132, 8) in gemms
    for n, k in ((inter, dim), (dim, inter)):  # Wgrad of w1 / w3 [E, I, D], of w2
        assert ptx.compile_args("k_grouped", n, k, rows, torch.float32, False, 132, 8) in gemms

    # ... and no other grouped shape: w1 and w3 alone run no m-grouped GEMM. (Prewarm also
    # compiles the configs of neighbouring row counts, so shapes are compared, not arguments.)
    def shape(args):  # the kind and the kernel's shape template values, without the config
        return args[0:1] + args[2:4]

    grouped = {shape(args) for args in gemms if args[0] in ("m_grouped", "k_grouped")}
    want = [("m_grouped", rows, n, k, torch.bfloat16) for n, k in m_grouped]
    want += [("k_grouped", n, k, rows, torch.float32) for n, k in ((inter, dim), (dim, inter))]
    assert grouped == {shape(ptx.compile_args(*w, False, 132, 8)) for w in want}
    kinds = {args[0] for args in gemms}
    assert kinds == {"1d2d", "1d1d", "m_grouped", "k_grouped"}


def test_modules_report_their_grouped_linears_only_in_fp8():
    # Before the FP8 conversion the MoE layers run no FP8 grouped linear: nothing to compile.
    model = build_model(CONFIG, device="cpu", seed=1)
    layers = [m for m in model.modules() if hasattr(m, "fp8_grouped_linears")]
    assert layers and all(m.fp8_grouped_linears(4096) == [] for m in layers)
    assert not prewarm.fp8_kernels(
        model, 4096, num_sms=132, gemm_backend=lambda *a: "ptx", grouped_ptx=lambda *a: True
    )
    # After it: the [w1; w3] stack (Fprop, Dgrad), w1 and w3 (Wgrad), w2 (all three) of each
    # layer, on 8 experts x (300 x 2 / 8 = 75 -> 128) padded rows.
    convert_model_to_fp8_training(model, "deepseek_pow2")
    for layer in layers:
        got = layer.fp8_grouped_linears(300)
        ex = layer.experts
        stacked = got[0][0]
        assert stacked.is_meta and stacked.shape == (8, 2 * ex.inter_dim, ex.dim)
        assert [w for w, _, _ in got[1:]] == [ex.w1, ex.w3, ex.w2]
        fprop_dgrad, wgrad, every = (True, True, False), (False, False, True), (True, True, True)
        gemms = [(c.fprop, c.dgrad, c.wgrad) for _, _, c in got]
        assert gemms == [fprop_dgrad, wgrad, wgrad, every]
        assert {(rows, cfg.pow2_scale) for _, rows, cfg in got} == {(8 * 128, True)}


def test_expert_parallel_rows_are_what_a_rank_receives():
    # Under --ep R a rank's layer holds E/R experts and receives the routed rows of all R ranks'
    # tokens: its grouped GEMMs get the expected rows of a single process on R x the tokens,
    # restricted to its experts. (A stand-in buffer: ep_size only reads num_ranks.)
    from types import SimpleNamespace

    model = _model()
    e, top_k = CONFIG.n_routed_experts, CONFIG.n_activated_experts
    tokens, ranks = 300, 4
    for layer in [m for m in model.modules() if hasattr(m, "fp8_grouped_linears")]:
        alone = layer.fp8_grouped_linears(ranks * tokens)
        layer.experts.keep_experts_(2 * (e // ranks), e // ranks)  # rank 2's experts
        layer.ep_buffer = SimpleNamespace(num_ranks=ranks)
        got = layer.fp8_grouped_linears(tokens)
        # 4 x 300 tokens x top-2 over 8 experts: 300 rows each -> 384 padded, 2 local experts
        assert {rows for _, rows, _ in got} == {(e // ranks) * 384}
        assert {rows for _, rows, _ in alone} == {e * 384}
        assert [tuple(w.shape) for w, _, _ in got] == [
            (e // ranks, *w.shape[1:]) for w, _, _ in alone
        ]
        assert top_k == 2


def test_grouped_gemms_of_nearby_row_counts_come_after_the_expected_ones():
    # The routing moves each expert's padded rows by up to 128: the m-grouped configs of
    # rows +- E x 128 are compiled too, after every config of the expected shapes.
    model = _model()
    jobs = _gemms(prewarm.fp8_kernels(
        model, 4096, num_sms=132, gemm_backend=lambda *a: "ptx", grouped_ptx=lambda *a: True
    ))  # fmt: skip
    inter, dim, e = CONFIG.moe_inter_dim, CONFIG.dim, CONFIG.n_routed_experts
    expected = 8 * 1024  # 4096 tokens x top-2 over 8 experts, aligned
    want = {ptx.compile_args("m_grouped", rows, n, k, torch.bfloat16, False, 132, e)
            for rows in range(expected - e * 128, expected + e * 128 + 1, 128)
            for n, k in ((inter, dim), (dim, inter))}  # fmt: skip
    assert want <= set(jobs)
    exact = {ptx.compile_args("m_grouped", expected, n, k, torch.bfloat16, False, 132, e)
             for n, k in ((inter, dim), (dim, inter))}  # fmt: skip
    band_only = want - exact
    assert band_only  # the heuristics' split tail differs over this band (checked, not assumed)
    assert max(map(jobs.index, exact)) < min(map(jobs.index, band_only))
    assert prewarm._row_band(256, 2) == [128, 384, 512]  # 256 +- 2 x 128, at least 128 rows


def test_the_backend_choice_and_the_recipe_filter_the_gemms():
    model = _model()
    only_1d2d = prewarm.fp8_kernels(
        model, 512, num_sms=132, quant_dtypes=(),
        gemm_backend=lambda kind, *a: "ptx" if kind == "1d2d" else "cublas",
        grouped_ptx=lambda *a: False,
    )  # fmt: skip
    assert only_1d2d and {args[0] for args in _gemms(only_1d2d)} == {"1d2d"}
    assert all(kind == "gemm" for kind, _ in only_1d2d)  # no quant_dtypes: no modules
    # deepseek_wgrad_bf16 runs no FP8 Wgrad; the bf16 recipe runs no FP8 GEMM at all.
    no_wgrad = prewarm.fp8_kernels(
        _model("deepseek_wgrad_bf16"), 512, num_sms=132, quant_dtypes=(),
        gemm_backend=lambda *a: "ptx", grouped_ptx=lambda *a: True,
    )  # fmt: skip
    assert {args[0] for args in _gemms(no_wgrad)} == {"1d2d", "m_grouped"}
    assert not prewarm.fp8_kernels(
        _model("bf16"), 512, num_sms=132, quant_dtypes=(),
        gemm_backend=lambda *a: "ptx", grouped_ptx=lambda *a: True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="tokens"):
        prewarm.fp8_kernels(model, 0, num_sms=132, gemm_backend=str, grouped_ptx=bool)


def test_no_prewarm_off_an_sm90_gpu_or_when_turned_off(monkeypatch):
    model = _model()
    assert prewarm.prewarm(model, 512, torch.device("cpu")) is None
    monkeypatch.setenv(prewarm.ENV_VAR, "0")
    assert prewarm.prewarm(model, 512, torch.device("cuda")) is None


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
def test_background_compiles_fill_the_cache_and_report_failures(tmp_path, monkeypatch):
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path))
    ptx.compile_gemm.cache_clear()
    try:
        good = [("gemm", ptx.compile_args("1d2d", 4096, n, 512, torch.bfloat16, False, 132))
                for n in (256, 384)]  # fmt: skip
        # block_n 176: the kernel refuses tiles spanning three scale blocks (static_assert)
        bad_cfg = ptx.PtxConfig(64, 176, 4, 1)
        bad = ("gemm", ("1d2d", bad_cfg, 2112, 1536, torch.bfloat16, False))
        warm = prewarm.start([*good, bad], max_workers=2)
        result = warm.wait(timeout=600)
        assert result["jobs"] == 3
        assert [job for job, _ in result["failed"]] == [bad]  # recorded, not raised
        ptx.compile_gemm.cache_clear()
        for _, args in good:  # the step's own call now finds them compiled
            compiled, _ = ptx.compile_gemm(*args)
            assert compiled.how in ("memory", "disk")
        warm.cancel()  # nothing left: a no-op
    finally:
        ptx.compile_gemm.cache_clear()


@pytest.mark.gpu
def test_gpu_the_step_finds_its_dense_gemms_and_quantizers_compiled(tmp_path, monkeypatch):
    # On the GPU: after prewarm (background threads, an empty JIT cache), a training step of the
    # model compiles none of its dense GEMMs or quantizer modules itself. (The routed experts'
    # row count follows the routing, so their m-grouped kernels may still be compiled.)
    import ptxtrain.jit.compiler as jc
    from ptxtrain.quant import cuda as qc

    if not torch.cuda.is_available() or not ptx.supports(128, 128, 128):
        pytest.skip("needs an sm_90 GPU with NVRTC")
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(prewarm.ENV_VAR, raising=False)
    ptx.compile_gemm.cache_clear()
    qc.compile_module.cache_clear()
    ptx._plan.cache_clear()
    try:
        model = build_model(CONFIG, device="cuda", seed=0)
        convert_model_to_fp8_training(model, "deepseek")
        batch, seq = 4, 64
        warm = prewarm.prewarm(model, batch * seq, torch.device("cuda"))
        assert warm is not None and warm.jobs
        assert warm.wait(timeout=600)["failed"] == []
        seen = []
        real = jc._nvrtc_compile
        monkeypatch.setattr(
            jc, "_nvrtc_compile", lambda *a, **kw: seen.append(a[1]) or real(*a, **kw)
        )
        x = torch.randint(0, 256, (batch, seq + 1), device="cuda")
        model(x[:, :-1], x[:, 1:]).loss.backward()
        torch.cuda.synchronize()
        assert [name for name in seen if "grouped" not in name] == []
    finally:
        ptx.compile_gemm.cache_clear()
        qc.compile_module.cache_clear()
        ptx._plan.cache_clear()


@pytest.mark.multigpu
def test_gpu_ep_ranks_compile_each_kernel_once_and_ahead_of_the_step(tmp_path):
    # `ptxtrain train --ep 2 --precision fp8` under torchrun on 2 sm_90 GPUs with empty caches:
    # both ranks prewarm; every NVRTC kernel is compiled once on the node (per-key file lock:
    # the other rank loads it), and none but the routing-dependent grouped GEMMs is left for
    # the training thread. The summary reports the first step's time.
    import json
    import re

    from tests._spawn import _free_port, run_python

    if not ptx.supports(128, 128, 128):
        pytest.skip("needs sm_90 GPUs with NVRTC")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTXTRAIN_")}
    env.update(PTXTRAIN_JIT_CACHE_DIR=str(tmp_path / "jit"), PTXTRAIN_JIT_DEBUG="1",
               TRITON_CACHE_DIR=str(tmp_path / "triton"))  # fmt: skip
    out = tmp_path / "run"
    res = run_python(
        ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(_free_port()), "-m", "ptxtrain", "train", "--preset", "tiny", "--precision", "fp8",
         "--ep", "2", "--steps", "3", "--batch-size", "8", "--seq-len", "256", "--eval-every",
         "0", "--sample-tokens", "0", "--no-checkpoint", "--no-progress", "--out", str(out)],
        env=env, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    compiles = re.findall(r"\[ptxtrain\.jit pid=(\d+) thread=(\S+)\] compiled (\w+) for \w+: .*"
                          r"key=(\w+)", res.stderr)  # fmt: skip
    assert compiles, res.stderr[-4000:]
    keys = [key for *_, key in compiles]
    assert len(keys) == len(set(keys)), "a kernel was compiled twice on one node"
    assert len({pid for pid, *_ in compiles}) == 2  # both ranks compiled a share
    on_step = [name for _, thread, name, _ in compiles
               if thread == "MainThread" and "grouped" not in name]  # fmt: skip
    assert on_step == [], on_step
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_step_s"] > 0 and summary["ranks"] == 2
