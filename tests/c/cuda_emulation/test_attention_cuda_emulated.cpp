// The CUDA attention kernels (csrc/cuda/attention) run on the host through the
// emulation of this directory -- every inline-PTX instruction modelled lane by
// lane in attention_ptx.cuh here -- and checked element by element against
// (a) a float64 reference computed here from the same rounded inputs and
// (b) the CPU C core (csrc/attention), forward (out, lse) and backward
// (dq, dk, dv), over dtypes, head dims, causal masks, GQA, ragged lengths,
// padded and packed batches, strided layouts, dropout, FP8 inputs (decode path
// in the sm_80 binary, FP8 tensor cores in the sm_90a one), both cp.async
// timings and the three thread orders of the emulation. The last part shows
// that the comparison fails when the model of an instruction is deliberately
// wrong.
//
// Tolerances are error bounds per element, computed with the reference (the
// `err` terms below), doubled. Where the GPU path rounds:
//   - S = Q K^T: exact products, float32 sums of D terms, so S is off by at most
//     (D + 2) u32 sum|q||k|; through the exponential that is a relative error eS
//     of P of scale times that (plus the float32 lse the backward subtracts);
//   - P is rounded to the 16-bit MMA type (unit roundoff u16 = 2^-8 bf16, 2^-11 fp16)
//     before O += P V, or, on FP8 tensor cores, 256 P to e4m3 (2^-4 relative,
//     2^-10 absolute below e4m3's normal range, so 2^-18 for P);
//   - dS = P (dP - delta) is rounded to 16 bits before dK = dS^T Q and dQ = dS K,
//     dO is rounded to 16 bits when it is float32 (FP8 inputs, float32 out);
//   - every output is rounded to its dtype (u_out; float32 for FP8 with float32 out);
//   - float32 row sums of up to S terms: S u32 relative.
// So out gets sum_j z_j |v_j| (perr(p_j) + p_j eS_ij) / l + |M| (u_out + (S + D) u32)
// where M = sum_j p_j z_j |v_j| / l, and the gradients the same kind of sums
// over |p| (|dP| + |delta|) and |q|, |k|, |dO| with (3 u16 + u_out + eS) each.
// The CPU core's float32-product path computes without those 16-bit roundings,
// so it meets the same bounds (run_cpu keeps it there: from the avx512_bf16
// tier up, bf16 and E4M3 inputs take paths that round P to bf16, which the
// attention core's own tests check). Rows past a sequence's length and rows that see no key must
// be exactly 0 (lse -inf), and packed tokens outside every sequence untouched.
//
// Mutations of the kernel sources tried by hand (each reverted), all caught:
// no cp_async_wait_all() before the forward epilogue (padded blocks end with
// their Q copies in flight: the emulation stops); (lane >> 4) and
// ((lane >> 3) & 1) swapped in the backward's Q / dO ldmatrix row address
// (dq, dk, dv off in every case); no __syncthreads() after the backward's dS
// staging (NaN dq); the forward's K_{j+1} prefetch moved before the barrier
// that ends every warp's reads of K_j (out off in the copies-at-issue and the
// warp-by-warp FP8 decode cases). test_model_faults() does the same from the
// model's side.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention_ptx.cuh"  // the model (this directory): its timing and fault switches
#include "cuda/attention/attention_cuda.h"
extern "C" {
#include "attention/attention.h"
#include "common/cpu_features.h"
#include "attention/attention_dropout.h"
}

#include "../check.h"

namespace {

using tf_attn::EmuCopyTiming;
using tf_attn::EmuFault;

constexpr double kU32 = 1.0 / (1 << 24);

uint64_t rng_state = 0x9E3779B97F4A7C15ull;
double rand_uniform() {  // in [-1, 1)
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return static_cast<double>((rng_state * 0x2545F4914F6CDD1Dull) >> 11) / 4503599627370496.0 - 1.0;
}

enum class Elem { kBf16, kF16, kF32, kE4m3 };
int elem_bytes(Elem e) { return e == Elem::kF32 ? 4 : e == Elem::kE4m3 ? 1 : 2; }
Elem elem_of(tf_dtype d) { return d == TF_FLOAT32 ? Elem::kF32 : d == TF_BFLOAT16 ? Elem::kBf16 : Elem::kF16; }
tf_attn_elem attn_elem(Elem e) {
  return e == Elem::kF32 ? TF_ATTN_F32 : e == Elem::kBf16 ? TF_ATTN_BF16 : e == Elem::kF16 ? TF_ATTN_F16 : TF_ATTN_E4M3;
}
// Unit roundoff of a dtype.
double unit_roundoff(Elem e) { return e == Elem::kF32 ? kU32 : e == Elem::kBf16 ? 1.0 / 256 : 1.0 / 2048; }

// A 16-byte aligned host buffer of exactly `bytes` bytes (so AddressSanitizer
// sees any access past its end), filled with 0x7B.
struct Buffer {
  std::unique_ptr<uint8_t, decltype(&std::free)> bytes{nullptr, &std::free};
  explicit Buffer(size_t n) {
    void *p = nullptr;
    if (posix_memalign(&p, 16, n > 0 ? n : 1) != 0) std::abort();
    bytes.reset(static_cast<uint8_t *>(p));
    std::memset(p, 0x7B, n);
  }
  template <class T>
  T *as() const {
    return reinterpret_cast<T *>(bytes.get());
  }
};

enum class Layout { kBshd, kSbhd, kWideHeads };  // wide: heads 32 bytes apart beyond D

// A [B, S, H, D] tensor in host memory (16-byte aligned rows), of one element type.
struct Tensor {
  int64_t b, s, h, d, sb, ss, sh;
  Elem elem;
  Buffer storage;
  uint8_t *data;

