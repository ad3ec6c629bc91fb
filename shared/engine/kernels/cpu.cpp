// splitspec's CPU kernels: int8 linear layers (W8A8) and a fixed-order attention.
//
// Why: a small decoder on a CPU is bound by streaming its weights, and speculative decoding pays
// only if a forward of a few rows costs about one of a single row. int8 weights halve or quarter
// the bytes; int8 activations let a row's dot products run in exact integer arithmetic. Each
// activation row gets its own scale, so a row's result does not depend on which or how many rows
// share the call: a tree verified in one forward equals the same path decoded token by token, bit
// for bit. Every float reduction here (norms, attention) is written in one fixed order per row for
// the same reason, and no kernel picks another code path by the row count.
//
// Built by shared/kernels/__init__.py with torch's extension builder, on the machine that runs it,
// with the ISA flags it has (AVX2+FMA where present; a portable path elsewhere). Threads come from
// torch's own pool (at::parallel_for), so they never fight torch's workers for the cores.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPLITSPEC_AVX2 1
#endif
#if defined(SPLITSPEC_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#define SPLITSPEC_AVX512 1  // the integer dot products in 512-bit VNNI (vpdpbusd); everything else as AVX2
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SPLITSPEC_AMX 1  // the AVX-512 build whose int8 sums of a forward of several rows run on AMX tiles
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(SPLITSPEC_AVX2) && defined(__AVXVNNI__)
#define SPLITSPEC_AVXVNNI 1  // the AVX2 kernels with 256-bit VNNI (vpdpbusd) for their integer dot products
#endif

// Each build registers its ops under its own name (torch.ops.splitspec_avx2, ...), so that one process can load
// several builds (the tests compare them); shared/kernels/__init__.py passes the name.
#ifndef SPLITSPEC_NS
#define SPLITSPEC_NS splitspec
#endif
#define SPLITSPEC_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace {

constexpr int64_t KSTEP = 32;  // weights' rows are padded to a multiple of this many int8 values

int64_t padded(int64_t k) { return (k + KSTEP - 1) / KSTEP * KSTEP; }

// ---------------------------------------------------------------------------------------------
// Activations, quantised row by row: with one scale per row for int8 weights (a row's whole dot product
// is then one exact integer sum), or one scale per 32-value block for 4-bit weights, whose blocks are
// summed in float anyway (finer scales keep outlier channels from flattening the rest: llama.cpp's Q8).

struct Rows {
  std::vector<int8_t> q;    // [M, Kp] signed values
  std::vector<uint8_t> a;   // [M, Kp] their magnitudes (AVX2 multiplies unsigned by signed bytes)
  std::vector<uint8_t> u;   // [M, Kp] the values + 128 (VNNI's unsigned operand; see dot_tile)
  std::vector<float> scale; // [M] per row, or [M, Kp / 32] per block
  std::vector<float> bsum;  // [M, Kp / 32] each block's sum of q, times its scale in block mode
  std::vector<int32_t> hoff;  // [M, Kp / 16] -32 x each half block's sum of q, in block mode (6-bit weights' offset)
  int64_t M = 0, Kp = 0;
  bool blocks = false;
};

// amax of |v[0..n)|
inline float amax_of(const float* v, int64_t n) {
  int64_t k = 0;
  float amax = 0.f;
#ifdef SPLITSPEC_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (; k + 8 <= n; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float l : lanes) amax = std::max(amax, l);
#endif
  for (; k < n; ++k) amax = std::max(amax, std::fabs(v[k]));
  return amax;  // max is exact: the same whatever the order
}

// q[k] = clamp(round-half-even(x[k] * inv), -127, 127), |q| into a (if given); returns the sum of q
inline int32_t quantize_span(const float* x, int64_t n, float inv, int8_t* q, uint8_t* a) {
  int64_t k = 0;
  int32_t sum = 0;
#ifdef SPLITSPEC_AVX2
  const __m256 scale = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i total = _mm256_setzero_si256();
  for (; k + 8 <= n; k += 8) {  // cvtps rounds half to even, as std::nearbyint in the default mode
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), scale));
    v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
    total = _mm256_add_epi32(total, v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i b = _mm_packs_epi16(w, w);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), b);
    if (a) _mm_storel_epi64(reinterpret_cast<__m128i*>(a + k), _mm_abs_epi8(b));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  for (int32_t l : lanes) sum += l;
#endif
  for (; k < n; ++k) {
    const int v = std::clamp(static_cast<int>(std::nearbyint(x[k] * inv)), -127, 127);
    q[k] = static_cast<int8_t>(v);
    if (a) a[k] = static_cast<uint8_t>(v < 0 ? -v : v);
    sum += v;
  }
  return sum;
}

// A thread's share of work in a region that already runs on every thread (Blocks.forward: one parallel region a
// forward, barriers between its steps, instead of a fork and join per step). threads == 0: not in such a region.
struct Split {
  int64_t tid = 0, threads = 0;
  std::pair<int64_t, int64_t> share(int64_t n) const { return {n * tid / threads, n * (tid + 1) / threads}; }
};

// f(begin, end) over [0, n): across torch's threads (at least ``grain`` each), or this thread's share of a Split.
// Which thread computes an item never changes what it computes.
template <typename F>
void for_range(int64_t n, int64_t grain, const Split& split, const F& f) {
  if (split.threads == 0) {
    at::parallel_for(0, n, grain, f);
    return;
  }
  const auto [b, e] = split.share(n);
  if (b < e) f(b, e);
}

#ifdef SPLITSPEC_AMX
constexpr int64_t ROW_PAD = 16;  // a tile loads 16 rows, and a last step of 32 values 64 bytes of each
#else
constexpr int64_t ROW_PAD = 0;
#endif

// Room for M rows of K values in ``r`` (zeros in the padding): before quantize_rows_range fills rows.
void prepare_rows(int64_t M, int64_t K, Rows& r, bool blocks) {
  r.M = M;
  r.Kp = padded(K);
  r.blocks = blocks;
  const int64_t Kb = r.Kp / KSTEP;
  r.q.assign((M + ROW_PAD) * r.Kp, 0);  // zero rows past M: an AMX tile loads 16 rows
#ifdef SPLITSPEC_AVX512
  if (!blocks) r.u.assign(M * r.Kp, 128);  // the int8 kernel's offset values; 4-bit weights need none
#else
  if (!blocks) r.a.assign(M * r.Kp, 0);  // the int8 kernel's magnitudes (sign trick); 4-bit weights need none
#endif
  r.scale.assign(blocks ? M * Kb : M, 0.f);
  r.bsum.assign(M * Kb, 0.f);
  r.hoff.assign(blocks ? M * Kb * 2 : 0, 0);
}

// Rows [m0, m1) of x [M, K] quantised into r (prepared for M rows)
void quantize_rows_range(const float* x, int64_t m0, int64_t m1, int64_t K, Rows& r) {
  const bool blocks = r.blocks;
  const int64_t Kb = r.Kp / KSTEP;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    int8_t* q = r.q.data() + m * r.Kp;
#ifdef SPLITSPEC_AVX512
    uint8_t* a = nullptr;
#else
    uint8_t* a = blocks ? nullptr : r.a.data() + m * r.Kp;
#endif
    const float row_amax = blocks ? 0.f : amax_of(xr, K);
    for (int64_t b = 0; b < Kb; ++b) {
      const int64_t k0 = b * KSTEP, k1 = std::min(K, k0 + KSTEP), n = std::max<int64_t>(0, k1 - k0);
      const float amax = blocks ? amax_of(xr + k0, n) : row_amax;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum;
      if (blocks) {  // in halves of 16, whose sums the 6-bit weights' offset needs
        const int64_t n0 = std::min<int64_t>(n, KSTEP / 2);
        const int32_t s0 = quantize_span(xr + k0, n0, inv, q + k0, nullptr);
        const int32_t s1 = quantize_span(xr + k0 + n0, n - n0, inv, q + k0 + n0, nullptr);
        r.hoff[(m * Kb + b) * 2] = -32 * s0;
        r.hoff[(m * Kb + b) * 2 + 1] = -32 * s1;
        sum = s0 + s1;
      } else {
        sum = quantize_span(xr + k0, n, inv, q + k0, a ? a + k0 : nullptr);
      }
      if (blocks) {
        r.scale[m * Kb + b] = amax / 127.f;
        r.bsum[m * Kb + b] = static_cast<float>(sum) * (amax / 127.f);
      } else {
        r.bsum[m * Kb + b] = static_cast<float>(sum);
      }
    }
    if (!blocks) r.scale[m] = row_amax / 127.f;
#ifdef SPLITSPEC_AVX512
    if (!blocks)
      for (int64_t k = 0; k < r.Kp; ++k) r.u[m * r.Kp + k] = static_cast<uint8_t>(q[k] + 128);
#endif
  }
}

void quantize_rows(const float* x, int64_t M, int64_t K, Rows& r, bool blocks = false) {
  prepare_rows(M, K, r, blocks);
  quantize_rows_range(x, 0, M, K, r);
}

// ---------------------------------------------------------------------------------------------
// Integer dot products of R activation rows with C = 4 weight rows: out[r * 4 + c] (int32, exact).

// f(std::integral_constant<int, rows>{}) for LEAST <= rows <= R: a tile's row count as a template argument
template <int R, int LEAST = 1, typename F>
inline void with_rows(int64_t rows, F&& f) {  // rows >= LEAST: a caller's promise
  if constexpr (R > LEAST) {
    if (rows == R) return f(std::integral_constant<int, R>{});
    return with_rows<R - 1, LEAST>(rows, f);
  } else {
    f(std::integral_constant<int, LEAST>{});
  }
}

// rows a pass of a tile takes, at most R, the passes as even as can be: 17 rows at 8 are passes of 6, 6, 5 (a pass
// of one row would cost nearly what one of eight does)
inline int64_t balanced(int64_t M, int64_t R) {
  const int64_t passes = (M + R - 1) / R;
  return (M + passes - 1) / passes;
}

// The next tile's bytes, prefetched a share per step over every pass of the current tile. A tile's first pass
// streams its weights from memory; the passes after it read them from L1, and without this the memory would idle
// while they run (at 17 rows a 1.5B model's layer took compute + memory time instead of the larger of the two).
struct Ahead {
  const char* begin[2] = {nullptr, nullptr};  // the next tile's weights and scales (nullptr: no next tile)
  int64_t lines[2] = {0, 0};
  int64_t first = 0, steps = 1;  // this pass's first step of all the tile's steps (passes x blocks)

  void fetch(int64_t i) const {
#ifdef SPLITSPEC_AVX2
    if (!begin[0]) return;  // one pass or the last tile: nothing to fetch (and no divisions on the hot path)
    const int64_t s = first + i;
    for (int k = 0; k < 2; ++k)
      for (int64_t l = s * lines[k] / steps, e = (s + 1) * lines[k] / steps; l < e; ++l)
        _mm_prefetch(begin[k] + 64 * l, _MM_HINT_T1);
#else
    (void)i;
#endif
  }
};

#ifdef SPLITSPEC_AMX
// AMX: a tile multiply (tdpbssd) adds a tile of 16 rows x 64 signed bytes times one of 16 x 16 4-byte groups into
// 16 x 16 int32s, ~16x what a vpdpbusd does. It computes the same exact integer sums as the VNNI code and the float
// steps after it are that code's, in its order: the same bits, so the build takes either by row count. int8 weights
// ride on it: a row's sum builds up over all of K in one tile, and the float steps come once per output. A few rows
// are bound by the weight stream: below AMX_ROWS the VNNI code is as fast. The block formats' float steps come every
// 32 values, so a tile's sums go through memory every block: they take tiles only in passes of 12-16 rows
// (q4_amx_pass, q6_amx_pass), where the multiplies saved outweigh that (docs/engine.md, "AMX tiles").
constexpr int64_t AMX_ROWS = 4;

// Linux hands a process the tile registers' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// A tile configuration (palette 1): rows and bytes a row of each tile register, loaded per thread before its tiles run
struct alignas(64) TileShapes {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileShapes& tile(int i, int r, int bytes) {
    rows[i] = static_cast<uint8_t>(r);
    colsb[i] = static_cast<uint16_t>(bytes);
    return *this;
  }
};

// The tiles a thread uses in a region (its share of a multiply): configured at the start, released at the end, since
// other code in the thread (oneDNN's bf16 kernels) configures tiles of its own between our calls
struct Tiles {
  explicit Tiles(const TileShapes& shapes) {
    TORCH_CHECK(amx_permitted(), "the amx kernel build: Linux refused this process the AMX tile state "
                "(arch_prctl ARCH_REQ_XCOMP_PERM); use another build (SPLITSPEC_ISA=avx512-vnni)");
    _tile_loadconfig(&shapes);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};
#endif

// Outputs [n, n + cols) of rows [r0, r0 + rows) from their int8 sums (acc, a row's ``width`` apart): the float steps
// of every build, in the same order
void int8_outputs(const Rows& x, int64_t r0, int64_t rows, const int32_t* acc, int64_t width, const float* w_scale,
                  const float* bias, const float* residual, int64_t n, int64_t cols, int64_t ld, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + (r0 + r) * ld + n;
    const float sx = x.scale[r0 + r];
    for (int64_t c = 0; c < cols; ++c) {
      float v = static_cast<float>(acc[r * width + c]) * (sx * w_scale[n + c]);
      if (bias) v += bias[n + c];
      if (residual) v += residual[(r0 + r) * ld + n + c];
      yr[c] = v;
    }
  }
}

constexpr int64_t C = 4;  // weight rows per tile: enough to amortise a tile's reduction over a short K
// Bytes ahead of the weight stream to ask for: one thread alone cannot keep enough reads in flight to stream DRAM at
// full speed. Far enough to cover the memory's latency at the pace of a pass of 8 rows (the compute of a verified
// tree), not only at one row's, when the hardware's own prefetch keeps up: too short, and a forward of several rows
// takes compute time plus memory time (docs/engine.md).
constexpr int64_t PREFETCH = 8192;

#ifdef SPLITSPEC_AVX512
// A tile of a few rows in one pass (a small tree) on the VNNI builds computes for about as long as its weights take to
// read, and a prefetch into L1 alone keeps too few of them on the way: its weights come into L2 far ahead and into L1
// near. One row keeps the one prefetch, a tile of several passes too (`Ahead` brings its next tile), and so does the
// avx2 build, whose few rows are bound by its multiplies (bench/results/engine-zen4).
constexpr int64_t STREAM_L2 = 65536, STREAM_L1 = 4096;

// a tile's next ``lines`` lines of weights from ``at``, for a pass of ``rows`` rows (``ahead``: what else fetches)
inline void stream_ahead(const uint8_t* at, int lines, int rows, const Ahead& ahead) {
  const bool two_levels = rows > 1 && !ahead.begin[0];
  for (int line = 0; line < lines; ++line) {
    const char* p = reinterpret_cast<const char*>(at + 64 * line);
    if (two_levels) {
      _mm_prefetch(p + STREAM_L2, _MM_HINT_T1);
      _mm_prefetch(p + STREAM_L1, _MM_HINT_T0);
    } else {
      _mm_prefetch(p + PREFETCH, _MM_HINT_T0);
    }
  }
}
#endif

