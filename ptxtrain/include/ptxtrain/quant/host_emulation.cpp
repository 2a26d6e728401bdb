// ptxtrain/include/ptxtrain/quant/host_emulation.cpp — a shared library exposing cast_transpose.cuh's
// kernels, run on the CPU through host_emulation.hpp, to tests/quant/test_cuda.py (ctypes).
// Build: g++ -std=c++20 -O1 -ffp-contract=off -fPIC -shared host_emulation.cpp -o emu.so
// The kernel variant (ptxtrain_quant::Knobs) comes from -DPTXTRAIN_QUANT_EMU_THREADS=..., _LOOP,
// _PIPE, _MUL_POW2, _BYTE_T, _AMAX16, _FAST_SF, _PAIR, _ASYNC (defaults: the default variant),
// one shared library per variant.
#define PTXTRAIN_QUANT_HOST_EMULATION 1
#include "cast_transpose.cuh"

#ifndef PTXTRAIN_QUANT_EMU_THREADS
#define PTXTRAIN_QUANT_EMU_THREADS 256
#endif
#ifndef PTXTRAIN_QUANT_EMU_FAST_SF
#define PTXTRAIN_QUANT_EMU_FAST_SF 0
#endif
#ifndef PTXTRAIN_QUANT_EMU_AMAX16
#define PTXTRAIN_QUANT_EMU_AMAX16 0
#endif
#ifndef PTXTRAIN_QUANT_EMU_BYTE_T
#define PTXTRAIN_QUANT_EMU_BYTE_T 0
#endif
#ifndef PTXTRAIN_QUANT_EMU_LOOP
#define PTXTRAIN_QUANT_EMU_LOOP 0
#endif
#ifndef PTXTRAIN_QUANT_EMU_PIPE
#define PTXTRAIN_QUANT_EMU_PIPE 0
#endif
#ifndef PTXTRAIN_QUANT_EMU_MUL_POW2
#define PTXTRAIN_QUANT_EMU_MUL_POW2 0
#endif
#ifndef PTXTRAIN_QUANT_EMU_PAIR
#define PTXTRAIN_QUANT_EMU_PAIR 0
#endif
#ifndef PTXTRAIN_QUANT_EMU_ASYNC
#define PTXTRAIN_QUANT_EMU_ASYNC 0
#endif

namespace {

using ptxtrain_quant::i64;
constexpr int kThreads = PTXTRAIN_QUANT_EMU_THREADS;
using Kn = ptxtrain_quant::Knobs<kThreads, PTXTRAIN_QUANT_EMU_LOOP != 0, PTXTRAIN_QUANT_EMU_PIPE != 0,
                                 PTXTRAIN_QUANT_EMU_MUL_POW2 != 0, 0, PTXTRAIN_QUANT_EMU_BYTE_T != 0,
                                 PTXTRAIN_QUANT_EMU_AMAX16 != 0, PTXTRAIN_QUANT_EMU_FAST_SF != 0,
                                 PTXTRAIN_QUANT_EMU_PAIR != 0, PTXTRAIN_QUANT_EMU_ASYNC != 0>;

struct Args {
  const void* x;
  unsigned char* q;
  float* sf;
  unsigned char* qt;
  float* sft;
  i64 m, k, ldx, sf_s0, sf_s1, sft_s0, sft_s1;
  int vec_flags;
  i64 grid;
};

template <int IN, bool BLOCK, bool ROW, bool COL, bool POW2, bool FULL>
int run(const Args& a) {
  const i64 k_tiles = (a.k + 127) / 128;
  const int bytes = IN == ptxtrain_quant::kF32 ? 4 : 2;
  const int buffers = PTXTRAIN_QUANT_EMU_ASYNC && !BLOCK ? 2 : 1;  // (the kernel's kAsyncLayout)
  const std::size_t smem = (COL ? buffers * 128 * 128 * bytes : 0) + 4 * (kThreads / 32);
  emu::launch(ptxtrain_quant::cast_fp8<IN, BLOCK, ROW, COL, POW2, Kn, FULL>, a.grid, kThreads, smem, a.x, a.q,
              a.sf, a.qt, a.sft, a.m, a.k, a.ldx, a.sf_s0, a.sf_s1, a.sft_s0, a.sft_s1, k_tiles,
              a.vec_flags);
  return 0;
}

template <int IN, bool BLOCK, bool ROW, bool COL, bool FULL>
int with_pow2(int pow2, const Args& a) {
  return pow2 ? run<IN, BLOCK, ROW, COL, true, FULL>(a) : run<IN, BLOCK, ROW, COL, false, FULL>(a);
}

template <int IN, bool BLOCK, bool ROW, bool COL>
int with_full(int full, int pow2, const Args& a) {
  return full ? with_pow2<IN, BLOCK, ROW, COL, true>(pow2, a)
              : with_pow2<IN, BLOCK, ROW, COL, false>(pow2, a);
}

template <int IN>
int with_mode(int mode, int full, int pow2, const Args& a) {
  switch (mode) {  // (block, row, col) as _MODES in ptxtrain/quant/cuda.py
    case 0: return with_full<IN, false, true, false>(full, pow2, a);
    case 1: return with_full<IN, false, false, true>(full, pow2, a);
    case 2: return with_full<IN, false, true, true>(full, pow2, a);
    case 3: return with_full<IN, true, true, false>(full, pow2, a);
    case 4: return with_full<IN, true, true, true>(full, pow2, a);
    default: return 1;
  }
}

}  // namespace