  Tensor(int64_t b_, int64_t s_, int64_t h_, int64_t d_, Elem e, Layout layout)
      : b(b_), s(s_), h(h_), d(d_), sb(0), ss(0), sh(d_ + (layout == Layout::kWideHeads ? 32 / elem_bytes(e) : 0)),
        elem(e), storage(extent(layout) * elem_bytes(e)), data(storage.as<uint8_t>()) {}
  size_t extent(Layout layout) {
    if (layout == Layout::kSbhd) {
      sb = h * sh;
      ss = b * sb;
    } else {
      ss = h * sh;
      sb = s * ss;
    }
    return static_cast<size_t>((b - 1) * sb + (s - 1) * ss + (h - 1) * sh + d);
  }
  int64_t offset(int64_t bi, int64_t si, int64_t hi, int64_t di) const { return bi * sb + si * ss + hi * sh + di; }
  double get(int64_t bi, int64_t si, int64_t hi, int64_t di) const {
    const int64_t o = offset(bi, si, hi, di);
    uint16_t x;
    switch (elem) {
      case Elem::kF32: {
        float f;
        std::memcpy(&f, data + 4 * o, 4);
        return f;
      }
      case Elem::kE4m3:
        return tf_fp8_e4m3_decode(data[o]);
      default:
        std::memcpy(&x, data + 2 * o, 2);
        return elem == Elem::kBf16 ? tf_bf16_to_f32(x) : tf_f16_to_f32(x);
    }
  }
  void set(int64_t bi, int64_t si, int64_t hi, int64_t di, float v) {
    const int64_t o = offset(bi, si, hi, di);
    uint16_t x;
    switch (elem) {
      case Elem::kF32:
        std::memcpy(data + 4 * o, &v, 4);
        return;
      case Elem::kE4m3:
        data[o] = tf_fp8_e4m3_encode(v);
        return;
      default:
        x = elem == Elem::kBf16 ? tf_f32_to_bf16(v) : tf_f32_to_f16(v);
        std::memcpy(data + 2 * o, &x, 2);
    }
  }
  // The element's bytes are still the fill pattern of a new tensor.
  bool untouched(int64_t bi, int64_t si, int64_t hi, int64_t di) const {
    const int n = elem_bytes(elem);
    for (int i = 0; i < n; ++i)
      if (data[offset(bi, si, hi, di) * n + i] != 0x7B) return false;
    return true;
  }
  tf_attn_cuda_tensor in() const { return {data, sb, ss, sh}; }
  tf_attn_cuda_out_tensor out() { return {data, sb, ss, sh}; }
  tf_attn_operand op(float descale = 1.0f) { return {data, attn_elem(elem), sb, ss, sh, descale}; }
};

struct Case {
  std::string name;
  tf_dtype dtype = TF_BFLOAT16;  // q/k/v's dtype, or for FP8 the out dtype
  bool fp8 = false;
  int binary = 90;  // emu_binary_version: 80 runs FP8 through the decode path, 90 on FP8 tensor cores
  int64_t batch = 1, sq = 37, skv = 37, hq = 2, hkv = 2, d = 64;
  bool causal = false;
  float dropout = 0.0f;
  Layout layout = Layout::kBshd;
  std::vector<int32_t> lens_q, lens_kv;  // padded batch: valid lengths
  std::vector<int32_t> cu_q, cu_kv;      // packed: batch 1, sequence offsets
  double q_magnitude = 2.0;              // larger: sharper softmax
  bool backward = true;
  EmuCopyTiming timing = EmuCopyTiming::kAtWait;
  EmuSchedule schedule = EmuSchedule::kInterleaved;
};

// Where a query (or key) row of the tensors stands.
enum class Row { kLive, kZero, kOutside };

// One sequence's rows in the tensors (batch index, first token, rows, valid rows).
struct Seq {
  int64_t batch, begin, cap, len;
};

struct Problem {
  const Case &c;
  int64_t num_seqs;
  Elem in_elem, out_elem;
  Tensor q, k, v;
  std::vector<float> descale = {1.0f, 1.0f, 1.0f};  // q, k, v (the kernels read them from this memory)
  std::vector<double> dequantized[3];  // q, k, v times their descales, dense [B, S, H, D]