#if defined(SPLITSPEC_AVX512)
// The VNNI build lays int8 weights out by columns (pack_int8's "cols16"): tiles of W8 = 16 weight rows, each K
// group of 4 values as 64 bytes, column after column ([N / 16, Kp / 4, 16, 4]): a 32-bit lane is one column, and
// one vpdpbusd adds its 4 products with 4 activations broadcast. VNNI multiplies unsigned by signed bytes:
// x·w = (x + 128)·w − 128·w, so the activations go in offset by 128 (Rows.u) and each column's sum of weights
// comes from one more vpdpbusd a group, shared by every row of the tile. All sums are exact int32s: the same
// result as the AVX2 and portable builds' layout.
constexpr int64_t W8 = 16;

template <int R>
void i8_tile(const Rows& x, int64_t r0, const int8_t* w, int64_t Kp, const Ahead& ahead, int32_t* out) {
  __m512i acc[R][2], wsum[2];  // two chains (even and odd K groups): a vpdpbusd waits for the one before it
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  wsum[0] = wsum[1] = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  const uint8_t* xu[R];
  for (int r = 0; r < R; ++r) xu[r] = x.u.data() + (r0 + r) * Kp;
  for (int64_t j = 0; j < Kp / 4; j += 2) {  // Kp is a multiple of 32: the groups come in pairs
    const int8_t* chunk = w + j * 64;
    stream_ahead(reinterpret_cast<const uint8_t*>(chunk), 2, R, ahead);
    ahead.fetch(j / 2);
    const __m512i w0 = _mm512_loadu_si512(chunk), w1 = _mm512_loadu_si512(chunk + 64);
    wsum[0] = _mm512_dpbusd_epi32(wsum[0], ones, w0);
    wsum[1] = _mm512_dpbusd_epi32(wsum[1], ones, w1);
    for (int r = 0; r < R; ++r) {
      int32_t u0, u1;
      std::memcpy(&u0, xu[r] + 4 * j, 4);
      std::memcpy(&u1, xu[r] + 4 * j + 4, 4);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], _mm512_set1_epi32(u0), w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], _mm512_set1_epi32(u1), w1);
    }
  }
  const __m512i correction = _mm512_slli_epi32(_mm512_add_epi32(wsum[0], wsum[1]), 7);  // 128 x a column's sum
  for (int r = 0; r < R; ++r)
    _mm512_storeu_si512(out + r * W8, _mm512_sub_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]), correction));
}

#ifdef SPLITSPEC_AMX
// The int8 gemm on AMX tiles: cols16 weights are already a tile multiply's second operand (16 rows of 4-byte groups,
// one per column), so a row's sum over all of K builds up in one int32 tile. A pass takes up to 32 rows (two tiles of
// rows) and two tiles of 16 columns: four tiles of sums, each load of activations or weights used twice, and four
// independent chains of multiplies to hide a multiply's latency. Tiles: 0-3 sums, 4-5 activations, 6-7 weights.
// A K that is not a multiple of 64 ends on a step of 32: its weights staged with zero groups after them, so the
// activations' 32 bytes past K (the next row's, or ROW_PAD's zeros) add nothing.
// (GCC's tile intrinsics paste their tile numbers into the instruction's text: they must be literals)
#define SPLITSPEC_AMX_STEP(K, B0, B1)        \
  _tile_loadd(4, xr + K, Kp);                \
  _tile_loadd(6, B0, 64);                    \
  _tile_dpbssd(0, 4, 6);                     \
  if constexpr (PAIR) {                      \
    _tile_loadd(7, B1, 64);                  \
    _tile_dpbssd(1, 4, 7);                   \
  }                                          \
  if constexpr (TWO) {                       \
    _tile_loadd(5, xr + 16 * Kp + K, Kp);    \
    _tile_dpbssd(2, 5, 6);                   \
    if constexpr (PAIR) _tile_dpbssd(3, 5, 7); \
  }

// Every line of a weight tile is fetched into L2 AMX_AHEAD bytes (8 steps) ahead: a tile load that misses stalls the
// tile unit
constexpr int64_t AMX_AHEAD = 16384;
inline void fetch_tile(const int8_t* w) {
  for (int l = 0; l < 16; ++l) _mm_prefetch(reinterpret_cast<const char*>(w + AMX_AHEAD + 64 * l), _MM_HINT_T1);
}

// Sums of rows [0, 16 or 32) of xr with one or two column tiles (w0, and the next when PAIR) into acc, 32 a row
template <bool TWO, bool PAIR>
void amx_sums(const int8_t* xr, const int8_t* w0, int64_t Kp, int32_t* acc) {
  const int8_t* w1 = w0 + Kp * W8;
  _tile_zero(0);
  if constexpr (PAIR) _tile_zero(1);
  if constexpr (TWO) _tile_zero(2);
  if constexpr (TWO && PAIR) _tile_zero(3);
  const int64_t whole = Kp / 64 * 64;
  for (int64_t k = 0; k < whole; k += 64) {
    fetch_tile(w0 + k * W8);
    if constexpr (PAIR) fetch_tile(w1 + k * W8);
    SPLITSPEC_AMX_STEP(k, w0 + k * W8, w1 + k * W8)
  }
  if (whole < Kp) {
    alignas(64) int8_t b0[16 * 64] = {}, b1[16 * 64] = {};
    std::memcpy(b0, w0 + whole * W8, 32 * W8);
    if constexpr (PAIR) std::memcpy(b1, w1 + whole * W8, 32 * W8);
    asm volatile("" ::: "memory");  // GCC's tile loads are asm that names no memory: the copies must not be dropped
    SPLITSPEC_AMX_STEP(whole, b0, b1)
  }
  constexpr int64_t width = 2 * W8 * 4;  // bytes of a row of acc
  _tile_stored(0, acc, width);
  if constexpr (PAIR) _tile_stored(1, acc + W8, width);
  if constexpr (TWO) _tile_stored(2, acc + 16 * 2 * W8, width);
  if constexpr (TWO && PAIR) _tile_stored(3, acc + 16 * 2 * W8 + W8, width);
}
#undef SPLITSPEC_AMX_STEP

void gemm_amx(const Rows& x, const int8_t* w, const float* w_scale, const float* bias, const float* residual,
              int64_t N, int64_t ld, float* y, const Split& split) {
  const int64_t M = x.M, Kp = x.Kp, tiles = (N + W8 - 1) / W8, step = balanced(M, 32);
  static const TileShapes shapes = TileShapes().tile(0, 16, 64).tile(1, 16, 64).tile(2, 16, 64).tile(3, 16, 64)
                                       .tile(4, 16, 64).tile(5, 16, 64).tile(6, 16, 64).tile(7, 16, 64);  // fmt: skip
  for_range(tiles, 2, split, [&](int64_t t0, int64_t t1) {
    const Tiles use(shapes);
    alignas(64) int32_t acc[32 * 2 * W8];
    for (int64_t t = t0; t < t1; t += 2) {
      const int64_t n = t * W8, cols = std::min<int64_t>((t + 1 < t1 ? 2 : 1) * W8, N - n);
      for (int64_t r0 = 0; r0 < M; r0 += step) {
        const int64_t rows = std::min<int64_t>(step, M - r0);
        const int8_t* xr = x.q.data() + r0 * Kp;
        if (t + 1 < t1) {
          if (rows > 16) amx_sums<true, true>(xr, w + n * Kp, Kp, acc);
          else amx_sums<false, true>(xr, w + n * Kp, Kp, acc);
        } else {
          if (rows > 16) amx_sums<true, false>(xr, w + n * Kp, Kp, acc);
          else amx_sums<false, false>(xr, w + n * Kp, Kp, acc);
        }
        int8_outputs(x, r0, rows, acc, 2 * W8, w_scale, bias, residual, n, cols, ld, y);
      }
    }
  });
}
#endif

// y[M, N] = dequant(x · wᵀ) (+ bias) (+ residual), rows ld apart, for "cols16" weights: threads split the tiles; a
// tile's weights (Kp · 16 bytes) stay in L1 while every pass of up to 8 activation rows goes over them.
void gemm(const Rows& x, const int8_t* w, const float* w_scale, const float* bias, const float* residual,
          int64_t N, int64_t ld, float* y, const Split& split = {}) {
#ifdef SPLITSPEC_AMX
  if (x.M >= AMX_ROWS) return gemm_amx(x, w, w_scale, bias, residual, N, ld, y, split);
#endif
  const int64_t M = x.M, Kp = x.Kp;
  constexpr int64_t R = 8;
  const int64_t tiles = (N + W8 - 1) / W8, step = balanced(M, R);
  for_range(tiles, 2, split, [&](int64_t t0, int64_t t1) {
    alignas(64) int32_t acc[R * W8];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * W8, cols = std::min<int64_t>(W8, N - n);
      const int64_t passes = (M + step - 1) / step, pairs = Kp / 8;
      Ahead ahead;
      if (passes > 1 && t + 1 < tiles) {
        ahead.begin[0] = reinterpret_cast<const char*>(w + (n + W8) * Kp);
        ahead.lines[0] = Kp * W8 / 64;
        ahead.steps = passes * pairs;
      }
      for (int64_t r0 = 0; r0 < M; r0 += step) {
        const int64_t rows = std::min<int64_t>(step, M - r0);
        ahead.first = r0 / step * pairs;
        with_rows<R>(rows, [&](auto tile) { i8_tile<decltype(tile)::value>(x, r0, w + n * Kp, Kp, ahead, acc); });
        int8_outputs(x, r0, rows, acc, W8, w_scale, bias, residual, n, cols, ld, y);
      }
    }
  });
}

// The int8 weight layout this build reads (pack_int8's ``layout``).
std::string int8_layout() { return "cols16"; }
#else
#if defined(SPLITSPEC_AVX2)
// the four lane-sums of a[0..3] as one vector
inline __m128i hsum4(const __m256i* a) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

template <int R>
void dot_tile(const Rows& x, int64_t r0, const int8_t* w, int64_t Kp, int32_t* out) {
  // |x| * sign(w, x) == x * w, and with |x|, |w| <= 127 a pair of such products fits int16
  // (_mm256_maddubs_epi16 saturates nothing): the sums are exact.
  __m256i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_si256();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < Kp; k += KSTEP) {
    const int8_t* chunk = w + k * C;  // the tile's C rows of this K step, contiguous (see gemm)
    _mm_prefetch(reinterpret_cast<const char*>(chunk + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(chunk + PREFETCH + 64), _MM_HINT_T0);
    __m256i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + c * KSTEP));
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a.data() + (r0 + r) * Kp + k));
      const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + (r0 + r) * Kp + k));
      for (int c = 0; c < C; ++c) {
#ifdef SPLITSPEC_AVXVNNI  // one instruction for the same exact sum
        acc[r][c] = _mm256_dpbusd_avx_epi32(acc[r][c], a, _mm256_sign_epi8(wv[c], s));
#else
        const __m256i p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(wv[c], s));
        acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(p, ones));
#endif
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * C), hsum4(acc[r]));
}
#else
template <int R>
void dot_tile(const Rows& x, int64_t r0, const int8_t* w, int64_t Kp, int32_t* out) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int8_t* xr = x.q.data() + (r0 + r) * Kp;
      int32_t s = 0;
      for (int64_t k = 0; k < Kp; ++k) s += static_cast<int32_t>(xr[k]) * w[(k / KSTEP) * C * KSTEP + c * KSTEP + k % KSTEP];
      out[r * C + c] = s;
    }
}
#endif

// y[M, N] = dequant(x · wᵀ) (+ bias) (+ residual), rows ld apart. Threads split the output columns, so one row
// streams the weights once; for many rows a tile of weight rows stays in L1 while every activation
// row passes over it. w holds N rows rounded up to a multiple of C (zeros past N), tiled: tile t's K
// step k is its C rows' 32 values each, contiguous ([N / C, Kp / 32, C, 32]), one sequential stream.
void gemm(const Rows& x, const int8_t* w, const float* w_scale, const float* bias, const float* residual,
          int64_t N, int64_t ld, float* y, const Split& split = {}) {
  const int64_t M = x.M, Kp = x.Kp;
  constexpr int64_t R = 2;
  const int64_t tiles = (N + C - 1) / C;
  for_range(tiles, 8, split, [&](int64_t t0, int64_t t1) {
    int32_t acc[R * C];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * C, cols = std::min<int64_t>(C, N - n);
      for (int64_t r0 = 0; r0 < M; r0 += R) {
        const int64_t rows = std::min<int64_t>(R, M - r0);
        with_rows<R>(rows, [&](auto tile) { dot_tile<decltype(tile)::value>(x, r0, w + n * Kp, Kp, acc); });
        int8_outputs(x, r0, rows, acc, C, w_scale, bias, residual, n, cols, ld, y);
      }
    }
  });
}

// The int8 weight layout this build reads (pack_int8's ``layout``).
std::string int8_layout() { return "rows4"; }
#endif  // the int8 kernels of the AVX2 and portable builds

// ---------------------------------------------------------------------------------------------
// 4-bit weights (Q4_1: blocks of 32 values along K, w = d·q + m with q in 0..15 and fp16 d, m per block) times
// int8 activations with a scale per block (Q8). A block's integer dot product is exact; blocks are summed in
// float in K order: acc = fma(float(isum)·d, x_scale, acc), then acc = fma(m, x_block_sum, acc).
//
// The vector lanes are output columns, not K positions: a tile is Q4 = 16 columns, and one multiply
// (maddubs: unsigned 4-bit weights times signed activations) covers the tile's 16 columns at two K
// positions, against those two activations broadcast. A pair's products are at most 2·15·127 = 3810, so 8
// pairs add up in int16 (≤ 30480) before widening: about a quarter of the multiplies and float work of a
// dot product per column (horizontal sums and per-column scale broadcasts), and no horizontal sum at all.
// Layout: tile t (16 columns), block b: 8 groups of 32 bytes; group g's byte 2c + e holds column c's value
// 2g + e in its low nibble and value 2(g + 8) + e in its high nibble. Then 16 fp16 d, 16 fp16 m, in the
// column order {0-3, 8-11, 4-7, 12-15} that widening the int16 sums produces (see q4_tile).
//
// Q4_K (KQ, served as it is at its own 4.5 bits): a block's step and minimum are 6-bit integers (its 16 columns' sc
// and mn, 32 bytes after the values, 288 a block) times an fp16 d and -dmin per column and super-block of 256 values
// ([N / 16, K / 256, 2, 16] apart): d·sc and -dmin·mn, exact in fp32, then the same float steps.

constexpr int64_t Q4 = 16;  // columns per 4-bit tile
constexpr int64_t Q4B = 8 * 32, Q4KB = Q4B + 2 * Q4;  // bytes a tile streams a block: Q4_1, Q4_K

#if defined(SPLITSPEC_AVX512)
// VNNI: a 32-bit lane multiplies 4 unsigned weights by 4 signed activations and adds them (vpdpbusd), so a
// lane is one column and a block's 32 values are 8 such steps. A byte permutation (vpermb) of two groups
// (64 bytes) gives each lane its column's values 2g..2g+3 (low nibbles) and 2g+16..2g+19 (high nibbles), in
// the column order of the scales ({0-3, 8-11, 4-7, 12-15}), once for all the rows. A block's int32 sum is
// exact and the float steps per column are those of the AVX2 path: the same bits.
// TN tiles side by side (TN x 16 columns): a row's activation broadcasts and block scalars serve them all
// lane j holds column col[j]; its bytes: (group g, col, e = 0), (g, col, 1), (g + 1, col, 0), (g + 1, col, 1)
inline __m512i q4_pick() {
  static const __m512i pick = [] {
    alignas(64) uint8_t idx[64];
    static constexpr int col[Q4] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    for (int j = 0; j < Q4; ++j)
      for (int i = 0; i < 4; ++i) idx[4 * j + i] = static_cast<uint8_t>((i / 2) * 32 + 2 * col[j] + i % 2);
    return _mm512_load_si512(idx);
  }();
  return pick;
}