// The kernel's arguments (less k_tiles, derived here; `full` selects the FULL instantiation), the grid (CTAs), then spans: the byte sizes of x's, q's,
// sf's, qt's and sft's storage from their pointers. Global accesses outside them, or misaligned,
// are reported on stderr and make the call return 2; 1 is an unknown in_kind / mode.
extern "C" int emu_cast_fp8(int in_kind, int mode, int pow2, int full, const void* x, unsigned char* q,
                            float* sf, unsigned char* qt, float* sft, i64 m, i64 k, i64 ldx,
                            i64 sf_s0, i64 sf_s1, i64 sft_s0, i64 sft_s1, int vec_flags,
                            i64 grid, const i64* spans) {
  const char* base = static_cast<const char*>(x);
  emu::readable = {base, base + spans[0]};
  emu::writable.clear();
  const void* outs[4] = {q, sf, qt, sft};
  for (int i = 0; i < 4; ++i) {
    const char* o = static_cast<const char*>(outs[i]);
    emu::writable.push_back({o, o + spans[i + 1]});
  }
  emu::error = false;
  const Args a{x, q, sf, qt, sft, m, k, ldx, sf_s0, sf_s1, sft_s0, sft_s1, vec_flags, grid};
  int rc = 1;
  switch (in_kind) {  // ptxtrain_quant::InKind
    case 0: rc = with_mode<0>(mode, full, pow2, a); break;
    case 1: rc = with_mode<1>(mode, full, pow2, a); break;
    case 2: rc = with_mode<2>(mode, full, pow2, a); break;
    default: break;
  }
  return rc != 0 ? rc : (emu::error ? 2 : 0);
}

// The e4m3 model of host_emulation.hpp on n floats (checked against torch's cast by the tests).
extern "C" void emu_e4m3(const float* in, unsigned char* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = ptxtrain::e4m3_rn_satfinite(in[i]);
}

// The FAST_SF scale division (ptxtrain_quant::div448<true>) against IEEE division for every
// amax bit pattern in [lo_bits, hi_bits) (all finite floats >= fp32(1e-12): the clamped range);
// returns the number of mismatches (the first few are printed on stderr).
extern "C" long long emu_check_fast_sf(unsigned lo_bits, unsigned hi_bits) {
  long long bad = 0;
  for (unsigned b = lo_bits; b < hi_bits; ++b) {
    const float want = ptxtrain_quant::div448<false>(b);
    const float got = ptxtrain_quant::div448<true>(b);
    if (__float_as_uint(want) != __float_as_uint(got)) {
      if (bad < 5) std::fprintf(stderr, "fast sf: amax bits %08x: %a != %a\n", b, got, want);
      ++bad;
    }
  }
  return bad;
}

// The one-correction quotient of 16-bit inputs (ptxtrain_quant::quotient<true>) against the
// correctly rounded one (quotient<false>), compared as E4M3 bytes, for every positive finite
// 16-bit amax whose bits lie in [lo, hi) (in_kind 1: bf16, 2: fp16; widened and clamped as the
// kernel does, widen_abs16 and make_scale) and every positive 16-bit x <= amax (widened by the
// kernel's unpack_word): all the (x, scale) pairs a 16-bit tile can produce (both computations
// are odd in x, and x = ±0 gives ±0 in both). Stores the pairs checked in *pairs; returns the
// mismatches (the first few printed on stderr).
template <int IN>
long long check_one_step(unsigned lo, unsigned hi, long long* pairs) {
  long long bad = 0, n = 0;
  for (unsigned ha = lo; ha < hi; ++ha) {
    const ptxtrain_quant::Scale s =
        ptxtrain_quant::make_scale<false>(ptxtrain_quant::widen_abs16<IN>(ha));
    for (unsigned hx = 1; hx <= ha; ++hx) {
      const float x = ptxtrain_quant::unpack_word<IN>(hx, 0);
      const unsigned char want = ptxtrain::e4m3_rn_satfinite(ptxtrain_quant::quotient<false>(x, s));
      const unsigned char got = ptxtrain::e4m3_rn_satfinite(ptxtrain_quant::quotient<true>(x, s));
      if (want != got) {
        if (bad < 5) std::fprintf(stderr, "one step: amax %04x x %04x: %02x != %02x\n", ha, hx,
                                  got, want);
        ++bad;
      }
      ++n;
    }
  }
  *pairs = n;
  return bad;
}

extern "C" long long emu_check_one_step(int in_kind, unsigned lo, unsigned hi, long long* pairs) {
  if (in_kind == ptxtrain_quant::kBF16) return check_one_step<ptxtrain_quant::kBF16>(lo, hi, pairs);
  if (in_kind == ptxtrain_quant::kF16) return check_one_step<ptxtrain_quant::kF16>(lo, hi, pairs);
  *pairs = 0;
  return -1;  // not a 16-bit input kind
}