  explicit Problem(const Case &cs)
      : c(cs),
        num_seqs(cs.cu_q.empty() ? cs.batch : static_cast<int64_t>(cs.cu_q.size()) - 1),
        in_elem(cs.fp8 ? Elem::kE4m3 : elem_of(cs.dtype)),
        out_elem(elem_of(cs.dtype)),
        q(cs.batch, cs.sq, cs.hq, cs.d, in_elem, cs.layout),
        k(cs.batch, cs.skv, cs.hkv, cs.d, in_elem, cs.layout),
        v(cs.batch, cs.skv, cs.hkv, cs.d, in_elem, cs.layout) {
    if (cs.fp8) descale = {0.25f, 0.5f, 2.0f};
    // FP8 values up to +-8 (descales bring them back to the 16-bit cases' range).
    const double range[3] = {cs.q_magnitude * (cs.fp8 ? 4 : 1), cs.fp8 ? 2.0 : 1.0, cs.fp8 ? 0.5 : 1.0};
    Tensor *t[3] = {&q, &k, &v};
    for (int i = 0; i < 3; ++i)
      for (int64_t b = 0; b < t[i]->b; ++b)
        for (int64_t s = 0; s < t[i]->s; ++s)
          for (int64_t h = 0; h < t[i]->h; ++h)
            for (int64_t e = 0; e < t[i]->d; ++e) {
              t[i]->set(b, s, h, e, static_cast<float>(range[i] * rand_uniform()));
              dequantized[i].push_back(t[i]->get(b, s, h, e) * descale[i]);
            }
  }

  bool packed() const { return !c.cu_q.empty(); }
  Seq seq(int64_t s, bool kv) const {
    const int64_t tokens = kv ? c.skv : c.sq;
    if (packed()) {
      const std::vector<int32_t> &cu = kv ? c.cu_kv : c.cu_q;
      return {0, cu[s], cu[s + 1] - cu[s], cu[s + 1] - cu[s]};
    }
    const std::vector<int32_t> &lens = kv ? c.lens_kv : c.lens_q;
    return {s, 0, tokens, lens.empty() ? tokens : lens[s]};
  }
  // Dequantized input element.
  double qv(const Tensor &t, int which, int64_t b, int64_t s, int64_t h, int64_t e) const {
    return dequantized[which][static_cast<size_t>(((b * t.s + s) * t.h + h) * t.d + e)];
  }
  float softmax_scale() const { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d))); }
  int64_t lse_index(const Seq &r, int64_t h, int64_t i) const { return (r.batch * c.hq + h) * c.sq + r.begin + i; }
  // Status of each query token (packed tokens outside every sequence: kOutside).
  std::vector<Row> rows(bool kv) const {
    const int64_t tokens = kv ? c.skv : c.sq;
    std::vector<Row> r(static_cast<size_t>(c.batch * tokens), packed() ? Row::kOutside : Row::kZero);
    for (int64_t s = 0; s < num_seqs; ++s) {
      const Seq q = seq(s, kv);
      for (int64_t i = 0; i < q.cap; ++i) r[q.batch * tokens + q.begin + i] = i < q.len ? Row::kLive : Row::kZero;
    }
    return r;
  }

  tf_attn_cuda_problem cuda_problem(tf_dtype out_dtype) const {
    tf_attn_cuda_problem p{};
    p.batch = c.batch;
    p.num_seqs = num_seqs;
    p.seqlen_q = c.sq;
    p.seqlen_kv = c.skv;
    p.heads_q = c.hq;
    p.heads_kv = c.hkv;
    p.head_dim = c.d;
    p.cu_seqlens_q = packed() ? c.cu_q.data() : nullptr;
    p.cu_seqlens_kv = packed() ? c.cu_kv.data() : nullptr;
    p.seqlens_q = c.lens_q.empty() ? nullptr : c.lens_q.data();
    p.seqlens_kv = c.lens_kv.empty() ? nullptr : c.lens_kv.data();
    p.softmax_scale = softmax_scale();
    p.causal = c.causal;
    p.dropout_p = c.dropout;
    p.seed = 0x1234567890ull;
    p.offset = 77;
    p.out_dtype = out_dtype;
    // As the binding does: FP8 tiles become the out dtype (bf16 for a float32 out).
    p.dtype = out_dtype == TF_FLOAT32 ? TF_BFLOAT16 : out_dtype;
    p.fp8_inputs = c.fp8;
    if (c.fp8) {
      p.q_descale = &descale[0];
      p.k_descale = &descale[1];
      p.v_descale = &descale[2];
    }
    return p;
  }
  tf_attn_problem cpu_problem() const {
    const tf_attn_cuda_problem g = cuda_problem(c.dtype);
    tf_attn_problem p{};
    p.batch = c.batch;
    p.seq_q = c.sq;
    p.seq_kv = c.skv;
    p.heads_q = c.hq;
    p.heads_kv = c.hkv;
    p.head_dim = c.d;
    p.cu_seqlens_q = g.cu_seqlens_q;
    p.cu_seqlens_kv = g.cu_seqlens_kv;
    p.num_seqs = num_seqs;
    p.seqlens_q = g.seqlens_q;
    p.seqlens_kv = g.seqlens_kv;
    p.softmax_scale = g.softmax_scale;
    p.causal = c.causal;
    p.dropout_p = c.dropout;
    p.seed = g.seed;
    p.offset = g.offset;
    return p;
  }
};

// Expected values and error bounds, dense [B, S, H, D] (or lse-shaped).
struct Expect {
  std::vector<double> value, err;
  Expect() = default;
  explicit Expect(size_t n) : value(n, 0.0), err(n, 0.0) {}
};

struct Reference {
  Expect out, lse, dq, dk, dv;
};