// a block's activations 2g..2g+3 (xl) and 2g+16..2g+19 (xh), each broadcast to every 32-bit lane: what the 4 values
// a lane holds of its column (low and high nibbles of steps g, g + 1) are multiplied by
inline void broadcast_steps(const int8_t* block, int g, __m512i& xl, __m512i& xh) {
  int32_t lo4, hi4;
  std::memcpy(&lo4, block + 2 * g, 4);
  std::memcpy(&hi4, block + 16 + 2 * g, 4);
  xl = _mm512_set1_epi32(lo4);
  xh = _mm512_set1_epi32(hi4);
}

// acc + w · 4 signed bytes at x broadcast to every lane: one vpdpbusd that reads its broadcast from memory, where GCC
// emits a broadcast and then the multiply (timings: bench/results/engine-zen4)
inline __m512i dpbusd_at(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

template <int R, int TN = 1, bool KQ = false>
void q4_tile(const Rows& x, int64_t r0, const uint8_t* w, const uint16_t* dm, int64_t Kb, const Ahead& ahead,
             float* out) {
  constexpr int64_t BB = KQ ? Q4KB : Q4B;
  const __m512i pick = q4_pick();
  const __m512i low = _mm512_set1_epi8(15);
  const int64_t tile_bytes = Kb * BB, scale_halves = KQ ? Kb / 8 * 2 * Q4 : Kb * 2 * Q4;
  __m512 acc[R][TN];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < TN; ++u) acc[r][u] = _mm512_setzero_ps();
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (r0 + r) * x.Kp;
  __m512 dsup[TN], msup[TN];
  for (int64_t b = 0; b < Kb; ++b) {
    for (int u = 0; u < TN; ++u) stream_ahead(w + u * tile_bytes + b * BB, 4, R, ahead);
    ahead.fetch(b);
    __m512i isum[R][TN];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < TN; ++u) isum[r][u] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g += 2) {
      __m512i wl[TN], wh[TN];
      for (int u = 0; u < TN; ++u) {
        const __m512i raw = _mm512_permutexvar_epi8(pick, _mm512_loadu_si512(w + u * tile_bytes + b * BB + 32 * g));
        wl[u] = _mm512_and_si512(raw, low);
        wh[u] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        if constexpr (TN == 1) {  // (two tiles side by side share one broadcast in a register)
          const int8_t* xb = xq[r] + b * KSTEP + 2 * g;  // values 2g..2g+3, and 16 on: 2g+16..2g+19
          isum[r][0] = dpbusd_at(dpbusd_at(isum[r][0], wl[0], xb), wh[0], xb + 16);
          continue;
        }
        __m512i xl, xh;
        broadcast_steps(xq[r] + b * KSTEP, g, xl, xh);
        for (int u = 0; u < TN; ++u) {
          isum[r][u] = _mm512_dpbusd_epi32(isum[r][u], wl[u], xl);
          isum[r][u] = _mm512_dpbusd_epi32(isum[r][u], wh[u], xh);
        }
      }
    }
    __m512 d[TN], m[TN];
    for (int u = 0; u < TN; ++u) {
      if (!KQ || b % 8 == 0) {  // a block's scales (Q4_K: a super-block's d and -dmin)
        const uint16_t* sb = dm + u * scale_halves + (KQ ? b / 8 : b) * 2 * Q4;
        dsup[u] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
        msup[u] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + Q4)));
      }
      d[u] = dsup[u], m[u] = msup[u];
      if constexpr (KQ) {  // times the block's 6-bit sc and mn
        const __m256i k6 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + u * tile_bytes + b * BB + Q4B));
        d[u] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(k6))), d[u]);
        m[u] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(k6, 1))), m[u]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_set1_ps(x.scale[(r0 + r) * Kb + b]), bs = _mm512_set1_ps(x.bsum[(r0 + r) * Kb + b]);
      for (int u = 0; u < TN; ++u)
        acc[r][u] = _mm512_fmadd_ps(m[u], bs, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][u]), d[u]), sx,
                                                              acc[r][u]));  // fmt: skip
    }
  }
  for (int r = 0; r < R; ++r)  // lanes {0-3, 8-11, 4-7, 12-15} back to column order: swap the middle quarters
    for (int u = 0; u < TN; ++u)
      _mm512_storeu_ps(out + (r * TN + u) * Q4, _mm512_shuffle_f32x4(acc[r][u], acc[r][u], _MM_SHUFFLE(3, 1, 2, 0)));
}
#elif defined(SPLITSPEC_AVX2)
template <int R, int TN = 1, bool KQ = false>
void q4_tile(const Rows& x, int64_t r0, const uint8_t* w, const uint16_t* dm, int64_t Kb, const Ahead& ahead,
             float* out) {
  static_assert(TN == 1, "the AVX2 build runs one tile at a time");
  constexpr int64_t BB = KQ ? Q4KB : Q4B;
  __m256 lo_acc[R], hi_acc[R];  // columns {0-3, 8-11} and {4-7, 12-15}
  for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(15);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (r0 + r) * x.Kp;
  for (int64_t b = 0; b < Kb; ++b) {
    const uint8_t* qb = w + b * BB;
    for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(qb + PREFETCH + 64 * line), _MM_HINT_T0);
    // Two steps' 16-bit pairs interleaved give each column's 4 values in a 32-bit lane (columns {0-3, 8-11} from
    // unpacklo, {4-7, 12-15} from unpackhi), multiplied by 4 activations broadcast (a load, no shuffle): one
    // vpdpbusd (avx-vnni), or vpmaddubsw into int16 lanes whose 8 pair sums a block stay under 2^15 (8·2·15·127),
    // widened once a block (avx2). The same exact int32 sums either way.
    __m256i isum_lo[R], isum_hi[R];
    for (int r = 0; r < R; ++r) isum_lo[r] = isum_hi[r] = _mm256_setzero_si256();
#ifndef SPLITSPEC_AVXVNNI
#pragma GCC unroll 1  // rolled, as GCC leaves the 6-row pass: unrolled, the shorter passes spill more of their sums
#endif
    for (int g = 0; g < 8; g += 2) {
      const __m256i ra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * g));
      const __m256i rb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * g + 32));
      const __m256i lo4 = _mm256_unpacklo_epi16(ra, rb), hi4 = _mm256_unpackhi_epi16(ra, rb);
      const __m256i lo_a = _mm256_and_si256(lo4, low), lo_b = _mm256_and_si256(_mm256_srli_epi16(lo4, 4), low);
      const __m256i hi_a = _mm256_and_si256(hi4, low), hi_b = _mm256_and_si256(_mm256_srli_epi16(hi4, 4), low);
      for (int r = 0; r < R; ++r) {  // values 2g..2g+3 (low nibbles) and 16+2g..16+2g+3 (high nibbles)
        int32_t va, vb;
        std::memcpy(&va, xq[r] + b * KSTEP + 2 * g, 4);
        std::memcpy(&vb, xq[r] + b * KSTEP + 16 + 2 * g, 4);
        const __m256i xa = _mm256_set1_epi32(va), xb = _mm256_set1_epi32(vb);
#ifdef SPLITSPEC_AVXVNNI
        isum_lo[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(isum_lo[r], lo_a, xa), lo_b, xb);
        isum_hi[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(isum_hi[r], hi_a, xa), hi_b, xb);
#else
        isum_lo[r] = _mm256_add_epi16(isum_lo[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo_a, xa),
                                                                   _mm256_maddubs_epi16(lo_b, xb)));
        isum_hi[r] = _mm256_add_epi16(isum_hi[r], _mm256_add_epi16(_mm256_maddubs_epi16(hi_a, xa),
                                                                   _mm256_maddubs_epi16(hi_b, xb)));
#endif
      }
    }
#ifndef SPLITSPEC_AVXVNNI
    for (int r = 0; r < R; ++r) {
      isum_lo[r] = _mm256_madd_epi16(isum_lo[r], ones);
      isum_hi[r] = _mm256_madd_epi16(isum_hi[r], ones);
    }
#endif
    const uint16_t* sb = dm + (KQ ? b / 8 : b) * 2 * Q4;
    const auto scale = [&](int at) {  // 8 columns' step or minimum: fp16, times the 6-bit sc or mn for Q4_K
      const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + at)));
      if constexpr (!KQ) return f;
      const __m128i k6 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + Q4B + at));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k6)), f);
    };
    const __m256 d_lo = scale(0), d_hi = scale(8), m_lo = scale(16), m_hi = scale(24);
    for (int r = 0; r < R; ++r) {
      const __m256 lo = _mm256_cvtepi32_ps(isum_lo[r]), hi = _mm256_cvtepi32_ps(isum_hi[r]);
      const __m256 sx = _mm256_set1_ps(x.scale[(r0 + r) * Kb + b]), bs = _mm256_set1_ps(x.bsum[(r0 + r) * Kb + b]);
      lo_acc[r] = _mm256_fmadd_ps(m_lo, bs, _mm256_fmadd_ps(_mm256_mul_ps(lo, d_lo), sx, lo_acc[r]));
      hi_acc[r] = _mm256_fmadd_ps(m_hi, bs, _mm256_fmadd_ps(_mm256_mul_ps(hi, d_hi), sx, hi_acc[r]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * Q4, _mm256_permute2f128_ps(lo_acc[r], hi_acc[r], 0x20));
    _mm256_storeu_ps(out + r * Q4 + 8, _mm256_permute2f128_ps(lo_acc[r], hi_acc[r], 0x31));
  }
}
#else
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

template <int R, int TN = 1, bool KQ = false>
void q4_tile(const Rows& x, int64_t r0, const uint8_t* w, const uint16_t* dm, int64_t Kb, const Ahead& ahead,
             float* out) {
  static_assert(TN == 1, "the portable build runs one tile at a time");
  constexpr int64_t BB = KQ ? Q4KB : Q4B;
  static constexpr int slot[Q4] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};  // column -> scale slot
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < Q4; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < Kb; ++b) {
        const uint8_t* qb = w + b * BB;
        const int8_t* xr = x.q.data() + (r0 + r) * x.Kp + b * KSTEP;
        int32_t s = 0;
        for (int g = 0; g < 8; ++g)
          for (int e = 0; e < 2; ++e) {
            const uint8_t byte = qb[32 * g + 2 * c + e];
            s += (byte & 15) * xr[2 * g + e] + (byte >> 4) * xr[2 * (g + 8) + e];
          }
        const uint16_t* sb = dm + (KQ ? b / 8 : b) * 2 * Q4;
        const int64_t i = (r0 + r) * Kb + b;
        float d = half_to_float(sb[slot[c]]), m = half_to_float(sb[Q4 + slot[c]]);
        if (KQ) {
          d = static_cast<float>(qb[Q4B + slot[c]]) * d;
          m = static_cast<float>(qb[Q4B + Q4 + slot[c]]) * m;
        }
        acc = std::fma(static_cast<float>(s) * d, x.scale[i], acc);
        acc = std::fma(m, x.bsum[i], acc);
      }
      out[r * Q4 + c] = acc;
    }
}
#endif


// 6-bit weights (Q6_K, served as they are): super-blocks of 256 values along K, each 16-value half block h with its
// own int8 scale s_h, and one fp16 d per column and super-block: w = d·s_h·(q − 32), q in 0..63. A tile (16
// columns) streams Q6B = 416 bytes a 32-value block: the low 4 bits of its values in the 4-bit layout (256 bytes),
// their high 2 bits (128 bytes: byte i's bits 0-1 and 2-3 belong to the low and high nibble of 4-bit byte i, bits
// 4-7 likewise to byte i + 128) and the 2 x 16 scales (int8, in the 4-bit scales' column order); the d of every
// super-block follow apart ([N / 16, K / 256, 16] fp16). A half block's dot product with the activations is exact
// (q·x, less 32 x their sum, times s_h: |.| < 2^24, so exact in fp32 too); blocks are summed in float in K order:
// acc = fma(float(isum)·d, x_scale, acc), the 4-bit path's step without its minimum.
constexpr int64_t Q6B = 8 * 32 + 4 * 32 + 2 * Q4;  // bytes a tile streams a block

#if defined(SPLITSPEC_AVX512)
template <int R, int TN = 1>
void q6_tile(const Rows& x, int64_t r0, const uint8_t* w, const uint16_t* dsup, int64_t Kb, const Ahead& ahead,
             float* out) {
  const __m512i pick = q4_pick(), low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  const int64_t tile_bytes = Kb * Q6B, d_halves = Kb / 8 * Q4;
  __m512 acc[R][TN];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < TN; ++u) acc[r][u] = _mm512_setzero_ps();
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (r0 + r) * x.Kp;
  __m512 d[TN];
  for (int64_t b = 0; b < Kb; ++b) {
    for (int u = 0; u < TN; ++u) stream_ahead(w + u * tile_bytes + b * Q6B, 7, R, ahead);
    ahead.fetch(b);
    __m512i first[R][TN], second[R][TN];  // the block's two half blocks (values 0-15, 16-31), from their offsets
    for (int r = 0; r < R; ++r) {
      const int32_t* hs = x.hoff.data() + ((r0 + r) * Kb + b) * 2;
      for (int u = 0; u < TN; ++u) first[r][u] = _mm512_set1_epi32(hs[0]), second[r][u] = _mm512_set1_epi32(hs[1]);
    }
    for (int g = 0; g < 8; g += 2) {
      __m512i wl[TN], wh[TN];
      for (int u = 0; u < TN; ++u) {
        const uint8_t* wb = w + u * tile_bytes + b * Q6B;
        const __m512i raw = _mm512_permutexvar_epi8(pick, _mm512_loadu_si512(wb + 32 * g));
        // the high bits: byte i's bits 0-1 and 2-3 (steps g < 4) or 4-5 and 6-7, moved to bits 4-5
        const __m512i h = _mm512_permutexvar_epi8(pick, _mm512_loadu_si512(wb + 256 + 32 * (g % 4)));
        const __m512i hl = g < 4 ? _mm512_slli_epi16(h, 4) : h;
        const __m512i hh = g < 4 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
        wl[u] = _mm512_or_si512(_mm512_and_si512(raw, low), _mm512_and_si512(hl, top));
        wh[u] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), _mm512_and_si512(hh, top));
      }
      for (int r = 0; r < R; ++r) {
        if constexpr (TN == 1 && R <= 5) {  // (more rows spill sums, and a memory operand then costs more)
          const int8_t* xb = xq[r] + b * KSTEP + 2 * g;
          first[r][0] = dpbusd_at(first[r][0], wl[0], xb);
          second[r][0] = dpbusd_at(second[r][0], wh[0], xb + 16);
          continue;
        }
        __m512i xl, xh;
        broadcast_steps(xq[r] + b * KSTEP, g, xl, xh);
        for (int u = 0; u < TN; ++u) {
          first[r][u] = _mm512_dpbusd_epi32(first[r][u], wl[u], xl);
          second[r][u] = _mm512_dpbusd_epi32(second[r][u], wh[u], xh);
        }
      }
    }
    __m512 s0[TN], s1[TN];  // d·scale of each half block: exact in fp32
    for (int u = 0; u < TN; ++u) {
      if (b % 8 == 0)  // a super-block's d
        d[u] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dsup + u * d_halves + b / 8 * Q4)));
      const __m256i sc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + u * tile_bytes + b * Q6B + 384));
      s0[u] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(sc))), d[u]);
      s1[u] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(sc, 1))), d[u]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_set1_ps(x.scale[(r0 + r) * Kb + b]);
      for (int u = 0; u < TN; ++u) {
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second[r][u]), s1[u],
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(first[r][u]), s0[u]));
        acc[r][u] = _mm512_fmadd_ps(v, sx, acc[r][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < TN; ++u)
      _mm512_storeu_ps(out + (r * TN + u) * Q4, _mm512_shuffle_f32x4(acc[r][u], acc[r][u], _MM_SHUFFLE(3, 1, 2, 0)));
}
#elif defined(SPLITSPEC_AVX2)
// a 6-bit byte pair's values: low nibbles | high bits (bits 0-1 of h, or 4-5 for the upper steps, moved to bits 4-5),
// high nibbles | bits 2-3 of h (or 6-7)
inline void six_bits(__m256i raw, __m256i h, bool upper, __m256i& wl, __m256i& wh) {
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  const __m256i hl = upper ? h : _mm256_slli_epi16(h, 4), hh = upper ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2);
  wl = _mm256_or_si256(_mm256_and_si256(raw, low), _mm256_and_si256(hl, top));
  wh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), _mm256_and_si256(hh, top));
}

template <int R, int TN = 1>
void q6_tile(const Rows& x, int64_t r0, const uint8_t* w, const uint16_t* dsup, int64_t Kb, const Ahead& ahead,
             float* out) {
  static_assert(TN == 1, "the AVX2 build runs one tile at a time");
  __m256 lo_acc[R], hi_acc[R];  // columns {0-3, 8-11} and {4-7, 12-15}
  for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (r0 + r) * x.Kp;
  // A block's 6-bit values as 4 step pairs (values 4p..4p+3 of each half block: steps 2p, 2p + 1), each the 4-bit
  // path's layout (two steps' pairs interleaved: a column's 4 values a 32-bit lane) in 4 vectors: first half
  // {0-3, 8-11}, {4-7, 12-15}, second half alike. Rows past the first read them from L1, unpacked once a block:
  // unpacking costs as much as a row's multiplies, and 16 registers hold a row's 4 sums but not several rows'.
  // One row takes each pair straight from the registers it was unpacked into.
  alignas(32) __m256i operand[4][4];
  for (int64_t b = 0; b < Kb; ++b) {
    const uint8_t* qb = w + b * Q6B;
    for (int line = 0; line < 7; ++line) _mm_prefetch(reinterpret_cast<const char*>(qb + PREFETCH + 64 * line), _MM_HINT_T0);
    ahead.fetch(b);
    const auto unpack = [&](int p, __m256i* o) {
      const __m256i ra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 64 * p));
      const __m256i rb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 64 * p + 32));
      const auto high = [&](int g) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 256 + 32 * (g % 4)));
      };
      const __m256i ha = high(2 * p), hb = high(2 * p + 1);
      six_bits(_mm256_unpacklo_epi16(ra, rb), _mm256_unpacklo_epi16(ha, hb), p >= 2, o[0], o[2]);
      six_bits(_mm256_unpackhi_epi16(ra, rb), _mm256_unpackhi_epi16(ha, hb), p >= 2, o[1], o[3]);
    };
    // a row's sums over step pairs p and p + 1 added to its 4 int32 sums
    const auto multiply = [&](const __m256i* first, const __m256i* next, const int8_t* xb, int p, __m256i* sums) {
      int32_t v[4];  // the row's values 4p..4p+7 of each half
      std::memcpy(&v[0], xb + 4 * p, 8);
      std::memcpy(&v[2], xb + 16 + 4 * p, 8);
      for (int i = 0; i < 4; ++i) {
        const __m256i xa = _mm256_set1_epi32(v[i < 2 ? 0 : 2]), xb2 = _mm256_set1_epi32(v[i < 2 ? 1 : 3]);
#ifdef SPLITSPEC_AVXVNNI
        sums[i] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(sums[i], first[i], xa), next[i], xb2);
#else  // two step pairs' products add up in int16: 4 · 63 · 128 < 2^15
        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(first[i], xa), _mm256_maddubs_epi16(next[i], xb2));
        sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(pair, ones));
#endif
      }
    };
    // a row's half-block sums (first half {0-3, 8-11}, {4-7, 12-15}; second ...) start from their offsets
    const auto offsets = [&](int r, __m256i* sums) {
      const int32_t* hs = x.hoff.data() + ((r0 + r) * Kb + b) * 2;
      sums[0] = sums[1] = _mm256_set1_epi32(hs[0]);
      sums[2] = sums[3] = _mm256_set1_epi32(hs[1]);
    };
    __m256i alone[4];  // one row's sums, taken as its pairs are unpacked
    if constexpr (R == 1) {
      offsets(0, alone);
      for (int p = 0; p < 4; p += 2) {
        __m256i first[4], next[4];
        unpack(p, first);
        unpack(p + 1, next);
        multiply(first, next, xq[0] + b * KSTEP, p, alone);
      }
    } else {
      for (int p = 0; p < 4; ++p) unpack(p, operand[p]);
    }
    const uint16_t* db = dsup + b / 8 * Q4;
    const __m256 d_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db)));
    const __m256 d_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db + 8)));
    const auto step = [&](int at, __m256 d) {  // d·scale of 8 columns' half blocks: exact in fp32
      const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 384 + at));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
    };
    const __m256 s0_lo = step(0, d_lo), s0_hi = step(8, d_hi), s1_lo = step(Q4, d_lo), s1_hi = step(Q4 + 8, d_hi);
    for (int r = 0; r < R; ++r) {
      __m256i sums[4];
      if constexpr (R == 1) {
        std::copy(alone, alone + 4, sums);
      } else {
        offsets(r, sums);
        for (int p = 0; p < 4; p += 2) multiply(operand[p], operand[p + 1], xq[r] + b * KSTEP, p, sums);
      }
      const __m256 sx = _mm256_set1_ps(x.scale[(r0 + r) * Kb + b]);
      const auto half = [&](__m256i f, __m256i s, __m256 s0, __m256 s1) {
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), s1, _mm256_mul_ps(_mm256_cvtepi32_ps(f), s0));
      };
      lo_acc[r] = _mm256_fmadd_ps(half(sums[0], sums[2], s0_lo, s1_lo), sx, lo_acc[r]);
      hi_acc[r] = _mm256_fmadd_ps(half(sums[1], sums[3], s0_hi, s1_hi), sx, hi_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * Q4, _mm256_permute2f128_ps(lo_acc[r], hi_acc[r], 0x20));
    _mm256_storeu_ps(out + r * Q4 + 8, _mm256_permute2f128_ps(lo_acc[r], hi_acc[r], 0x31));
  }
}
#else
template <int R, int TN = 1>
void q6_tile(const Rows& x, int64_t r0, const uint8_t* w, const uint16_t* dsup, int64_t Kb, const Ahead& ahead,
             float* out) {
  static_assert(TN == 1, "the portable build runs one tile at a time");
  static constexpr int slot[Q4] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};  // column -> scale slot
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < Q4; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < Kb; ++b) {
        const uint8_t* qb = w + b * Q6B;
        const int8_t* xr = x.q.data() + (r0 + r) * x.Kp + b * KSTEP;
        int32_t s0 = 0, s1 = 0;
        for (int g = 0; g < 8; ++g)
          for (int e = 0; e < 2; ++e) {
            const int i = 32 * g + 2 * c + e;
            const uint8_t byte = qb[i], h = static_cast<uint8_t>(qb[256 + i % 128] >> (g >= 4 ? 4 : 0));
            s0 += ((byte & 15) | ((h & 3) << 4)) * xr[2 * g + e];
            s1 += ((byte >> 4) | (((h >> 2) & 3) << 4)) * xr[2 * (g + 8) + e];
          }
        const int8_t* sc = reinterpret_cast<const int8_t*>(qb + 384);
        const int64_t i = (r0 + r) * Kb + b;
        const float d = half_to_float(dsup[b / 8 * Q4 + slot[c]]);
        const float v = std::fma(static_cast<float>(s1 + x.hoff[2 * i + 1]), static_cast<float>(sc[Q4 + slot[c]]) * d,
                                 static_cast<float>(s0 + x.hoff[2 * i]) * (static_cast<float>(sc[slot[c]]) * d));
        acc = std::fma(v, x.scale[i], acc);
      }
      out[r * Q4 + c] = acc;
    }
}
#endif

enum class Blocked { Q4_1, Q4_K, Q6_K };  // the block formats: 4-bit with fp16 scales, 4-bit with 6-bit ones, 6-bit
constexpr int64_t AMX_BLOCK_ROWS = 16;  // rows of an AMX row tile (the amx build's block passes)
constexpr int AMX_LEAST_ROWS = 12;  // fewer 4-bit rows are as fast on the VNNI code (measured)

#ifdef SPLITSPEC_AMX
// Q4_1 and Q4_K on AMX tiles, up to 32 rows a pass. A block's 32 values of the tile's 16 columns are unpacked once
// into a tile operand (q4_tile's byte permutation, then the low and the high nibbles as 8 rows of 4-value groups),
// one tile multiply (tdpbsud: signed activations, unsigned weights) a row tile gives its rows' exact int32 sums of
// the block, and the float steps after it are q4_tile's, lane by lane, in its order: the same bits. The sums go
// through memory every block, so the next block's multiplies are issued before this one's float steps (two tiles of
// sums a row tile, alternating). A pass's rows past 16 take a second row tile of only the rows the call needs
// (AmxRows.second): a 17th row costs a short multiply, not a pass of the VNNI code over the weights.
// Tiles: 2 weights (8 x 64 bytes); rows 0-15: 1 activations (16 x 32 bytes, straight from Rows.q), 0 and 3 sums;
// rows 16 on: 4 activations, 5 and 6 sums.

#define SPLITSPEC_AMX_ROWS(T, A, XQ, SUMS, KP) \
  _tile_loadd(A, XQ, KP);                      \
  _tile_zero(T);                               \
  _tile_dpbsud(T, A, 2);                       \
  _tile_stored(T, SUMS, 64);

template <bool KQ, int R>
void q4_amx_pass(const Rows& x, int64_t r0, const uint8_t* w, const uint16_t* dm, int64_t Kb, const Ahead& ahead,
                 float* out) {  // rows [r0, r0 + R): a tile may load more, rows of a later pass or zeros past M
  static_assert(R <= 2 * AMX_BLOCK_ROWS, "a pass takes two row tiles");
  constexpr bool TWO = R > AMX_BLOCK_ROWS;
  constexpr int64_t BB = KQ ? Q4KB : Q4B;
  const __m512i pick = q4_pick(), low = _mm512_set1_epi8(15);
  alignas(64) uint8_t operand[4][8 * 64];
  alignas(64) int32_t sums[2][2][AMX_BLOCK_ROWS * Q4];  // [block % 2][row tile]
  const int8_t* xq = x.q.data() + r0 * x.Kp;
  const int8_t* xq2 = xq + AMX_BLOCK_ROWS * x.Kp;
  const int64_t Kp = x.Kp;
  auto unpack = [&](int64_t b) {  // low nibbles: values 2g..2g+3 (group row g / 2); high: 2g+16.. (g / 2 + 4)
    const uint8_t* src = w + b * BB;
    for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH + 64 * line), _MM_HINT_T0);
    ahead.fetch(b);
    uint8_t* dst = operand[b & 3];
    for (int g = 0; g < 8; g += 2) {
      const __m512i raw = _mm512_permutexvar_epi8(pick, _mm512_loadu_si512(src + 32 * g));
      _mm512_store_si512(dst + 64 * (g / 2), _mm512_and_si512(raw, low));
      _mm512_store_si512(dst + 64 * (g / 2 + 4), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
  };
  // block b's multiplies, their sums into sums[b % 2]; block b + 1 unpacked first, so that a tile load never waits
  // on the stores just made (15 % a block, measured)
  auto issue = [&](int64_t b) {
    if (b + 1 < Kb) unpack(b + 1);
    asm volatile("" ::: "memory");  // GCC's tile loads and stores are asm that names no memory
    _tile_loadd(2, operand[b & 3], 64);
    if (b & 1) {
      SPLITSPEC_AMX_ROWS(3, 1, xq + b * KSTEP, sums[1][0], Kp)
      if constexpr (TWO) { SPLITSPEC_AMX_ROWS(6, 4, xq2 + b * KSTEP, sums[1][1], Kp) }
    } else {
      SPLITSPEC_AMX_ROWS(0, 1, xq + b * KSTEP, sums[0][0], Kp)
      if constexpr (TWO) { SPLITSPEC_AMX_ROWS(5, 4, xq2 + b * KSTEP, sums[0][1], Kp) }
    }
    asm volatile("" ::: "memory");
  };
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 dsup = _mm512_setzero_ps(), msup = _mm512_setzero_ps();
  unpack(0);
  issue(0);
  for (int64_t b = 0; b < Kb; ++b) {
    if (b + 1 < Kb) issue(b + 1);
    if (!KQ || b % 8 == 0) {  // as in q4_tile
      const uint16_t* sb = dm + (KQ ? b / 8 : b) * 2 * Q4;
      dsup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
      msup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + Q4)));
    }
    __m512 d = dsup, m = msup;
    if constexpr (KQ) {
      const __m256i k6 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * BB + Q4B));
      d = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(k6))), d);
      m = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(k6, 1))), m);
    }
    const int32_t* block = sums[b & 1][0];  // the two row tiles' sums lie one after the other
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_set1_ps(x.scale[(r0 + r) * Kb + b]), bs = _mm512_set1_ps(x.bsum[(r0 + r) * Kb + b]);
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(block + r * Q4));
      acc[r] = _mm512_fmadd_ps(m, bs, _mm512_fmadd_ps(_mm512_mul_ps(isum, d), sx, acc[r]));
    }
  }
  for (int r = 0; r < R; ++r)  // lanes {0-3, 8-11, 4-7, 12-15} back to column order, as q4_tile does
    _mm512_storeu_ps(out + r * Q4, _mm512_shuffle_f32x4(acc[r], acc[r], _MM_SHUFFLE(3, 1, 2, 0)));
}
#undef SPLITSPEC_AMX_ROWS