// Dropout factor z of (sequence, head, query row, key) for the case.
struct DropoutMask {
  tf_attn_dropout_key_t key;
  uint32_t threshold;
  double keep_scale;
  bool on;
  DropoutMask(const tf_attn_cuda_problem &p)
      : key(tf_attn_dropout_key(p.seed, p.offset)),
        threshold(tf_attn_dropout_threshold(p.dropout_p)),
        keep_scale(1.0f / (1.0f - p.dropout_p)),
        on(p.dropout_p > 0.0f) {}
  double z(int64_t s, int64_t h, int64_t i, int64_t j) const {
    if (!on) return 1.0;
    return tf_attn_dropout_bits(key, static_cast<uint32_t>(s), static_cast<uint32_t>(h), static_cast<uint32_t>(i),
                                static_cast<uint32_t>(j)) >= threshold
               ? keep_scale
               : 0.0;
  }
};

// The float64 reference. `out` and `dout` (backward) are the tensors the
// kernels' backward reads; pass nullptr for the forward only.
Reference reference(const Problem &P, const tf_attn_cuda_problem &g, bool tensor_cores, const Tensor *out,
                    const Tensor *dout) {
  const Case &c = P.c;
  const int64_t D = c.d, group = c.hq / c.hkv;
  const double scale = g.softmax_scale;
  const double u16 = unit_roundoff(elem_of(g.dtype)), u_out = unit_roundoff(elem_of(g.out_dtype));
  const DropoutMask drop(g);
  auto dense = [&](int64_t b, int64_t s, int64_t h, int64_t e, int64_t seqlen, int64_t heads) {
    return static_cast<size_t>(((b * seqlen + s) * heads + h) * D + e);
  };
  Reference R;
  R.out = Expect(static_cast<size_t>(c.batch * c.sq * c.hq * D));
  R.lse = Expect(static_cast<size_t>(c.batch * c.hq * c.sq));
  R.dq = Expect(R.out.value.size());
  R.dk = Expect(static_cast<size_t>(c.batch * c.skv * c.hkv * D));
  R.dv = Expect(R.dk.value.size());
  for (double &x : R.lse.value) x = -INFINITY;
  std::vector<double> sc, p, z, es, qrow, dorow, orow;
  for (int64_t s = 0; s < P.num_seqs; ++s) {
    const Seq qs = P.seq(s, false), ks = P.seq(s, true);
    for (int64_t h = 0; h < c.hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < qs.len; ++i) {
        const int64_t qt = qs.begin + i, n = c.causal ? std::min(ks.len, i + 1) : ks.len;
        if (n <= 0) continue;  // no visible key: out 0, lse -inf
        qrow.assign(D, 0.0);
        for (int64_t e = 0; e < D; ++e) qrow[e] = P.qv(P.q, 0, qs.batch, qt, h, e);
        sc.assign(n, 0.0);
        es.assign(n, 0.0);
        double mx = -INFINITY, es_max = 0.0;
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0.0, mag = 0.0;
          for (int64_t e = 0; e < D; ++e) {
            const double kv = P.qv(P.k, 1, ks.batch, ks.begin + j, hk, e);
            dot += qrow[e] * kv;
            mag += std::fabs(qrow[e] * kv);
          }
          sc[j] = scale * dot;
          es[j] = scale * (D + 2) * kU32 * mag;
          es_max = std::max(es_max, es[j]);
          mx = std::max(mx, sc[j]);
        }
        double l = 0.0;
        for (int64_t j = 0; j < n; ++j) l += std::exp(sc[j] - mx);
        const double lse = mx + std::log(l);
        const size_t li = static_cast<size_t>(P.lse_index(qs, h, i));
        R.lse.value[li] = lse;
        R.lse.err[li] = 2 * (es_max + (n + 4) * kU32 + std::fabs(lse) * 4 * kU32);
        const double e_lse = R.lse.err[li];
        p.assign(n, 0.0);
        z.assign(n, 0.0);
        for (int64_t j = 0; j < n; ++j) {
          p[j] = std::exp(sc[j] - lse);
          z[j] = drop.z(s, h, i, j);
        }
        // Forward.
        for (int64_t e = 0; e < D; ++e) {
          double o = 0.0, m = 0.0, err = 0.0;
          for (int64_t j = 0; j < n; ++j) {
            const double vv = z[j] * P.qv(P.v, 2, ks.batch, ks.begin + j, hk, e);
            const double perr = tensor_cores ? std::max(p[j] / 16, 1.0 / 262144) : std::max(u16 * p[j], 0x1p-25);
            o += p[j] * vv;
            m += p[j] * std::fabs(vv);
            err += std::fabs(vv) * (perr + p[j] * es[j]);
          }
          const size_t oi = dense(qs.batch, qt, h, e, c.sq, c.hq);
          R.out.value[oi] = o;
          R.out.err[oi] = 2 * (err + m * (u_out + (n + D) * kU32));
        }
        if (dout == nullptr) continue;
        // Backward: dS = P (z dP - delta) with the given out and dout.
        dorow.assign(D, 0.0);
        orow.assign(D, 0.0);
        double delta = 0.0, delta_mag = 0.0;
        for (int64_t e = 0; e < D; ++e) {
          dorow[e] = dout->get(qs.batch, qt, h, e);
          orow[e] = out->get(qs.batch, qt, h, e);
          delta += dorow[e] * orow[e];
          delta_mag += std::fabs(dorow[e] * orow[e]);
        }
        for (int64_t j = 0; j < n; ++j) {
          const int64_t kt = ks.begin + j;
          double dp = 0.0, dp_mag = 0.0;
          for (int64_t e = 0; e < D; ++e) {
            const double vv = P.qv(P.v, 2, ks.batch, kt, hk, e);
            dp += dorow[e] * vv;
            dp_mag += std::fabs(dorow[e] * vv);
          }
          const double ds = p[j] * (z[j] * dp - delta), ds_mag = p[j] * (z[j] * dp_mag + delta_mag);
          const double rel = 3 * u16 + u_out + es[j] + e_lse + (std::max(c.sq, c.skv) + D) * kU32;
          for (int64_t e = 0; e < D; ++e) {
            const size_t ki = dense(ks.batch, kt, hk, e, c.skv, c.hkv), qi = dense(qs.batch, qt, h, e, c.sq, c.hq);
            const double kv = P.qv(P.k, 1, ks.batch, kt, hk, e);
            R.dv.value[ki] += p[j] * z[j] * dorow[e];
            R.dv.err[ki] += 2 * p[j] * z[j] * std::fabs(dorow[e]) * rel;
            R.dk.value[ki] += scale * ds * qrow[e];
            R.dk.err[ki] += 2 * scale * ds_mag * std::fabs(qrow[e]) * rel;
            R.dq.value[qi] += scale * ds * kv;
            R.dq.err[qi] += 2 * scale * ds_mag * std::fabs(kv) * rel;
          }
        }
      }
    }
  }
  return R;
}

// Compares one [B, S, H, D] result with the expectation: live rows within
// the bound, zero rows exactly 0, outside rows untouched (or, `outside_zero`,
// exactly 0). Returns the largest error / bound of the live elements, or
// infinity when an element is off.
double compare(const char *what, const std::string &name, const Tensor &got, const Expect &want,
             const std::vector<Row> &rows, bool outside_zero = false) {
  double worst = 0.0;
  int64_t bad = 0;
  std::string first;
  for (int64_t b = 0; b < got.b; ++b)
    for (int64_t s = 0; s < got.s; ++s)
      for (int64_t h = 0; h < got.h; ++h)
        for (int64_t e = 0; e < got.d; ++e) {
          const Row r = rows[b * got.s + s];
          const size_t i = static_cast<size_t>(((b * got.s + s) * got.h + h) * got.d + e);
          const double x = got.get(b, s, h, e);
          bool ok;
          if (r == Row::kLive) {
            const double diff = std::fabs(x - want.value[i]);
            ok = diff <= want.err[i];
            if (want.err[i] > 0) worst = std::max(worst, diff / want.err[i]);
          } else if (r == Row::kZero || outside_zero) {
            ok = x == 0.0;
          } else {
            ok = got.untouched(b, s, h, e);
          }
          if (!ok && bad++ == 0) {
            char buf[200];
            std::snprintf(buf, sizeof buf, "[%ld, %ld, %ld, %ld] = %.9g, want %.9g +- %.3g", static_cast<long>(b),
                          static_cast<long>(s), static_cast<long>(h), static_cast<long>(e), x, want.value[i],
                          want.err[i]);
            first = buf;
          }
        }
  CHECK(bad == 0, "%s %s: %ld elements off, first %s (worst error / bound %.3g)", name.c_str(), what,
        static_cast<long>(bad), first.c_str(), worst);
  return bad == 0 ? worst : INFINITY;
}

bool compare_lse(const char *what, const Problem &P, const std::vector<float> &got, const Expect &want) {
  const Case &c = P.c;
  const std::vector<Row> rows = P.rows(false);
  int64_t bad = 0;
  std::string first;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t t = 0; t < c.sq; ++t) {
        const size_t i = static_cast<size_t>((b * c.hq + h) * c.sq + t);
        const Row r = rows[b * c.sq + t];
        const double x = got[i];
        bool ok;
        if (r == Row::kOutside) {
          uint32_t bits;
          std::memcpy(&bits, &got[i], 4);
          ok = bits == 0x7B7B7B7Bu;
        } else if (want.value[i] == -INFINITY) {
          ok = x == -INFINITY;
        } else {
          ok = std::fabs(x - want.value[i]) <= want.err[i];
        }
        if (!ok && bad++ == 0) first = std::to_string(i) + ": " + std::to_string(x) + " want " + std::to_string(want.value[i]);
      }
  CHECK(bad == 0, "%s %s: %ld lse values off, first %s", c.name.c_str(), what, static_cast<long>(bad), first.c_str());
  return bad == 0;
}

struct CpuResult {
  Tensor out;
  std::vector<float> lse;
  Tensor dq, dk, dv;
  explicit CpuResult(const Case &c)
      : out(c.batch, c.sq, c.hq, c.d, Elem::kF32, Layout::kBshd),
        lse(static_cast<size_t>(c.batch * c.hq * c.sq)),
        dq(c.batch, c.sq, c.hq, c.d, Elem::kF32, Layout::kBshd),
        dk(c.batch, c.skv, c.hkv, c.d, Elem::kF32, Layout::kBshd),
        dv(c.batch, c.skv, c.hkv, c.d, Elem::kF32, Layout::kBshd) {}
};