// Q6_K on tiles, 16 rows a pass: q6_tile's 6-bit values unpacked once into a tile operand (rows 0-3 the block's
// first half, 4-7 its second), two tile multiplies a block (its half blocks have scales of their own: K = 16 each),
// then q6_tile's float steps, lane by lane, in its order.
template <int R>
void q6_amx_pass(const Rows& x, int64_t r0, const uint8_t* w, const uint16_t* dsup, int64_t Kb, const Ahead& ahead,
                 float* out) {
  const __m512i pick = q4_pick(), low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  alignas(64) uint8_t operand[4][8 * 64];
  alignas(64) int32_t sums[2][2][AMX_BLOCK_ROWS * Q4];  // [block % 2][half]
  const int8_t* xq = x.q.data() + r0 * x.Kp;
  const int64_t Kp = x.Kp;
  auto unpack = [&](int64_t b) {
    const uint8_t* wb = w + b * Q6B;
    for (int line = 0; line < 7; ++line) _mm_prefetch(reinterpret_cast<const char*>(wb + PREFETCH + 64 * line), _MM_HINT_T0);
    ahead.fetch(b);
    uint8_t* dst = operand[b & 3];
    for (int g = 0; g < 8; g += 2) {
      const __m512i raw = _mm512_permutexvar_epi8(pick, _mm512_loadu_si512(wb + 32 * g));
      __m512i h = _mm512_permutexvar_epi8(pick, _mm512_loadu_si512(wb + 256 + 32 * (g % 4)));
      if (g >= 4) h = _mm512_srli_epi16(h, 4);
      _mm512_store_si512(dst + 64 * (g / 2), _mm512_or_si512(_mm512_and_si512(raw, low),
                                                             _mm512_and_si512(_mm512_slli_epi16(h, 4), top)));
      _mm512_store_si512(dst + 64 * (g / 2 + 4), _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low),
                                                                 _mm512_and_si512(_mm512_slli_epi16(h, 2), top)));
    }
  };
  auto issue = [&](int64_t b) {  // as in q4_amx_pass: block b + 1 unpacked before block b's tiles load
    if (b + 1 < Kb) unpack(b + 1);
    const uint8_t* dst = operand[b & 3];
    asm volatile("" ::: "memory");  // GCC's tile loads and stores are asm that names no memory
    int32_t(*half)[AMX_BLOCK_ROWS * Q4] = sums[b & 1];
    _tile_loadd(1, xq + b * KSTEP, Kp);
    _tile_loadd(2, dst, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, half[0], 64);
    _tile_loadd(4, xq + b * KSTEP + 16, Kp);
    _tile_loadd(5, dst + 4 * 64, 64);
    _tile_zero(3);
    _tile_dpbsud(3, 4, 5);
    _tile_stored(3, half[1], 64);
    asm volatile("" ::: "memory");
  };
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps();
  unpack(0);
  issue(0);
  for (int64_t b = 0; b < Kb; ++b) {
    if (b + 1 < Kb) issue(b + 1);
    if (b % 8 == 0) d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dsup + b / 8 * Q4)));
    const __m256i sc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * Q6B + 384));
    const __m512 s0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(sc))), d);
    const __m512 s1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(sc, 1))), d);
    int32_t(*half)[AMX_BLOCK_ROWS * Q4] = sums[b & 1];
    for (int r = 0; r < R; ++r) {
      const int32_t* hs = x.hoff.data() + ((r0 + r) * Kb + b) * 2;
      const __m512i o0 = _mm512_set1_epi32(hs[0]), o1 = _mm512_set1_epi32(hs[1]);
      const __m512 sx = _mm512_set1_ps(x.scale[(r0 + r) * Kb + b]);
      const __m512i first = _mm512_load_si512(half[0] + r * Q4), second = _mm512_load_si512(half[1] + r * Q4);
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(second, o1)), s1,
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(first, o0)), s0));
      acc[r] = _mm512_fmadd_ps(v, sx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(out + r * Q4, _mm512_shuffle_f32x4(acc[r], acc[r], _MM_SHUFFLE(3, 1, 2, 0)));
}
#endif


// y[M, N] = x · Wᵀ (+ bias) (+ residual) for block-quantised weights of N rows (a multiple of Q4), their fp16 scales
// in ``dm`` (Q4_1: d and m a block; Q4_K: d and -dmin a super-block; Q6_K: d a super-block); y's and the residual's
// rows ``ld`` apart (N, or a wider output this weight is a part of).
template <Blocked F, int64_t R, int64_t TN>
void gemm_tiles(const Rows& x, const uint8_t* w, const uint16_t* dm, const float* bias, const float* residual,
                int64_t N, int64_t ld, float* y, const Split& split, int64_t tiled = 0) {
  // tiled: rows [0, tiled) on AMX tiles (TN 1), in passes of up to 32 (q4_amx_pass) or 16 (q6_amx_pass); the rest
  // as below
  const int64_t M = x.M, Kb = x.Kp / KSTEP;
  constexpr bool SIX = F == Blocked::Q6_K, KQ = F == Blocked::Q4_K;
  const int64_t on_tiles = tiled > 0 ? (SIX ? AMX_BLOCK_ROWS : balanced(tiled, 2 * AMX_BLOCK_ROWS)) : 1;
  // a tile's bytes: its blocks' values (and integer scales), and its fp16 scales
  const int64_t tile_bytes = Kb * (SIX ? Q6B : KQ ? Q4KB : Q4B);
  const int64_t tile_halves = SIX ? Kb / 8 * Q4 : KQ ? Kb / 8 * 2 * Q4 : Kb * 2 * Q4;
  const int64_t rest = M - tiled, step = rest > 0 ? balanced(rest, R) : 1, tiles = N / Q4, units = (tiles + TN - 1) / TN;
  const int64_t passes = (tiled + on_tiles - 1) / on_tiles + (rest + step - 1) / step;
  for_range(units, 1, split, [&](int64_t u0, int64_t u1) {
#ifdef SPLITSPEC_AMX
    std::optional<Tiles> use;
    if (tiled) {
      const int second = static_cast<int>(std::max<int64_t>(on_tiles - AMX_BLOCK_ROWS, 1));  // rows of a second row tile
      use.emplace(SIX ? TileShapes().tile(0, 16, 64).tile(1, 16, 16).tile(2, 4, 64).tile(3, 16, 64).tile(4, 16, 16)
                            .tile(5, 4, 64)
                      : TileShapes().tile(0, 16, 64).tile(1, 16, 32).tile(2, 8, 64).tile(3, 16, 64)
                            .tile(4, second, 32).tile(5, second, 64).tile(6, second, 64));  // fmt: skip
    }
#endif
    float acc[std::max<int64_t>(R, 2 * AMX_BLOCK_ROWS) * TN * Q4];
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t t = unit * TN, tn = std::min<int64_t>(TN, tiles - t), n = t * Q4, cols = tn * Q4;
      const uint8_t* wt = w + t * tile_bytes;
      const uint16_t* dt = dm + t * tile_halves;
      Ahead ahead;
      if (passes > 1 && t + tn < tiles) {  // one pass: the stream's own prefetch runs ahead into the next tile
        ahead.begin[0] = reinterpret_cast<const char*>(wt + tn * tile_bytes);
        ahead.begin[1] = reinterpret_cast<const char*>(dt + tn * tile_halves);
        ahead.lines[0] = std::min<int64_t>(TN, tiles - t - tn) * tile_bytes / 64;
        ahead.lines[1] = std::min<int64_t>(TN, tiles - t - tn) * tile_halves * 2 / 64;
        ahead.steps = passes * Kb;
      }
      auto emit = [&](int64_t r0, int64_t rows) {
        for (int64_t r = 0; r < rows; ++r) {
          float* yr = y + (r0 + r) * ld + n;
          for (int64_t c = 0; c < cols; ++c) {
            float v = acc[r * tn * Q4 + c];  // the activations' block scales are inside
            if (bias) v += bias[n + c];
            if (residual) v += residual[(r0 + r) * ld + n + c];
            yr[c] = v;
          }
        }
      };
      int64_t pass = 0;
#ifdef SPLITSPEC_AMX
      if constexpr (TN == 1)
        for (int64_t r0 = 0; r0 < tiled; r0 += on_tiles, ++pass) {
          ahead.first = pass * Kb;
          const int64_t rows = std::min<int64_t>(on_tiles, tiled - r0);
          if constexpr (SIX) {
            with_rows<16, 16>(rows, [&](auto tile) { q6_amx_pass<decltype(tile)::value>(x, r0, wt, dt, Kb, ahead, acc); });
          } else {
            with_rows<2 * AMX_BLOCK_ROWS, AMX_LEAST_ROWS>(rows, [&](auto tile) {
              q4_amx_pass<KQ, decltype(tile)::value>(x, r0, wt, dt, Kb, ahead, acc);
            });
          }
          emit(r0, rows);
        }
#endif
      for (int64_t r0 = tiled; r0 < M; r0 += step, ++pass) {
        const int64_t rows = std::min<int64_t>(step, M - r0);
        ahead.first = pass * Kb;
        with_rows<R>(rows, [&](auto tile) {
          constexpr int RT = decltype(tile)::value;
          if constexpr (SIX) {
            if (tn == TN) q6_tile<RT, TN>(x, r0, wt, dt, Kb, ahead, acc);
            else q6_tile<RT, 1>(x, r0, wt, dt, Kb, ahead, acc);
          } else {
            if (tn == TN) q4_tile<RT, TN, KQ>(x, r0, wt, dt, Kb, ahead, acc);
            else q4_tile<RT, 1, KQ>(x, r0, wt, dt, Kb, ahead, acc);
          }
        });
        emit(r0, rows);
      }
    }
  });
}

// R rows x TN tiles a pass, as measured on Zen 5 (avx512; a 1.5B's projections, 1 to 150 rows): up to 32 rows one
// tile at a time, 8 rows a pass (with the prefetch above, 0.6-0.85x the time of two tiles side by side at 7-17 rows;
// as fast at 1-4); past that two tiles share each activation broadcast, 6 rows of 4-bit or 4 of 6-bit, whose two
// half-block sums a row and tile fill the 32 registers (a prompt's prefill: 4-6 % faster than 8 x 1). One tile
// takes 11 rows of 4-bit (a 1.5B's forward of 9-17 rows 0.84-0.92x the time of 8 rows a pass; at 12 its 24 rows
// spilled: 1.03x; Intel Xeon with AMX, 2026-11-29, not yet on Zen 5) and 9 of 6-bit (17 rows in 2 passes, not 3,
// a few of its 27 sums spilled; Zen 4, bench/results/engine-zen4). The AVX2
// builds (16 registers): 6 rows of 4-bit (a 1.5B's 5-row forward 0.83-0.86x the time of 4 rows a pass, 9 rows
// 0.9x; 8 spill); 16 of 6-bit, whose rows read an unpacked block from L1 (a Q6_K projection of 13-17 rows 0.9x
// the time of 12 a pass, 0.8x of 8); Intel Xeon with AMX, 2026-11-29.
template <Blocked F>
void gemm_blocks(const Rows& x, const uint8_t* w, const uint16_t* dm, const float* bias, const float* residual,
                 int64_t N, int64_t ld, float* y, const Split& split = {}) {
#ifdef SPLITSPEC_AVX512
  constexpr bool SIX = F == Blocked::Q6_K;
#ifdef SPLITSPEC_AMX
  // 4-bit: every row of 12-64 on tiles, in passes of 12-32 rows; Q6_K: passes of 16, the rest on the VNNI code (its
  // two multiplies a block pay only from 16; measured)
  constexpr int64_t least = SIX ? AMX_BLOCK_ROWS : AMX_LEAST_ROWS;
  if (x.M >= least && x.M <= 4 * AMX_BLOCK_ROWS)  // a tree's rows; a prefill's: as fast on the VNNI code
    return gemm_tiles<F, 8, 1>(x, w, dm, bias, residual, N, ld, y, split, SIX ? x.M - x.M % 16 : x.M);
#endif
  if (x.M <= 32) gemm_tiles<F, SIX ? 9 : 11, 1>(x, w, dm, bias, residual, N, ld, y, split);
  else gemm_tiles<F, SIX ? 4 : 6, 2>(x, w, dm, bias, residual, N, ld, y, split);
#else
  gemm_tiles<F, F == Blocked::Q6_K ? 16 : 6, 1>(x, w, dm, bias, residual, N, ld, y, split);
#endif
}

// ---------------------------------------------------------------------------------------------
// Float helpers, each one fixed order per row.

#ifdef SPLITSPEC_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of each of n vectors into out[i], four at a time by hsum's own additions in its order: the same sums
inline void hsums(const __m256* v, int n, float* out) {
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256 a01 = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 1], 0x20),
                                     _mm256_permute2f128_ps(v[i], v[i + 1], 0x31));  // lo + hi, two at a time
    const __m256 a23 = _mm256_add_ps(_mm256_permute2f128_ps(v[i + 2], v[i + 3], 0x20),
                                     _mm256_permute2f128_ps(v[i + 2], v[i + 3], 0x31));
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(a01, a23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(a01, a23, _MM_SHUFFLE(3, 2, 3, 2)));  // (0 + 2), (1 + 3)
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(r, r, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 3, 1)));  // then the two
    _mm_storeu_ps(out + i, _mm_unpacklo_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1)));
  }
  for (; i < n; ++i) out[i] = hsum(v[i]);
}

// exp on 8 lanes (Cephes' polynomial, ~1 ulp): deterministic, unlike a library call's choice of path.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// sum of a[i] * b[i], i < n (n a multiple of 8 on the vector path)
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef SPLITSPEC_AVX2
  if (n % 8 == 0) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    return hsum(s);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[i] = exp(x[i]) for i < n
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#ifdef SPLITSPEC_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
    std::memcpy(x + i, tail, (n - i) * sizeof(float));
    return;
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// acc[i] += p * v[i], i < n
inline void axpy(float* acc, float p, const float* v, int64_t n) {
  int64_t i = 0;
#ifdef SPLITSPEC_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * v[i];
}

void rms_norm_rows(const float* x, const float* w, double eps, int64_t M, int64_t K, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    const float ms = dot(xr, xr, K) / static_cast<float>(K);
    const float inv = 1.f / std::sqrt(ms + static_cast<float>(eps));
    for (int64_t k = 0; k < K; ++k) y[m * K + k] = xr[k] * inv * w[k];
  }
}

// ---------------------------------------------------------------------------------------------
// One query's attention over the keys it may see, in slot order.

// A KV cache holds fp32, fp16 (half the bytes a token's attention streams) or bf16 (what a bf16 model's own
// layers write: a drafter's Target Layer Inference over the target's KV). Narrowing rounds to nearest even.
inline float widen(float x) { return x; }
inline float widen(c10::Half h) { return static_cast<float>(h); }
inline float widen(c10::BFloat16 b) { return static_cast<float>(b); }
inline void narrow(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void narrow(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#ifdef SPLITSPEC_AVX2
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);  // round to nearest even, as the vector path
}
inline void narrow(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);  // round to nearest even (NaN kept)
}
#ifdef SPLITSPEC_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is fp32's upper half: widening is a shift
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
#endif

template <typename T>
struct Keys {
  const T* k;
  int64_t k_stride;
  const T* v;
  int64_t v_stride;
  const int64_t* slots;  // the visible slots, ascending
  int64_t n;
};

// Any head size, plain loops (the portable build, and head sizes without a specialisation).
template <typename T>
void attend_query_any(const float* q, int64_t d, const Keys<T>& kv, float scale, float* p, float* out) {
  float top = -INFINITY;
  for (int64_t j = 0; j < kv.n; ++j) {
    const T* k = kv.k + kv.slots[j] * kv.k_stride;
    float s = 0.f;
    for (int64_t e = 0; e < d; ++e) s += q[e] * widen(k[e]);
    p[j] = s * scale;
    top = std::max(top, p[j]);
  }
  for (int64_t j = 0; j < kv.n; ++j) p[j] -= top;
  exp_inplace(p, kv.n);
  float total = 0.f;
  std::fill(out, out + d, 0.f);
  for (int64_t j = 0; j < kv.n; ++j) {
    total += p[j];
    const T* v = kv.v + kv.slots[j] * kv.v_stride;
    for (int64_t e = 0; e < d; ++e) out[e] += p[j] * widen(v[e]);
  }
  const float inv = 1.f / total;
  for (int64_t e = 0; e < d; ++e) out[e] *= inv;
}