// The CPU core on the same inputs (float32 outputs); the backward uses the
// emulated forward's out and the given dout.
void run_cpu_float32_products(Problem &P, CpuResult &R, Tensor *out, Tensor *dout) {
  const tf_attn_problem p = P.cpu_problem();
  tf_attn_operand q = P.q.op(P.descale[0]), k = P.k.op(P.descale[1]), v = P.v.op(P.descale[2]), o = R.out.op();
  std::vector<float> scratch(static_cast<size_t>(std::max(tf_attn_fwd_scratch_floats(&p), tf_attn_bwd_scratch_floats(&p))));
  CHECK(tf_attn_fwd(&p, &q, &k, &v, &o, R.lse.data(), 0, tf_attn_fwd_units(&p), scratch.data()) == TF_OK, "%s: CPU fwd",
        P.c.name.c_str());
  if (dout == nullptr) return;
  std::vector<float> delta(R.lse.size());
  Tensor acc(P.c.batch, P.c.sq, P.c.hq, P.c.d, Elem::kF32, Layout::kBshd);
  std::memset(acc.data, 0, static_cast<size_t>(P.c.batch * P.c.sq * P.c.hq * P.c.d) * 4);
  tf_attn_operand od = dout->op(), oo = out->op(), oacc = acc.op(), dq = R.dq.op(), dk = R.dk.op(), dv = R.dv.op();
  CHECK(tf_attn_bwd_rowdot(&p, &od, &oo, delta.data(), 0, tf_attn_rowdot_units(&p)) == TF_OK, "%s: CPU rowdot",
        P.c.name.c_str());
  CHECK(tf_attn_bwd(&p, &od, &q, &k, &v, R.lse.data(), delta.data(), &oacc, &dq, &dk, &dv, 0, tf_attn_bwd_units(&p),
                    scratch.data()) == TF_OK,
        "%s: CPU bwd", P.c.name.c_str());
}

// run_cpu_float32_products at a tier no higher than avx512 (see the header comment).
void run_cpu(Problem &P, CpuResult &R, Tensor *out, Tensor *dout) {
  const int cap = tf_cpu_isa_cap();
  if (tf_cpu_isa() > TF_ISA_AVX512) CHECK(tf_set_cpu_isa_cap(TF_ISA_AVX512) == TF_OK, "cap the CPU tier");
  run_cpu_float32_products(P, R, out, dout);
  CHECK(tf_set_cpu_isa_cap(cap) == TF_OK, "restore the CPU tier cap");
}

// Forward and backward of one case through the emulated kernels, the CPU core
// and the reference; returns whether every comparison of the emulated results passed.
bool run_case(const Case &c) {
  emu_binary_version = c.binary;
  tf_attn::emu_copy_timing = c.timing;
  emu_schedule = c.schedule;
  Problem P(c);
  const tf_attn_cuda_problem g = P.cuda_problem(c.dtype);
  const bool tensor_cores = c.fp8 && c.binary == 90;
  const std::vector<Row> qrows = P.rows(false), krows = P.rows(true);

  Tensor out(c.batch, c.sq, c.hq, c.d, P.out_elem, c.layout);
  std::vector<float> lse(static_cast<size_t>(c.batch * c.hq * c.sq));
  std::memset(lse.data(), 0x7B, lse.size() * 4);
  CHECK(tf_attention_fwd_cuda(&g, P.q.in(), P.k.in(), P.v.in(), out.out(), lse.data(), nullptr) == TF_OK,
        "%s: fwd launch", c.name.c_str());

  Tensor dout(c.batch, c.sq, c.hq, c.d, P.out_elem, c.layout);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t s = 0; s < c.sq; ++s)
      for (int64_t h = 0; h < c.hq; ++h)
        for (int64_t e = 0; e < c.d; ++e) dout.set(b, s, h, e, static_cast<float>(rand_uniform()));
  const Reference R = reference(P, g, tensor_cores, &out, c.backward ? &dout : nullptr);
  double worst[4] = {compare("out", c.name, out, R.out, qrows), 0, 0, 0};
  const bool lse_ok = compare_lse("lse", P, lse, R.lse);
  const bool ok = lse_ok && worst[0] <= 1;

  CpuResult cpu(c);
  // The CPU core computes without the 16-bit P (or e4m3 P): its bounds are the 16-bit path's.
  const Reference Rc = tensor_cores ? reference(P, g, false, &out, nullptr) : Reference{};
  run_cpu(P, cpu, &out, c.backward ? &dout : nullptr);
  compare("CPU core out", c.name, cpu.out, tensor_cores ? Rc.out : R.out, qrows, true);
  if (!c.backward) {
    std::printf("%-36s worst error / bound: out %.2f\n", c.name.c_str(), worst[0]);
    return ok;
  }

  Tensor dq(c.batch, c.sq, c.hq, c.d, P.out_elem, c.layout), dk(c.batch, c.skv, c.hkv, c.d, P.out_elem, c.layout),
      dv(c.batch, c.skv, c.hkv, c.d, P.out_elem, c.layout);
  const Buffer acc(static_cast<size_t>(c.batch * c.sq * c.hq * c.d) * 4), delta(lse.size() * 4);
  CHECK(tf_attention_bwd_cuda(&g, dout.in(), P.q.in(), P.k.in(), P.v.in(), out.in(), lse.data(), dq.out(), dk.out(),
                              dv.out(), acc.as<float>(), delta.as<float>(), nullptr) == TF_OK,
        "%s: bwd launch", c.name.c_str());
  worst[1] = compare("dq", c.name, dq, R.dq, qrows, true);
  worst[2] = compare("dk", c.name, dk, R.dk, krows);
  worst[3] = compare("dv", c.name, dv, R.dv, krows);
  std::printf("%-36s worst error / bound: out %.2f dq %.2f dk %.2f dv %.2f\n", c.name.c_str(), worst[0], worst[1],
              worst[2], worst[3]);
  compare("CPU core dq", c.name, cpu.dq, R.dq, qrows, true);
  compare("CPU core dk", c.name, cpu.dk, R.dk, krows, true);
  compare("CPU core dv", c.name, cpu.dv, R.dv, krows, true);
  return ok && worst[1] <= 1 && worst[2] <= 1 && worst[3] <= 1;
}

Case make(const char *name, tf_dtype dtype, int64_t d, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, bool causal) {
  Case c;
  c.name = name;
  c.dtype = dtype;
  c.d = d;
  c.sq = sq;
  c.skv = skv;
  c.hq = hq;
  c.hkv = hkv;
  c.causal = causal;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> all;
  // Head dims, dtypes, ragged lengths, seqlen_q != seqlen_kv, causal or not, GQA.
  all.push_back(make("bf16 d32 37x130 gqa2", TF_BFLOAT16, 32, 37, 130, 2, 1, false));
  all.push_back(make("fp16 d32 130x37 causal gqa4", TF_FLOAT16, 32, 130, 37, 4, 1, true));
  all.push_back(make("bf16 d64 200x200 causal", TF_BFLOAT16, 64, 200, 200, 2, 2, true));
  all.push_back(make("fp16 d64 1x130 gqa2", TF_FLOAT16, 64, 1, 130, 2, 1, false));
  all.push_back(make("bf16 d96 130x64 causal", TF_BFLOAT16, 96, 130, 64, 1, 1, true));
  all.push_back(make("fp16 d96 37x200 gqa2", TF_FLOAT16, 96, 37, 200, 2, 1, false));
  all.push_back(make("bf16 d128 37x200 causal gqa4", TF_BFLOAT16, 128, 37, 200, 4, 1, true));
  all.push_back(make("fp16 d128 200x37", TF_FLOAT16, 128, 200, 37, 1, 1, false));
  all.push_back(make("bf16 d64 1x1", TF_BFLOAT16, 64, 1, 1, 1, 1, true));
  // Large scores: the running max must keep exp2 in range.
  Case sharp = make("fp16 d64 130x130 sharp scores", TF_FLOAT16, 64, 130, 130, 1, 1, false);
  sharp.q_magnitude = 12.0;
  all.push_back(sharp);
  // Strided layouts.
  Case sbhd = make("bf16 d64 sbhd 2x70x90 causal", TF_BFLOAT16, 64, 70, 90, 2, 1, true);
  sbhd.batch = 2;
  sbhd.layout = Layout::kSbhd;
  all.push_back(sbhd);
  Case wide = make("fp16 d32 wide heads 3x37x50", TF_FLOAT16, 32, 37, 50, 2, 2, false);
  wide.batch = 3;
  wide.layout = Layout::kWideHeads;
  all.push_back(wide);
  // Padded batch: an empty query sequence and a sequence without keys.
  Case padded = make("bf16 d64 padded", TF_BFLOAT16, 64, 130, 100, 2, 1, true);
  padded.batch = 3;
  padded.lens_q = {37, 0, 130};
  padded.lens_kv = {100, 20, 0};
  all.push_back(padded);
  Case padded16 = make("fp16 d128 padded sbhd", TF_FLOAT16, 128, 64, 70, 2, 2, false);
  padded16.batch = 2;
  padded16.lens_q = {64, 17};
  padded16.lens_kv = {1, 70};
  padded16.layout = Layout::kSbhd;
  all.push_back(padded16);
  // Packed: uneven segments, an empty one, tokens past the last sequence, a sequence without keys.
  Case packed = make("bf16 d32 packed", TF_BFLOAT16, 32, 200, 130, 2, 1, true);
  packed.cu_q = {0, 37, 37, 170, 180};
  packed.cu_kv = {0, 64, 100, 129, 129};
  all.push_back(packed);
  Case packed16 = make("fp16 d96 packed gqa2", TF_FLOAT16, 96, 150, 150, 4, 2, false);
  packed16.cu_q = {0, 130, 150};
  packed16.cu_kv = {0, 20, 140};
  all.push_back(packed16);
  // Dropout.
  Case drop = make("bf16 d64 dropout 0.2 causal", TF_BFLOAT16, 64, 130, 130, 2, 1, true);
  drop.dropout = 0.2f;
  all.push_back(drop);
  Case drop16 = make("fp16 d32 dropout 0.5 packed", TF_FLOAT16, 32, 100, 90, 2, 2, false);
  drop16.dropout = 0.5f;
  drop16.cu_q = {0, 40, 100};
  drop16.cu_kv = {0, 50, 90};
  all.push_back(drop16);
  // FP8 inputs: the decode path (sm_80 binary) with each out dtype, and the FP8 tensor cores (sm_90a).
  for (tf_dtype out : {TF_FLOAT32, TF_BFLOAT16, TF_FLOAT16}) {
    Case f = make("fp8 decode", out, out == TF_FLOAT16 ? 96 : 64, 130, 70, 2, 1, out != TF_BFLOAT16);
    f.name += out == TF_FLOAT32 ? " out f32" : out == TF_BFLOAT16 ? " out bf16" : " out fp16";
    f.fp8 = true;
    f.binary = 80;
    all.push_back(f);
  }
  for (int64_t d : {32, 64, 96, 128}) {
    Case f = make("fp8 tensor cores", d == 64 ? TF_BFLOAT16 : TF_FLOAT32, d, d == 128 ? 130 : 37, 200, 2, 1, d != 96);
    f.name += " d" + std::to_string(d);
    f.fp8 = true;
    f.binary = 90;
    f.backward = d == 64;
    all.push_back(f);
  }
  Case fdrop = make("fp8 tensor cores dropout packed", TF_FLOAT16, 64, 150, 150, 2, 2, true);
  fdrop.fp8 = true;
  fdrop.dropout = 0.1f;
  fdrop.cu_q = {0, 70, 150};
  fdrop.cu_kv = {0, 100, 150};
  fdrop.backward = false;
  all.push_back(fdrop);
  // The thread orders: every third case runs warp by warp, every third in descending warp order.
  for (size_t i = 0; i < all.size(); ++i) all[i].schedule = static_cast<EmuSchedule>(i % 3);
  // cp.async landing at issue, one warp at a time: a prefetch into a buffer
  // that another warp has still to read would overwrite it.
  Case issue = make("bf16 d64 copies at issue", TF_BFLOAT16, 64, 200, 200, 2, 1, true);
  Case issue16 = make("fp16 d128 copies at issue", TF_FLOAT16, 128, 130, 130, 1, 1, false);
  Case fissue = make("fp8 tensor cores copies at issue", TF_BFLOAT16, 128, 130, 130, 1, 1, true);
  fissue.fp8 = true;
  fissue.backward = false;
  for (Case *c : {&issue, &issue16, &fissue}) {
    c->timing = EmuCopyTiming::kAtIssue;
    c->schedule = c == &issue16 ? EmuSchedule::kWarpByWarpDescending : EmuSchedule::kWarpByWarp;
    all.push_back(*c);
  }
  return all;
}