#ifdef SPLITSPEC_AVX2
#ifdef __AVX512F__
constexpr int ATT_STEP = 4;  // keys scored, and value vectors summed, at a time: 32 vector registers hold a block
#else
constexpr int ATT_STEP = 2;  // 16 registers
#endif

// softmax(q · kᵀ * scale) · v for NB query heads of D values that share a key/value head: each key and value is
// widened once for all NB. A head's arithmetic is what it would be alone: each key's score is one FMA chain over D
// then a fixed reduction, and the weighted sum of values runs over the keys in order with its accumulators in
// registers. ``p``: NB rows of ``ps`` scores.
template <int D, int NB, typename T>
void attend_block(const float* q, const Keys<T>& kv, float scale, float* p, int64_t ps, float* out) {
  constexpr int V = D / 8, B = ATT_STEP;
  static_assert(V % B == 0, "a head's vectors come in whole steps");
  auto key = [&](int64_t j) { return kv.k + kv.slots[j] * kv.k_stride; };
  int64_t j = 0;
  for (; j + B <= kv.n; j += B) {
    const T* k[B];
    __m256 s[NB][B];
    for (int b = 0; b < B; ++b) k[b] = key(j + b);
    for (int a = 0; a < NB; ++a)
      for (int b = 0; b < B; ++b) s[a][b] = _mm256_setzero_ps();
    for (int i = 0; i < V; ++i) {
      __m256 kc[B];
      for (int b = 0; b < B; ++b) kc[b] = load8(k[b] + 8 * i);
      for (int a = 0; a < NB; ++a) {
        const __m256 qa = _mm256_loadu_ps(q + a * D + 8 * i);
        for (int b = 0; b < B; ++b) s[a][b] = _mm256_fmadd_ps(qa, kc[b], s[a][b]);
      }
    }
    float h[NB * B];
    hsums(&s[0][0], NB * B, h);
    for (int a = 0; a < NB; ++a)
      for (int b = 0; b < B; ++b) p[a * ps + j + b] = h[a * B + b] * scale;
  }
  for (; j < kv.n; ++j) {
    const T* k0 = key(j);
    __m256 s[NB];
    for (int a = 0; a < NB; ++a) s[a] = _mm256_setzero_ps();
    for (int i = 0; i < V; ++i) {
      const __m256 kc = load8(k0 + 8 * i);
      for (int a = 0; a < NB; ++a) s[a] = _mm256_fmadd_ps(_mm256_loadu_ps(q + a * D + 8 * i), kc, s[a]);
    }
    float h[NB];
    hsums(s, NB, h);
    for (int a = 0; a < NB; ++a) p[a * ps + j] = h[a] * scale;
  }
  // the softmax: a maximum is exact in any order, so it runs 8 lanes wide; each query's total runs in slot order,
  // the NB queries' chains side by side (one alone waits on its adds' latency)
  float inv[NB], total[NB];
  for (int a = 0; a < NB; ++a) {
    float* pa = p + a * ps;
    float top = pa[0];
    int64_t t = 0;
    if (kv.n >= 8) {
      __m256 m = _mm256_loadu_ps(pa);
      for (t = 8; t + 8 <= kv.n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(pa + t));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      for (float l : lanes) top = std::max(top, l);
    }
    for (; t < kv.n; ++t) top = std::max(top, pa[t]);
    const __m256 tv = _mm256_set1_ps(top);
    for (t = 0; t + 8 <= kv.n; t += 8) _mm256_storeu_ps(pa + t, _mm256_sub_ps(_mm256_loadu_ps(pa + t), tv));
    for (; t < kv.n; ++t) pa[t] -= top;
    exp_inplace(pa, kv.n);
    total[a] = 0.f;
  }
  for (int64_t t = 0; t < kv.n; ++t)
    for (int a = 0; a < NB; ++a) total[a] += p[a * ps + t];
  for (int a = 0; a < NB; ++a) inv[a] = 1.f / total[a];
  for (int c = 0; c < V; c += B) {
    __m256 acc[NB][B];
    for (int a = 0; a < NB; ++a)
      for (int b = 0; b < B; ++b) acc[a][b] = _mm256_setzero_ps();
    for (int64_t t = 0; t < kv.n; ++t) {
      const T* v = kv.v + kv.slots[t] * kv.v_stride + 8 * c;
      __m256 vc[B];
      for (int b = 0; b < B; ++b) vc[b] = load8(v + 8 * b);
      for (int a = 0; a < NB; ++a) {
        const __m256 pa = _mm256_set1_ps(p[a * ps + t]);
        for (int b = 0; b < B; ++b) acc[a][b] = _mm256_fmadd_ps(pa, vc[b], acc[a][b]);
      }
    }
    for (int a = 0; a < NB; ++a)
      for (int b = 0; b < B; ++b)
        _mm256_storeu_ps(out + a * D + 8 * (c + b), _mm256_mul_ps(acc[a][b], _mm256_set1_ps(inv[a])));
  }
}

// Attention for ``nq`` query heads of D values that share a key/value head (q and out: ``nq`` rows of D), in
// blocks of at most 6 (what the registers hold), as even as they come; ``p``: room for ``nq`` rows of ``ps``.
template <int D, typename T>
void attend_heads(const float* q, int64_t nq, const Keys<T>& kv, float scale, float* p, int64_t ps, float* out) {
  for (int64_t a = 0, left = (nq + 5) / 6; left > 0; --left) {
    const int64_t nb = (nq - a) / left;
    const float* qa = q + a * D;
    float* pa = p + a * ps;
    float* oa = out + a * D;
    switch (nb) {
      case 1: attend_block<D, 1>(qa, kv, scale, pa, ps, oa); break;
      case 2: attend_block<D, 2>(qa, kv, scale, pa, ps, oa); break;
      case 3: attend_block<D, 3>(qa, kv, scale, pa, ps, oa); break;
      case 4: attend_block<D, 4>(qa, kv, scale, pa, ps, oa); break;
      case 5: attend_block<D, 5>(qa, kv, scale, pa, ps, oa); break;
      default: attend_block<D, 6>(qa, kv, scale, pa, ps, oa); break;
    }
    a += nb;
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Argument checks: a wrong call names the tensor and what was expected.

// A weight is int8 [N rounded up to C, K padded to 32] with fp32 scales [N]; 4-bit: uint8 quants
// [N / 16, K / 32, 256] with fp16 scales [N / 16, K / 32, 2, 16] (d, then m; see q4_tile), or Q4_K's [N / 16,
// K / 32, 288] (values, 6-bit sc and mn) with fp16 [N / 16, K / 256, 2, 16] (d, -dmin); or 6-bit: uint8
// [N / 16, K / 32, 416] (values and scales; see Q6B) with fp16 d [N / 16, K / 256, 16]. Returns N.
int64_t check_weight(const at::Tensor& w, const at::Tensor& scale, int64_t K, const char* what) {
  if (w.scalar_type() == at::kByte) {
    const bool six = w.dim() == 3 && w.size(2) == Q6B, kq = w.dim() == 3 && w.size(2) == Q4KB;
    TORCH_CHECK(w.device().is_cpu() && w.dim() == 3 && (w.size(2) == Q4B || kq || six) && w.is_contiguous(), what,
                ": expected contiguous 4-bit quants [N / ", Q4, ", K / 32, ", Q4B, " or ", Q4KB, "] or 6-bit [N / ",
                Q4, ", K / 32, ", Q6B, "], got ", w.sizes());
    TORCH_CHECK(w.size(1) * KSTEP == padded(K), what, ": weight rows hold ", w.size(1) * KSTEP,
                " values; input has K = ", K, ", expected ", padded(K));
    if (six || kq) {
      TORCH_CHECK(w.size(1) % 8 == 0, what, ": k-quant weights come in super-blocks of 256 values; K = ", K);
      const int64_t parts = kq ? 2 : 1;
      TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.dim() == 2 + parts &&
                      scale.size(0) == w.size(0) && scale.size(1) == w.size(1) / 8 && scale.size(-1) == Q4 &&
                      (!kq || scale.size(2) == 2),
                  what, ": expected fp16 super-block scales [", w.size(0), ", ", w.size(1) / 8, kq ? ", 2, " : ", ",
                  Q4, "], got ", scale.scalar_type(), " ", scale.sizes());
      return w.size(0) * Q4;
    }
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.dim() == 4 &&
                    scale.size(0) == w.size(0) && scale.size(1) == w.size(1) && scale.size(2) == 2 && scale.size(3) == Q4,
                what, ": expected fp16 block scales [", w.size(0), ", ", w.size(1), ", 2, ", Q4, "], got ",
                scale.scalar_type(), " ", scale.sizes());
    return w.size(0) * Q4;
  }
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(), what,
              ": expected fp32 row scales, got ", scale.scalar_type(), " ", scale.sizes());
#ifdef SPLITSPEC_AVX512
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kChar && w.dim() == 4 && w.size(2) == W8 &&
                  w.size(3) == 4 && w.is_contiguous(),
              what, ": this build reads int8 weights by columns, [N / 16, K / 4, 16, 4] (pack_int8's layout "
              "'cols16'), got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.size(1) * 4 == padded(K), what, ": weight rows hold ", w.size(1) * 4, " values; input has K = ", K,
              ", expected ", padded(K));
  const int64_t tiles = (scale.numel() + W8 - 1) / W8;
  TORCH_CHECK(w.size(0) == tiles, what, ": ", scale.numel(), " outputs need ", tiles, " tiles of ", W8,
              " rows (zeros past the last), got ", w.size(0));
#else
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(),
              what, ": this build reads a contiguous CPU int8 matrix [N, K padded to 32] (pack_int8's layout "
              "'rows4'), got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.size(1) == padded(K), what, ": weight rows hold ", w.size(1), " values; input has K = ", K,
              ", expected ", padded(K));
  const int64_t rows = (scale.numel() + C - 1) / C * C;
  TORCH_CHECK(w.size(0) == rows, what, ": ", scale.numel(), " outputs need ", rows,
              " weight rows (a multiple of ", C, ", zeros past the last), got ", w.size(0));
#endif
  return scale.numel();
}

const float* optional_vector(const std::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n && t->is_contiguous(), what, ": expected ", n,
              " contiguous fp32 values, got ", t->scalar_type(), " ", t->sizes());
  return t->data_ptr<float>();
}

at::Tensor rows_of(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1, what,
              ": expected fp32 CPU rows, got ", x.scalar_type(), " on ", x.device());
  return x.reshape({-1, x.size(-1)}).contiguous();
}

// A projection as the kernels read it, checked once: int8, 4-bit or 6-bit weights, their scales, an optional bias.
struct Weight {
  enum Kind { INT8, INT4, INT4K, INT6 };
  const void* w = nullptr;
  const void* scale = nullptr;
  const float* bias = nullptr;
  int64_t N = 0, K = 0;
  Kind kind = INT8;
  bool blocks() const { return kind != INT8; }  // activations quantised a block at a time
};

Weight weight_of(const at::Tensor& w, const at::Tensor& scale, const std::optional<at::Tensor>& bias, int64_t K,
                 const char* what) {
  Weight r;
  r.N = check_weight(w, scale, K, what);
  r.K = K;
  r.kind = w.scalar_type() != at::kByte ? Weight::INT8
           : w.size(2) == Q6B              ? Weight::INT6
           : w.size(2) == Q4KB             ? Weight::INT4K
                                           : Weight::INT4;
  r.w = w.data_ptr();
  r.scale = scale.data_ptr();
  r.bias = optional_vector(bias, r.N, "bias");
  return r;
}

// y[M, N] = x[M, K] · Wᵀ (+ bias) (+ residual [M, N]; y may be the residual itself: each output reads only its own)
// y = rows · Wᵀ (+ bias) (+ residual) for quantised rows, over every thread or a Split's share of the columns; y's
// rows ld apart (0: w.N)
void multiply(const Rows& rows, const Weight& w, const float* residual, float* y, const Split& split = {},
              int64_t ld = 0) {
  const auto* wb = static_cast<const uint8_t*>(w.w);
  const auto* sb = static_cast<const uint16_t*>(w.scale);
  ld = ld ? ld : w.N;
  if (w.kind == Weight::INT4)
    gemm_blocks<Blocked::Q4_1>(rows, wb, sb, w.bias, residual, w.N, ld, y, split);
  else if (w.kind == Weight::INT4K)
    gemm_blocks<Blocked::Q4_K>(rows, wb, sb, w.bias, residual, w.N, ld, y, split);
  else if (w.kind == Weight::INT6)
    gemm_blocks<Blocked::Q6_K>(rows, wb, sb, w.bias, residual, w.N, ld, y, split);
  else
    gemm(rows, static_cast<const int8_t*>(w.w), static_cast<const float*>(w.scale), w.bias, residual, w.N, ld, y,
         split);
}

// A fused projection: one weight, or two side by side (``tail``: the output rows after ``head``'s, in another format
// whose activations are quantised alike: a GGUF's q and k in Q4_K fused with its v in Q6_K, each served as it is).
struct Projection {
  Weight head, tail;  // tail.N == 0: none
  int64_t N = 0;
  bool blocks() const { return head.blocks(); }
};

Projection projection_of(const at::Tensor* w, int64_t K, const char* what) {
  auto bias = [&](int i) { return w[i].numel() ? std::optional<at::Tensor>(w[i]) : std::nullopt; };
  Projection p;
  p.head = weight_of(w[0], w[1], bias(2), K, what);
  if (w[3].numel()) {
    p.tail = weight_of(w[3], w[4], bias(5), K, what);
    TORCH_CHECK(p.tail.blocks() == p.head.blocks(), what, ": its two parts quantise their inputs differently (",
                p.head.blocks() ? "blocks" : "rows", " and ", p.tail.blocks() ? "blocks" : "rows",
                "); expected two block formats or none");  // fmt: skip
  }
  p.N = p.head.N + p.tail.N;
  return p;
}

void multiply(const Rows& rows, const Projection& p, const float* residual, float* y, const Split& split) {
  multiply(rows, p.head, residual, y, split, p.N);
  if (p.tail.N) multiply(rows, p.tail, residual ? residual + p.head.N : nullptr, y + p.head.N, split, p.N);
}

void project(const float* x, int64_t M, const Weight& w, const float* residual, float* y, Rows& rows) {
  quantize_rows(x, M, w.K, rows, w.blocks());
  multiply(rows, w, residual, y);
}

at::Tensor run_linear(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& scale,
                      const std::optional<at::Tensor>& bias, const float* residual) {
  const int64_t M = x2.size(0);
  const Weight wt = weight_of(w, scale, bias, x2.size(1), "weight");
  at::Tensor y = at::empty({M, wt.N}, x2.options());
  Rows rows;
  project(x2.data_ptr<float>(), M, wt, residual, y.data_ptr<float>(), rows);
  return y;
}

// act[M, F] = silu(gate) * up of gate|up [M, 2F]: SwiGLU's middle
void swiglu(const float* g, int64_t M, int64_t F, float* a) {
  for (int64_t m = 0; m < M; ++m) {
    float* am = a + m * F;
    for (int64_t f = 0; f < F; ++f) am[f] = -g[m * 2 * F + f];
    exp_inplace(am, F);
    for (int64_t f = 0; f < F; ++f) am[f] = g[m * 2 * F + f] / (1.f + am[f]) * g[m * 2 * F + F + f];
  }
}

std::vector<int64_t> shape_with_last(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// ---------------------------------------------------------------------------------------------
// The ops.

// x [..., K] fp32 -> x · dequant(w)ᵀ (+ bias) (+ residual) [..., N]
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  at::Tensor x2 = rows_of(x, "linear input");
  const int64_t N = check_weight(w, scale, x2.size(1), "linear weight");
  const float* res = nullptr;
  at::Tensor r2;
  if (residual.has_value()) {
    r2 = rows_of(*residual, "linear residual");
    TORCH_CHECK(r2.size(0) == x2.size(0) && r2.size(1) == N, "linear residual: expected [", x2.size(0), ", ", N,
                "], got ", residual->sizes());
    res = r2.data_ptr<float>();
  }
  return run_linear(x2, w, scale, bias, res).view(shape_with_last(x, N));
}

// rms_norm(x) · dequant(w)ᵀ (+ bias): a block's first step, one call
at::Tensor norm_linear(const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& w,
                       const at::Tensor& scale, const std::optional<at::Tensor>& bias) {
  at::Tensor x2 = rows_of(x, "norm_linear input");
  const int64_t M = x2.size(0), K = x2.size(1);
  const int64_t N = check_weight(w, scale, K, "norm_linear weight");
  const at::Tensor nwt = norm_weight.contiguous();
  const float* nw = optional_vector(nwt, K, "norm weight");
  at::Tensor h = at::empty_like(x2);
  rms_norm_rows(x2.data_ptr<float>(), nw, eps, M, K, h.data_ptr<float>());
  return run_linear(h, w, scale, bias, nullptr).view(shape_with_last(x, N));
}

// x + down(silu(gate) * up), gate|up = rms_norm(x) · gate_upᵀ: a SwiGLU MLP with its residual, one call
at::Tensor mlp(const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& w_gate_up,
               const at::Tensor& s_gate_up, const std::optional<at::Tensor>& b_gate_up, const at::Tensor& w_down,
               const at::Tensor& s_down, const std::optional<at::Tensor>& b_down) {
  at::Tensor x2 = rows_of(x, "mlp input");
  const int64_t M = x2.size(0), E = x2.size(1), F = check_weight(w_gate_up, s_gate_up, E, "mlp gate_up weight") / 2;
  const int64_t out = check_weight(w_down, s_down, F, "mlp down weight");
  TORCH_CHECK(out == E, "mlp down weight: expected ", E, " outputs, got ", out);
  const at::Tensor nwt = norm_weight.contiguous();
  const float* nw = optional_vector(nwt, E, "norm weight");
  at::Tensor h = at::empty_like(x2);
  rms_norm_rows(x2.data_ptr<float>(), nw, eps, M, E, h.data_ptr<float>());
  at::Tensor gu = run_linear(h, w_gate_up, s_gate_up, b_gate_up, nullptr);
  at::Tensor act = at::empty({M, F}, x2.options());
  swiglu(gu.data_ptr<float>(), M, F, act.data_ptr<float>());
  return run_linear(act, w_down, s_down, b_down, x2.data_ptr<float>()).view(x.sizes());
}

// One layer's KV cache for one sequence: keys and values [KV, capacity, d] of float or fp16 bits, d contiguous.
struct CacheLayer {
  void* k;
  void* v;
  int64_t k_head, k_slot, v_head, v_slot;  // strides
  at::ScalarType type;  // kFloat, kHalf or kBFloat16
};

bool cache_type(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// One sequence's new queries, rotated, and each one's visible cache slots (ascending): what its attention reads.
struct Queries {
  std::vector<float> q;  // [T, H, d]
  std::vector<int64_t> keys, counts;  // [T, S] (the first counts[t] of row t), [T]
  int64_t T = 0, S = 0;
};

// The T new tokens' queries and keys rotated by cos, sin [T, d], their keys and values written into the cache from
// slot ``at``, and the slots each query may see (mask [T, at + T]; none: all).
template <typename E>
void attend_prepare(const float* src, int64_t T, const float* cs, const float* sn, const CacheLayer& c, int64_t at,
                    const bool* allow, int64_t heads, int64_t kv_heads, int64_t d, Queries& out) {
  E* kc = static_cast<E*>(c.k);
  E* vc = static_cast<E*>(c.v);
  const int64_t width = (heads + 2 * kv_heads) * d, S = at + T, half = d / 2;
  auto rotate = [&](const float* in, const float* cr, const float* sr, float* o) {
    for (int64_t i = 0; i < half; ++i) {
      o[i] = in[i] * cr[i] - in[i + half] * sr[i];
      o[i + half] = in[i + half] * cr[i + half] + in[i] * sr[i + half];
    }
  };
  out.T = T;
  out.S = S;
  out.q.resize(T * heads * d);
  std::vector<float> key(d);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = src + t * width;
    const float* cr = cs + t * d;
    const float* sr = sn + t * d;
    for (int64_t h = 0; h < heads; ++h) rotate(row + h * d, cr, sr, out.q.data() + (t * heads + h) * d);
    for (int64_t h = 0; h < kv_heads; ++h) {
      rotate(row + (heads + h) * d, cr, sr, key.data());
      narrow(key.data(), kc + h * c.k_head + (at + t) * c.k_slot, d);
      narrow(row + (heads + kv_heads + h) * d, vc + h * c.v_head + (at + t) * c.v_slot, d);
    }
  }
  out.keys.resize(T * S);
  out.counts.resize(T);
  for (int64_t t = 0; t < T; ++t) {
    int64_t n = 0;
    for (int64_t j = 0; j < S; ++j)
      if (!allow || allow[t * S + j]) out.keys[t * S + n++] = j;
    out.counts[t] = n;
  }
}

// out[T, H d]: each prepared query attends to its visible slots, over every thread or a Split's share of the queries
template <typename E>
void attend_compute(const Queries& qs, const CacheLayer& c, int64_t heads, int64_t kv_heads, int64_t d, float sc,
                    float* o, const Split& split) {
  const E* kc = static_cast<const E*>(c.k);
  const E* vc = static_cast<const E*>(c.v);
  const int64_t T = qs.T, S = qs.S, group = heads / kv_heads;
  // a token's heads that share a key/value head run together on one thread; small work stays on the calling thread
  // (no wake-up to pay)
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, S * d * group));
  for_range(T * kv_heads, grain, split, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(group * S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / kv_heads, g = i % kv_heads, n = qs.counts[t];
      float* out_rows = o + (t * heads + g * group) * d;
      if (n == 0) {  // a fully masked query: zeros, not NaNs
        std::fill(out_rows, out_rows + group * d, 0.f);
        continue;
      }
      const Keys<E> kv{kc + g * c.k_head, c.k_slot, vc + g * c.v_head, c.v_slot, qs.keys.data() + t * S, n};
      const float* qi = qs.q.data() + (t * heads + g * group) * d;
#ifdef SPLITSPEC_AVX2
      if (d == 64 || d == 128) {
        (d == 64 ? attend_heads<64, E> : attend_heads<128, E>)(qi, group, kv, sc, p.data(), S, out_rows);
        continue;
      }
#endif
      for (int64_t a = 0; a < group; ++a) attend_query_any(qi + a * d, d, kv, sc, p.data(), out_rows + a * d);
    }
  });
}

// f<E>() for the cache's element type
template <typename F>
void with_cache_type(const CacheLayer& c, const F& f) {
  if (c.type == at::kHalf) f(c10::Half{});
  else if (c.type == at::kBFloat16) f(c10::BFloat16{});
  else f(float{});
}

// out[T, H d] = attention of T new tokens from their fused projections qkv [T, (H + 2 KV) d] (see ``attend``).
void attend_rows(const float* src, int64_t T, const float* cs, const float* sn, const CacheLayer& c, int64_t at,
                 const bool* allow, int64_t heads, int64_t kv_heads, int64_t d, float sc, float* o) {
  Queries qs;
  with_cache_type(c, [&](auto e) {
    using E = decltype(e);
    attend_prepare<E>(src, T, cs, sn, c, at, allow, heads, kv_heads, d, qs);
    attend_compute<E>(qs, c, heads, kv_heads, d, sc, o, Split{});
  });
}

// Self-attention of one sequence's T new tokens, from their fused projections qkv [T, (H + 2 KV) d]:
// queries and keys rotated by cos, sin [T, d] (rotate-half convention), keys and values written into
// k_cache, v_cache [KV, capacity, d] at slots [at, at + T), then each query attends to the slots
// [0, at + T) that mask [T, at + T] allows (none given: all of them). Returns [T, H d].
// A query's keys are visited in slot order and its softmax and sums run in one fixed order, so its
// output depends only on the keys it may see, never on T.
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, int64_t at, const std::optional<at::Tensor>& mask, int64_t heads,
                  int64_t kv_heads, double scale) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "attend: ", heads,
              " query heads cannot share ", kv_heads, " key/value heads");
  at::Tensor x = rows_of(qkv, "attend qkv");
  const int64_t T = x.size(0), d = k_cache.size(-1), width = (heads + 2 * kv_heads) * d;
  TORCH_CHECK(x.size(1) == width, "attend qkv: expected ", width, " values a token, got ", x.size(1));
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(cache_type(c->scalar_type()) && c->scalar_type() == k_cache.scalar_type() && c->dim() == 3 && c->size(0) == kv_heads &&
                    c->stride(2) == 1 && c->size(1) >= at + T,
                "attend cache: expected fp32, fp16 or bf16 [", kv_heads, ", >= ", at + T, ", ", d,
                "] (inner dim contiguous, keys and values alike), got ", c->scalar_type(), " ", c->sizes());
  at::Tensor cs = cos.reshape({-1, d}).contiguous(), sn = sin.reshape({-1, d}).contiguous();
  TORCH_CHECK(cs.scalar_type() == at::kFloat && cs.size(0) == T && sn.size(0) == T, "attend rope: expected fp32 [",
              T, ", ", d, "] tables, got ", cos.sizes());
  const int64_t S = at + T;
  at::Tensor m2;
  const bool* allow = nullptr;
  if (mask.has_value()) {
    m2 = mask->reshape({-1, mask->size(-1)}).to(at::kBool).contiguous();
    TORCH_CHECK(m2.size(0) == T && m2.size(1) == S, "attend mask: expected [", T, ", ", S, "], got ", mask->sizes());
    allow = m2.data_ptr<bool>();
  }
  const CacheLayer c{k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
                     v_cache.stride(1), k_cache.scalar_type()};
  at::Tensor out = at::empty({T, heads * d}, x.options());
  attend_rows(x.data_ptr<float>(), T, cs.data_ptr<float>(), sn.data_ptr<float>(), c, at, allow, heads, kv_heads, d,
              static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

// ---------------------------------------------------------------------------------------------
// A stack of low-bit decoder blocks in one call. Python drives a block as four ops and a model as 30 blocks:
// ~2 ms a token of dispatch and views on this model, a quarter of a forward. Here a forward crosses into C++
// once; each block runs the same four functions the single ops do, so both give the same bits.

struct Blocks : torch::CustomClassHolder {
  // per block: norm1, qkv, o, norm2, gate_up, down; a projection is 6 tensors (w, scale, bias of its head, then of
  // its tail); an empty tensor stands for no bias, or no tail
  static constexpr int64_t PER_PROJECTION = 6, PER_BLOCK = 2 + 4 * PER_PROJECTION;
  struct Layer {
    const float* norm1;
    const float* norm2;
    float eps1, eps2;
    Projection qkv, o, gate_up, down;
  };
  std::vector<at::Tensor> t;  // owns what the layers point into
  std::vector<Layer> layers;
  int64_t heads, kv_heads, E = 0, d = 0, F = 0;
  double scale;

  Blocks(std::vector<at::Tensor> tensors, std::vector<double> eps, int64_t heads, int64_t kv_heads, double scale)
      : t(std::move(tensors)), heads(heads), kv_heads(kv_heads), scale(scale) {
    TORCH_CHECK(!t.empty() && t.size() % PER_BLOCK == 0, "Blocks: expected ", PER_BLOCK,
                " tensors a block (norm, qkv, o, norm, gate_up, down; a projection's w/scale/bias and its tail's), "
                "got ", t.size());
    const int64_t n = static_cast<int64_t>(t.size()) / PER_BLOCK;
    TORCH_CHECK(static_cast<int64_t>(eps.size()) == 2 * n, "Blocks: expected 2 norm epsilons a block, got ",
                eps.size(), " for ", n, " blocks");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "Blocks: ", heads, " query heads cannot share ",
                kv_heads, " key/value heads");
    E = t[0].numel();
    for (int64_t l = 0; l < n; ++l) {
      at::Tensor* w = t.data() + l * PER_BLOCK;
      constexpr int norm2 = 1 + 2 * PER_PROJECTION;  // norm1, qkv, o, norm2, gate_up, down
      for (int i : {0, norm2}) {
        w[i] = w[i].contiguous();
        optional_vector(w[i], E, "Blocks norm weight");
      }
      Layer L{w[0].data_ptr<float>(), w[norm2].data_ptr<float>(), static_cast<float>(eps[2 * l]),
              static_cast<float>(eps[2 * l + 1]), projection_of(w + 1, E, "Blocks qkv weight"), {}, {}, {}};
      TORCH_CHECK(L.qkv.N % (heads + 2 * kv_heads) == 0, "Blocks qkv weight: ", L.qkv.N, " outputs do not split into ",
                  heads, " + 2 x ", kv_heads, " heads");
      d = L.qkv.N / (heads + 2 * kv_heads);
      L.o = projection_of(w + 1 + PER_PROJECTION, heads * d, "Blocks o weight");
      TORCH_CHECK(L.o.N == E, "Blocks o weight: expected ", E, " outputs, got ", L.o.N);
      L.gate_up = projection_of(w + norm2 + 1, E, "Blocks gate_up weight");
      F = L.gate_up.N / 2;
      L.down = projection_of(w + norm2 + 1 + PER_PROJECTION, F, "Blocks down weight");
      TORCH_CHECK(L.down.N == E, "Blocks down weight: expected ", E, " outputs, got ", L.down.N);
      layers.push_back(L);
    }
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // x [T, E] through every block. Rows [ends[s-1], ends[s]) are sequence s: its keys and values go to
  // k[s], v[s] [blocks, 1, KV, capacity, d] from slot ats[s], and it attends under masks[s] [t, ats[s] + t]
  // (an empty tensor: every slot up to its own). cos, sin [T, d]: the rows' rotary tables. Everything is
  // checked once; the blocks then run on raw pointers (the same functions as the single ops: the same bits).
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k, std::vector<at::Tensor> v,
                     std::vector<int64_t> ends, std::vector<int64_t> ats, std::vector<at::Tensor> masks) {
    const size_t S = ends.size();
    TORCH_CHECK(S > 0 && k.size() == S && v.size() == S && ats.size() == S && masks.size() == S,
                "Blocks.forward: expected a key cache, value cache, start slot and mask for each of ", S,
                " sequences, got ", k.size(), ", ", v.size(), ", ", ats.size(), ", ", masks.size());
    at::Tensor out = rows_of(x, "Blocks.forward input").clone();
    const int64_t T = out.size(0);
    TORCH_CHECK(out.size(1) == E && ends.back() == T, "Blocks.forward: expected [", ends.back(), ", ", E,
                "] input, got ", x.sizes());
    const at::Tensor cs = cos.reshape({-1, d}).contiguous(), sn = sin.reshape({-1, d}).contiguous();
    TORCH_CHECK(cs.scalar_type() == at::kFloat && sn.scalar_type() == at::kFloat && cs.size(0) == T && sn.size(0) == T,
                "Blocks.forward rope: expected fp32 [", T, ", ", d, "] tables, got ", cos.sizes());
    std::vector<at::Tensor> allow(S);
    for (size_t s = 0; s < S; ++s) {
      const int64_t a = s ? ends[s - 1] : 0, n = ends[s] - a;
      TORCH_CHECK(n > 0 && ats[s] >= 0, "Blocks.forward: sequence ", s, " has ", n, " rows from slot ", ats[s]);
      for (const at::Tensor* c : {&k[s], &v[s]})
        TORCH_CHECK(cache_type(c->scalar_type()) && c->scalar_type() == k[s].scalar_type() && c->dim() == 5 && c->size(0) == size() &&
                        c->size(2) == kv_heads && c->size(3) >= ats[s] + n && c->size(4) == d && c->stride(4) == 1,
                    "Blocks.forward cache: expected fp32, fp16 or bf16 [", size(), ", 1, ", kv_heads, ", >= ", ats[s] + n,
                    ", ", d, "] (keys and values alike), got ", c->scalar_type(), " ", c->sizes());
      if (masks[s].numel()) {
        allow[s] = masks[s].reshape({-1, masks[s].size(-1)}).to(at::kBool).contiguous();
        TORCH_CHECK(allow[s].size(0) == n && allow[s].size(1) == ats[s] + n, "Blocks.forward mask: expected [", n,
                    ", ", ats[s] + n, "], got ", masks[s].sizes());
      }
    }
    const int64_t width = (heads + 2 * kv_heads) * d;
    const float sc = static_cast<float>(scale);
    float* xs = out.data_ptr<float>();
    std::vector<float> h(T * E), qkv(T * width), att(T * heads * d), gu(T * 2 * F), act(T * F);
    std::vector<CacheLayer> caches(S);
    std::vector<Queries> queries(S);
    Rows r_qkv, r_o, r_gu, r_down;  // each projection's input, quantised
    auto ready = [&](Rows& r, int64_t K, bool blocks) {
      if (r.M != T || r.Kp != padded(K) || r.blocks != blocks || r.scale.empty()) prepare_rows(T, K, r, blocks);
    };
    // One parallel region for the whole stack, its steps apart by barriers: each thread takes its share of the rows
    // (norms, quantisation, SwiGLU), of the output columns (projections) and of the queries (attention), so no step
    // runs on one thread while the other waits, and no step pays a fork and a join. Who computes what never
    // changes what it computes: the same bits as the single ops.
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
    {
      const Split sp{omp_get_thread_num(), omp_get_num_threads()};
      const auto [m0, m1] = sp.share(T);
      for (int64_t l = 0; l < size(); ++l) {
        const Layer& L = layers[l];
#pragma omp single
        {
          ready(r_qkv, E, L.qkv.blocks());
          ready(r_o, heads * d, L.o.blocks());
          ready(r_gu, E, L.gate_up.blocks());
          ready(r_down, F, L.down.blocks());
          for (size_t s = 0; s < S; ++s) {
            const at::ScalarType type = k[s].scalar_type();
            const int64_t bytes = type == at::kFloat ? 4 : 2;
            caches[s] = CacheLayer{static_cast<char*>(k[s].data_ptr()) + l * k[s].stride(0) * bytes,
                                   static_cast<char*>(v[s].data_ptr()) + l * v[s].stride(0) * bytes,
                                   k[s].stride(2), k[s].stride(3), v[s].stride(2), v[s].stride(3), type};
          }
        }
        rms_norm_rows(xs + m0 * E, L.norm1, L.eps1, m1 - m0, E, h.data() + m0 * E);
        quantize_rows_range(h.data(), m0, m1, E, r_qkv);
#pragma omp barrier
        multiply(r_qkv, L.qkv, nullptr, qkv.data(), sp);
#pragma omp barrier
#pragma omp single
        for (size_t s = 0; s < S; ++s) {
          const int64_t a = s ? ends[s - 1] : 0;
          with_cache_type(caches[s], [&](auto e) {
            attend_prepare<decltype(e)>(qkv.data() + a * width, ends[s] - a, cs.data_ptr<float>() + a * d,
                                        sn.data_ptr<float>() + a * d, caches[s], ats[s],
                                        allow[s].defined() ? allow[s].data_ptr<bool>() : nullptr, heads, kv_heads, d,
                                        queries[s]);  // fmt: skip
          });
        }
        for (size_t s = 0; s < S; ++s) {
          const int64_t a = s ? ends[s - 1] : 0;
          with_cache_type(caches[s], [&](auto e) {
            attend_compute<decltype(e)>(queries[s], caches[s], heads, kv_heads, d, sc, att.data() + a * heads * d, sp);
          });
        }
#pragma omp barrier
        quantize_rows_range(att.data(), m0, m1, heads * d, r_o);
#pragma omp barrier
        multiply(r_o, L.o, xs, xs, sp);
#pragma omp barrier
        rms_norm_rows(xs + m0 * E, L.norm2, L.eps2, m1 - m0, E, h.data() + m0 * E);
        quantize_rows_range(h.data(), m0, m1, E, r_gu);
#pragma omp barrier
        multiply(r_gu, L.gate_up, nullptr, gu.data(), sp);
#pragma omp barrier
        swiglu(gu.data() + m0 * 2 * F, m1 - m0, F, act.data() + m0 * F);
        quantize_rows_range(act.data(), m0, m1, F, r_down);
#pragma omp barrier
        multiply(r_down, L.down, xs, xs, sp);
#pragma omp barrier
      }
    }
    return out;
  }
};