// Each deliberate error in the model must make the comparison fail (its
// failures are not counted: only that it failed is).
void test_model_faults() {
  const struct {
    EmuFault fault;
    Case c;
  } faults[] = {
      {EmuFault::kWaitSkipsLastGroup, make("fault: wait_group 1", TF_BFLOAT16, 64, 130, 130, 1, 1, false)},
      {EmuFault::kMmaASwapped, make("fault: mma a1/a2", TF_FLOAT16, 32, 37, 37, 1, 1, false)},
      {EmuFault::kLdmatrixTransIgnored, make("fault: ldmatrix .trans", TF_BFLOAT16, 32, 37, 37, 1, 1, false)},
      {EmuFault::kWgmmaStridesSwapped, make("fault: wgmma LBO/SBO", TF_BFLOAT16, 64, 37, 64, 1, 1, false)},
  };
  for (const auto &f : faults) {
    Case c = f.c;
    if (f.fault == EmuFault::kWgmmaStridesSwapped) c.fp8 = true;
    const int passed_before = passed, failed_before = failed;
    std::fprintf(stderr, "(expected failures of %s follow)\n", c.name.c_str());
    tf_attn::emu_fault = f.fault;
    const bool ok = run_case(c);
    tf_attn::emu_fault = EmuFault::kNone;
    passed = passed_before;
    failed = failed_before;
    CHECK(!ok, "%s: the emulated kernels passed with a wrong model", c.name.c_str());
  }
}

// The launchers' checks, and the architecture switch of the FP8 forward.
void test_launcher() {
  emu_binary_version = 80;
  CHECK(tf_attention_cuda_fp8_mma_available() == 0, "no FP8 tensor cores in the sm_80 binary");
  emu_binary_version = 90;
  CHECK(tf_attention_cuda_fp8_mma_available() == 1, "FP8 tensor cores in the sm_90a binary");
  Case c = make("checks", TF_BFLOAT16, 64, 16, 16, 2, 1, false);
  Problem P(c);
  tf_attn_cuda_problem g = P.cuda_problem(TF_BFLOAT16);
  Tensor out(1, 16, 2, 64, Elem::kBf16, Layout::kBshd);
  std::vector<float> lse(32);
  g.head_dim = 80;
  CHECK(tf_attention_fwd_cuda(&g, P.q.in(), P.k.in(), P.v.in(), out.out(), lse.data(), nullptr) == TF_ERR_BAD_SIZE,
        "head dim 80 rejected");
  g.head_dim = 64;
  tf_attn_cuda_tensor misaligned = P.q.in();
  misaligned.stride_token += 4;
  CHECK(tf_attention_fwd_cuda(&g, misaligned, P.k.in(), P.v.in(), out.out(), lse.data(), nullptr) ==
            TF_ERR_BAD_ARGUMENT,
        "rows not 16-byte aligned rejected");
  const long launches = emu_launch_count;
  g.seqlen_q = 0;
  CHECK(tf_attention_fwd_cuda(&g, P.q.in(), P.k.in(), P.v.in(), out.out(), lse.data(), nullptr) == TF_OK &&
            emu_launch_count == launches,
        "an empty problem launches nothing");
}

}  // namespace

int main() {
  test_launcher();
  for (const Case &c : cases()) run_case(c);
  test_model_faults();
  std::printf("(%ld emulated launches)\n", emu_launch_count);
  return check_report();
}