// Int8 multiply-adds a second that this build's multiply instruction issues across torch's threads in a loop of
// independent chains with nothing else in it (amx: tdpbssd; the VNNI builds: vpdpbusd; avx2: vpmaddubsw + vpaddw;
// portable: the compiler's loop): the ceiling the kernels' own rate is measured against. ``steps``: instructions a
// thread (or loop turns, 8 multiply-adds each, in the portable build).
double int8_peak(int64_t steps) {
  TORCH_CHECK(steps > 0, "int8_peak: steps must be positive, got ", steps);
  steps = (steps + 47) / 48 * 48;  // whole turns of every loop below
  const int threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t keep = 0;
#if defined(SPLITSPEC_AMX)
      const Tiles use(TileShapes().tile(0, 16, 64).tile(1, 16, 64).tile(2, 16, 64).tile(3, 16, 64).tile(4, 16, 64)
                          .tile(5, 16, 64));  // fmt: skip
      alignas(64) int8_t operand[16 * 64];
      std::memset(operand, 1, sizeof operand);
      alignas(64) int32_t out[16 * 16];
      _tile_loadd(4, operand, 64);
      _tile_loadd(5, operand, 64);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t i = 0; i < steps; i += 4) {
        _tile_dpbssd(0, 4, 5);
        _tile_dpbssd(1, 4, 5);
        _tile_dpbssd(2, 4, 5);
        _tile_dpbssd(3, 4, 5);
      }
      _tile_stored(0, out, 64);
      keep = out[0];
#elif defined(SPLITSPEC_AVX512) || defined(SPLITSPEC_AVXVNNI)
      // The whole loop in asm: through intrinsics the compiler may compute one product and add it twelve times, or
      // keep the accumulators in memory and store them every turn.
#ifdef SPLITSPEC_AVX512
      using Vec = __m512i;
#define SPLITSPEC_DP(i) "vpdpbusd %[b], %[a], %[v" #i "]\n\t"
#else
      using Vec = __m256i;
#define SPLITSPEC_DP(i) "%{vex%} vpdpbusd %[b], %[a], %[v" #i "]\n\t"
#endif
      Vec acc[12], a, b;
      std::memset(acc, 0, sizeof acc);
      std::memset(&a, 1, sizeof a);
      std::memset(&b, 2, sizeof b);
      int64_t turns = steps / 12;  // twelve chains: enough to cover vpdpbusd's latency
      asm volatile("1:\n\t" SPLITSPEC_DP(0) SPLITSPEC_DP(1) SPLITSPEC_DP(2) SPLITSPEC_DP(3) SPLITSPEC_DP(4)
                   SPLITSPEC_DP(5) SPLITSPEC_DP(6) SPLITSPEC_DP(7) SPLITSPEC_DP(8) SPLITSPEC_DP(9) SPLITSPEC_DP(10)
                   SPLITSPEC_DP(11) "dec %[n]\n\tjnz 1b\n\t"
                   : [v0] "+v"(acc[0]), [v1] "+v"(acc[1]), [v2] "+v"(acc[2]), [v3] "+v"(acc[3]), [v4] "+v"(acc[4]),
                     [v5] "+v"(acc[5]), [v6] "+v"(acc[6]), [v7] "+v"(acc[7]), [v8] "+v"(acc[8]), [v9] "+v"(acc[9]),
                     [v10] "+v"(acc[10]), [v11] "+v"(acc[11]), [n] "+r"(turns)
                   : [a] "v"(a), [b] "v"(b));  // fmt: skip
#undef SPLITSPEC_DP
#elif defined(SPLITSPEC_AVX2)
      // in asm for the same reasons: six chains of vpmaddubsw added up in int16 (vpaddw), as the block formats'
      // kernels add a block's pairs before they widen them once (int8 weights widen every step: vpmaddwd, a second
      // multiply, so they reach about half of this)
      __m256i acc[6], a, b;
      std::memset(acc, 0, sizeof acc);
      std::memset(&a, 1, sizeof a);
      std::memset(&b, 2, sizeof b);
#define SPLITSPEC_MADD(i, t) \
  "vpmaddubsw %[b], %[a], %%ymm" #t "\n\tvpaddw %%ymm" #t ", %[v" #i "], %[v" #i "]\n\t"
      int64_t turns = steps / 6;
      asm volatile("1:\n\t" SPLITSPEC_MADD(0, 10) SPLITSPEC_MADD(1, 11) SPLITSPEC_MADD(2, 12) SPLITSPEC_MADD(3, 13)
                   SPLITSPEC_MADD(4, 14) SPLITSPEC_MADD(5, 15) "dec %[n]\n\tjnz 1b\n\t"
                   : [v0] "+x"(acc[0]), [v1] "+x"(acc[1]), [v2] "+x"(acc[2]), [v3] "+x"(acc[3]), [v4] "+x"(acc[4]),
                     [v5] "+x"(acc[5]), [n] "+r"(turns)
                   : [a] "x"(a), [b] "x"(b)
                   : "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");  // fmt: skip
#undef SPLITSPEC_MADD
#else
      int8_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
      int32_t acc = 0;
      for (int64_t i = 0; i < steps; ++i) {
        for (int k = 0; k < 8; ++k) acc += a[k] * static_cast<int8_t>(i + k);
        a[i & 7] = static_cast<int8_t>(acc);
      }
      keep = acc;
#endif
#if defined(SPLITSPEC_AVX2) && !defined(SPLITSPEC_AMX)
      for (const auto& v : acc) {  // a lane of every chain: the loop's result is used
        int32_t first;
        std::memcpy(&first, &v, sizeof first);
        keep += first;
      }
#endif
      sink += keep;
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
#if defined(SPLITSPEC_AMX)
  constexpr double per_step = 16.0 * 16 * 64;
#elif defined(SPLITSPEC_AVX512)
  constexpr double per_step = 64.0;
#elif defined(SPLITSPEC_AVX2)  // the avx-vnni build too
  constexpr double per_step = 32.0;
#else
  constexpr double per_step = 8.0;
#endif
  (void)sink.load();
  return per_step * static_cast<double>(steps) * threads / seconds;
}

// Bytes a second that torch's threads read from memory, each streaming its share of a buffer of ``bytes`` (far
// larger than the caches) ``passes`` times with nothing else to do: the ceiling of a token's forward, which reads every
// weight once (plain decoding is bound by it; a tree by the multiply rate). Each thread first writes its own share,
// so its pages are where it reads them. ``buffer``: the memory to read (``kernels.read_peak`` gives it 2 MB pages where
// the weights have them), at least 1 MiB.
double read_rate(const at::Tensor& buffer, int64_t passes) {
  const int64_t bytes = buffer.numel() * buffer.element_size();
  TORCH_CHECK(buffer.is_contiguous() && bytes >= (int64_t{1} << 20) && passes > 0,
              "read_rate: expected at least 1 MiB read at least once, got ", bytes, " bytes ", passes, " times");
  constexpr int64_t LINE = 8;  // uint64 words a 64-byte line
  const int64_t words = bytes / 8 / LINE * LINE;
  uint64_t* data = static_cast<uint64_t*>(buffer.data_ptr());
  const int threads = at::get_num_threads();
  std::atomic<uint64_t> sink{0};
  auto each = [&](const auto& f) {
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) f(words / LINE * t / threads * LINE, words / LINE * (t + 1) / threads * LINE);
    });
  };
  each([&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) data[i] = static_cast<uint64_t>(i);
  });
  const auto start = std::chrono::steady_clock::now();
  for (int64_t pass = 0; pass < passes; ++pass)
    each([&](int64_t b, int64_t e) {
      uint64_t acc[LINE] = {};  // a line's words xor-ed into independent chains: the loads, not the adds, set the pace
      for (int64_t i = b; i < e; i += LINE)
        for (int64_t k = 0; k < LINE; ++k) acc[k] ^= data[i + k];
      uint64_t all = 0;
      for (const uint64_t a : acc) all ^= a;
      sink ^= all;
    });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  (void)sink.load();
  return static_cast<double>(words) * 8 * static_cast<double>(passes) / seconds;
}

// Whether this build can run in this process: the CPU flags are checked before it loads; AMX also needs the kernel's
// leave to use the tile state.
bool ready() {
#ifdef SPLITSPEC_AMX
  return amx_permitted();
#else
  return true;
#endif
}

// The ISA this build computes with: what the engine reports at start-up.
std::string isa() {
#if defined(SPLITSPEC_AMX)
  return "amx";
#elif defined(SPLITSPEC_AVX512)
  return "avx512-vnni";
#elif defined(SPLITSPEC_AVXVNNI)
  return "avx-vnni";
#elif defined(SPLITSPEC_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

SPLITSPEC_LIBRARY(SPLITSPEC_NS, m) {
  m.def("linear(Tensor x, Tensor w, Tensor scale, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("norm_linear(Tensor x, Tensor norm_weight, float eps, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  m.def("mlp(Tensor x, Tensor norm_weight, float eps, Tensor w_gate_up, Tensor s_gate_up, Tensor? b_gate_up, "
        "Tensor w_down, Tensor s_down, Tensor? b_down) -> Tensor");
  m.def("attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int at, Tensor? mask, "
        "int heads, int kv_heads, float scale) -> Tensor");
  m.def("isa() -> str", &isa);
  m.def("ready() -> bool", &ready);
  m.def("int8_layout() -> str", &int8_layout);
  m.def("int8_peak(int steps) -> float", &int8_peak);
  m.def("read_rate(Tensor(a!) buffer, int passes) -> float", &read_rate);
  m.impl("linear", c10::DispatchKey::CPU, &linear);
  m.impl("norm_linear", c10::DispatchKey::CPU, &norm_linear);
  m.impl("mlp", c10::DispatchKey::CPU, &mlp);
  m.impl("attend", c10::DispatchKey::CPU, &attend);
  m.class_<Blocks>("Blocks")
      .def(torch::init<std::vector<at::Tensor>, std::vector<double>, int64_t, int64_t, double>())
      .def("forward", &Blocks::forward)
      .def("size", &Blocks::size);
}
