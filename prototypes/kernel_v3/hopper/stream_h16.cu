// Decode kernel v3, the h = 16 inner loop pipelined (issue 19): tile_h16.cu's arithmetic (the codes as the
// register A operand of both wgmma products, the scale and minimum folded out) with what the real kernel's
// schedule needs to run at the cache's bandwidth:
//   - each step's packed codes, scales, minima and probabilities are copied into shared memory by cp.async,
//     STAGES - 1 steps ahead, and the operands are built from there (the packed tile is read twice, once per
//     product layout; nothing dequantised is stored);
//   - two groups' products in flight (wgmma.wait_group 1), so the fold of one overlaps the next;
//   - W_g = (s_g o P)^T is built from registers in the scores' accumulator layout, where the real kernel's
//     softmax leaves P, and the rank-1 term from the same registers;
//   - the operands take one shift a word (operand4_x16): tokens 8-15 of each 16-token tile come out as
//     1024 + 16 u in both products, so their scales are divided by 16 (in the scores' fold and in W).
// The rank-1 terms are summed in a fixed order (no atomics), so the results are deterministic.
// Variant 1 (FAST): W is stored by one stmatrix.trans a group from packed fp16 pairs, and the magic number's
// 1024 comes off on the tensor cores (one more wgmma a k-step, A = -1024 everywhere, into the same
// accumulator), so the rank-1 term is sum_t m P alone.
// P is still an input (token-major [T, 16] here, the accumulator's order) and the scores are written out only
// when asked (the test checks them; the real kernel keeps them on chip).
#include <cstdint>
#include <cuda_fp16.h>

#include "fragment.cuh"
#include "sm90.cuh"

namespace quantmla {
namespace h16s {

constexpr int HEADS = 16, DIM = 512, GROUP = 64, GROUPS = DIM / GROUP, TILES = DIM / 16, STEP = 64, STAGES = 3;
constexpr uint32_t MAGIC = 0x64006400u;  // fp16 operands
// one stage: the step's codes (64 tokens x 256 B), scales and minima ([64][8] fp16 each), P ([64][16] fp16)
constexpr int CODE_BYTES = STEP * DIM / 2, META_BYTES = STEP * GROUPS * 2, P_BYTES = STEP * HEADS * 2;
constexpr int STAGE_BYTES = CODE_BYTES + 2 * META_BYTES + P_BYTES;
constexpr int Q_BYTES = HEADS * DIM * 2, W_BYTES = GROUPS * HEADS * STEP * 2;
constexpr int SMEM_BYTES = Q_BYTES + W_BYTES + STAGES * STAGE_BYTES;  // 94,208

__device__ __forceinline__ float half_at(const uint4& v, int i) {  // element i (compile-time) of 8 packed fp16
  const uint32_t w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
  return __half2float(__ushort_as_half(static_cast<unsigned short>((i & 1) ? (w >> 16) : (w & 0xFFFF))));
}

// copy step `s` (tokens t0 .. t0 + 63) into its stage; every thread commits one group whether or not it copied
__device__ __forceinline__ void load_step(unsigned char* stage, const uint32_t* words, const half* scale,
                                          const half* minimum, const half* p, int t0, int tid) {
  const unsigned char* code_src = reinterpret_cast<const unsigned char*>(words) + size_t(t0) * (DIM / 2);
#pragma unroll
  for (int k = 0; k < CODE_BYTES / 16 / 128; ++k) {
    const int c = tid + 128 * k;
    cp_async16(stage + 16 * c, code_src + 16 * c);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // 64 chunks of scales, 64 of minima, 128 of P
    const int c = tid + 128 * k;
    const unsigned char* src =
        c < 64 ? reinterpret_cast<const unsigned char*>(scale + size_t(t0) * GROUPS) + 16 * c
        : c < 128 ? reinterpret_cast<const unsigned char*>(minimum + size_t(t0) * GROUPS) + 16 * (c - 64)
                  : reinterpret_cast<const unsigned char*>(p + size_t(t0) * HEADS) + 16 * (c - 128);
    cp_async16(stage + CODE_BYTES + 16 * c, src);
  }
}

// Q^T as the scores' B operand: K-major 8 x 8 core matrices, 512 B a 16-channel K-tile
__device__ __forceinline__ void stage_queries(const half* q, unsigned char* q_smem, int tid) {
  for (int i = tid; i < HEADS * DIM; i += 128) {
    const int n = i / DIM, k = i % DIM;
    *reinterpret_cast<half*>(q_smem + (k >> 4) * 512 + core_offset(n, k & 15)) = q[i];
  }
}

// this CTA's output accumulators (channels on M, heads on N) into partial [ctas][16][512]
__device__ __forceinline__ void store_partial(const float (&acc_o)[GROUPS][8], float* partial, int warp, int lane) {
  float* out = partial + size_t(blockIdx.x) * HEADS * DIM;
#pragma unroll
  for (int g = 0; g < GROUPS; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int ch = GROUP * g + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1), h = 2 * (lane & 3) + (i & 1) + 8 * (i >> 2);
      out[h * DIM + ch] = acc_o[g][i];
    }
}

// words [T/16][32 tiles][32 lanes]; scale, minimum [T][8] fp16; q [16][512] fp16; p [T][16] fp16;
// scores [T][16] fp32 (written when write_scores); partial [ctas][16][512] fp32; rank1 [ctas][16][8] fp32
template <bool FAST>
__global__ void __launch_bounds__(128, 2)
    stream_h16_kernel(const uint32_t* __restrict__ words, const half* __restrict__ scale,
                      const half* __restrict__ minimum, const half* __restrict__ q, const half* __restrict__ p,
                      float* __restrict__ scores, float* __restrict__ partial, float* __restrict__ rank1_out,
                      int tokens, int per_cta, int write_scores, uint32_t lbo, uint32_t sbo) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_smem = smem;
  unsigned char* w_smem = smem + Q_BYTES;
  unsigned char* stages = smem + Q_BYTES + W_BYTES;
  __shared__ float qsum[GROUPS][HEADS];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t_begin = blockIdx.x * per_cta, t_end = min(tokens, t_begin + per_cta);
  const int steps = (t_end - t_begin) / STEP;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {  // the first copies go out before the queries are staged
    if (s < steps) load_step(stages + s * STAGE_BYTES, words, scale, minimum, p, t_begin + s * STEP, tid);
    cp_async_commit();
  }
  stage_queries(q, q_smem, tid);
  {
    const int h = tid >> 3, g = tid & 7;
    float s = 0.f;
    for (int i = 0; i < GROUP; ++i) s += __half2float(q[h * DIM + g * GROUP + i]);
    qsum[g][h] = s;
  }
  async_proxy_fence();
  // this thread's rows of the accumulator fragments: tokens tl0, tl0 + 8 of the step (warp's 16), heads
  // hb + {0, 1, 8, 9}; element i of a fragment is token tl0 + 8 ((i >> 1) & 1), head hb + (i & 1) + 8 (i >> 2)
  const int tl0 = 16 * warp + (lane >> 2), hb = 2 * (lane & 3);
  float acc_o[GROUPS][8];
  float r1[GROUPS][4];  // rank-1 term: sum_t m P (- 1024 W unless FAST) for heads hb + {0, 1, 8, 9}
  // FAST: this lane's stmatrix row, stored row lane % 8 of matrix lane / 8 (token half (lane / 8) % 2, head
  // block lane / 16) inside the warp's 16-token tile of W_g
  const int stsm_off = warp * 512 + ((((lane >> 3) & 1) * 2) + (lane >> 4)) * 128 + (lane & 7) * 16;
  constexpr uint32_t MINUS_MAGIC[4] = {0xE400E400u, 0xE400E400u, 0xE400E400u, 0xE400E400u};  // fp16 -1024
#pragma unroll
  for (int g = 0; g < GROUPS; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_o[g][i] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) r1[g][j] = 0.f;
  }
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<STAGES - 2>();  // step s has landed (this thread's copies) ...
    __syncthreads();              // ... everyone's, and step s - 1 is done with its stage and with W
    if (s + STAGES - 1 < steps)
      load_step(stages + ((s + STAGES - 1) % STAGES) * STAGE_BYTES, words, scale, minimum, p,
                t_begin + (s + STAGES - 1) * STEP, tid);
    cp_async_commit();
    const unsigned char* st = stages + (s % STAGES) * STAGE_BYTES;
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(st);
    const uint4* sc = reinterpret_cast<const uint4*>(st + CODE_BYTES);
    const uint4* mn = reinterpret_cast<const uint4*>(st + CODE_BYTES + META_BYTES);
    const uint32_t* sp = reinterpret_cast<const uint32_t*>(st + CODE_BYTES + 2 * META_BYTES);
    const uint4 s_a = sc[tl0], s_b = sc[tl0 + 8], m_a = mn[tl0], m_b = mn[tl0 + 8];
    // ---- scores: one accumulator per group, two groups in flight, folded as they complete ----
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float acc_g[2][8];
    uint32_t a[2][4][4];
    auto fold = [&](const float (&d)[8], int g) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const bool second = (i >> 1) & 1;
        const float sv = second ? half_at(s_b, g) * 0.0625f : half_at(s_a, g), mv = half_at(second ? m_b : m_a, g);
        acc[i] += sv * d[i] + (mv - 1024.f * sv) * qsum[g][hb + (i & 1) + 8 * (i >> 2)];
      }
    };
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
      const int b = g & 1;
#pragma unroll
      for (int c = 0; c < 4; ++c) operand4_x16<false>(a[b][c], sw[(warp * TILES + 4 * g + c) * 32 + lane], MAGIC);
      wgmma_fence();
#pragma unroll
      for (int c = 0; c < 4; ++c) wgmma_m64n16k16(acc_g[b], a[b][c], smem_desc(q_smem + (4 * g + c) * 512, lbo, sbo), c > 0);
      wgmma_commit();
      if (g > 0) {
        wgmma_wait<1>();
        fold(acc_g[b ^ 1], g - 1);
      }
    }
    wgmma_wait<0>();
    fold(acc_g[(GROUPS - 1) & 1], GROUPS - 1);
    const int t0 = t_begin + s * STEP;
    if (write_scores) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        scores[size_t(t0 + tl0 + 8 * ((i >> 1) & 1)) * HEADS + hb + (i & 1) + 8 * (i >> 2)] = acc[i];
    }
    // ---- W_g = (s_g o P)^T from registers (P in the scores' layout), and the rank-1 term ----
    float pv[8];
#pragma unroll
    for (int i = 0; i < 8; i += 2) {  // P[t, h], P[t, h + 1] in one word
      const int tl = tl0 + 8 * ((i >> 1) & 1), h = hb + 8 * (i >> 2);
      const __half2 pair = *reinterpret_cast<const __half2*>(sp + tl * (HEADS / 2) + h / 2);
      pv[i] = __low2float(pair);
      pv[i + 1] = __high2float(pair);
    }
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
      if constexpr (FAST) {
        const float sa = half_at(s_a, g), sb = half_at(s_b, g) * 0.0625f, ma = half_at(m_a, g), mb = half_at(m_b, g);
        uint32_t wr[4];  // register j: fragment elements 2j, 2j + 1 (heads h, h + 1 of one token)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float sv = (j & 1) ? sb : sa, mv = (j & 1) ? mb : ma;
          const __half2 w2 = __floats2half2_rn(sv * pv[2 * j], sv * pv[2 * j + 1]);
          wr[j] = *reinterpret_cast<const uint32_t*>(&w2);
          r1[g][2 * (j >> 1)] += mv * pv[2 * j];
          r1[g][2 * (j >> 1) + 1] += mv * pv[2 * j + 1];
        }
        stmatrix_x4_trans(w_smem + g * 2048 + stsm_off, wr);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const bool second = (i >> 1) & 1;
          const int tl = tl0 + 8 * second, h = hb + (i & 1) + 8 * (i >> 2);
          const half w = __float2half_rn((second ? half_at(s_b, g) * 0.0625f : half_at(s_a, g)) * pv[i]);
          *reinterpret_cast<half*>(w_smem + g * 2048 + (tl >> 4) * 512 + core_offset(h, tl & 15)) = w;
          r1[g][(i & 1) + 2 * (i >> 2)] += half_at(second ? m_b : m_a, g) * pv[i] - 1024.f * __half2float(w);
        }
      }
    }
    async_proxy_fence();
    __syncthreads();
    // ---- output: O^T_g += U_g^T W_g, two groups in flight ----
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
      const int b = g & 1;
#pragma unroll
      for (int kt = 0; kt < 4; ++kt)  // the tile (tokens 16 kt.., channels 64 g + 16 warp..) transposed
        operand4_x16<true>(a[b][kt], output_word(sw + ((kt * TILES) + 4 * g + warp) * 32, lane), MAGIC);
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        const uint64_t desc = smem_desc(w_smem + g * 2048 + kt * 512, lbo, sbo);
        wgmma_m64n16k16(acc_o[g], a[b][kt], desc, 1);
        if constexpr (FAST) wgmma_m64n16k16(acc_o[g], MINUS_MAGIC, desc, 1);  // - 1024 sum_t W
      }
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
  }
  cp_async_wait<0>();
  store_partial(acc_o, partial, warp, lane);
  // the rank-1 term: sum over the 8 lanes of a head pair (lane bits 2-4), then over the warps in order
  __syncthreads();  // every warp is done with W: its space holds the warps' sums [4][16][8]
  float* r1s = reinterpret_cast<float*>(w_smem);
#pragma unroll
  for (int g = 0; g < GROUPS; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = r1[g][j];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 4) r1s[(warp * HEADS + hb + (j & 1) + 8 * (j >> 1)) * GROUPS + g] = v;
    }
  __syncthreads();
  {
    const int h = tid >> 3, g = tid & 7;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) v += r1s[(w * HEADS + h) * GROUPS + g];
    rank1_out[(size_t(blockIdx.x) * HEADS + h) * GROUPS + g] = v;
  }
}


// Variant 2 (dequantised in registers): the A operands are dequantised where they are built, one HSUB2 (the
// magic off, exact) and one HFMA2 (x = u s + m, one fp16 rounding, the Triton kernels' precision) a register;
// one accumulator for all groups in the scores (no fold), P itself as the output's B operand (one stmatrix a warp
// and step), no rank-1 term. Scales and minima come group-major per 16-token tile, [T/16][8][16] fp16 (the
// bytes of a step are the same as token-major, so the stages and copies are shared), so the output operand's
// token pairs read their scale and minimum pairs in one load each.

__global__ void __launch_bounds__(128, 2)
    stream_h16_dq_kernel(const uint32_t* __restrict__ words, const half* __restrict__ scale_gm,
                         const half* __restrict__ minimum_gm, const half* __restrict__ q, const half* __restrict__ p,
                         float* __restrict__ scores, float* __restrict__ partial, int tokens, int per_cta,
                         int write_scores, uint32_t lbo, uint32_t sbo) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_smem = smem;
  unsigned char* p_smem = smem + Q_BYTES;  // P^T of the step: N = 16 heads, K = 64 tokens, 4 K-tiles of 512 B
  unsigned char* stages = smem + Q_BYTES + P_BYTES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t_begin = blockIdx.x * per_cta, t_end = min(tokens, t_begin + per_cta);
  const int steps = (t_end - t_begin) / STEP;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load_step(stages + s * STAGE_BYTES, words, scale_gm, minimum_gm, p, t_begin + s * STEP, tid);
    cp_async_commit();
  }
  stage_queries(q, q_smem, tid);
  async_proxy_fence();
  const int tl0 = 16 * warp + (lane >> 2), hb = 2 * (lane & 3), tq = lane & 3;
  const int stsm_off = warp * 512 + ((((lane >> 3) & 1) * 2) + (lane >> 4)) * 128 + (lane & 7) * 16;
  const __half2 sixteenth = __half2half2(__ushort_as_half(0x2C00));  // 1/16
  float acc_o[GROUPS][8];
#pragma unroll
  for (int g = 0; g < GROUPS; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_o[g][i] = 0.f;
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // step s landed; step s - 1 done with its stage and with P
    if (s + STAGES - 1 < steps)
      load_step(stages + ((s + STAGES - 1) % STAGES) * STAGE_BYTES, words, scale_gm, minimum_gm, p,
                t_begin + (s + STAGES - 1) * STEP, tid);
    cp_async_commit();
    const unsigned char* st = stages + (s % STAGES) * STAGE_BYTES;
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(st);
    const half* ssc = reinterpret_cast<const half*>(st + CODE_BYTES);  // [4 tiles][8 groups][16 tokens]
    const half* smn = reinterpret_cast<const half*>(st + CODE_BYTES + META_BYTES);
    const uint32_t* sp = reinterpret_cast<const uint32_t*>(st + CODE_BYTES + 2 * META_BYTES);
    // ---- scores: tokens tl0 (rows g) and tl0 + 8 (rows g + 8, carrying 16 u: scale / 16) ----
    float acc[8];
    uint32_t a[2][4][4];
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
      const int b = g & 1, row = (warp * GROUPS + g) * 16 + (lane >> 2);
      const __half2 s_a = __half2half2(ssc[row]), m_a = __half2half2(smn[row]);
      const __half2 s_b = __hmul2(__half2half2(ssc[row + 8]), sixteenth), m_b = __half2half2(smn[row + 8]);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t u[4];
        operand4_x16<false>(u, sw[(warp * TILES + 4 * g + c) * 32 + lane], MAGIC);
        a[b][c][0] = dequant_pair(u[0], s_a, m_a);
        a[b][c][1] = dequant_pair(u[1], s_b, m_b);
        a[b][c][2] = dequant_pair(u[2], s_a, m_a);
        a[b][c][3] = dequant_pair(u[3], s_b, m_b);
      }
      wgmma_fence();
#pragma unroll
      for (int c = 0; c < 4; ++c)
        wgmma_m64n16k16(acc, a[b][c], smem_desc(q_smem + (4 * g + c) * 512, lbo, sbo), g > 0 || c > 0);
      wgmma_commit();
      wgmma_wait<1>();
    }
    // ---- P^T as the output's B operand: this warp's 16 tokens, straight from the staged fp16 pairs ----
    {
      const uint32_t pr[4] = {sp[tl0 * 8 + hb / 2], sp[(tl0 + 8) * 8 + hb / 2], sp[tl0 * 8 + hb / 2 + 4],
                              sp[(tl0 + 8) * 8 + hb / 2 + 4]};
      stmatrix_x4_trans(p_smem + stsm_off, pr);
    }
    wgmma_wait<0>();
    const int t0 = t_begin + s * STEP;
    if (write_scores) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        scores[size_t(t0 + tl0 + 8 * ((i >> 1) & 1)) * HEADS + hb + (i & 1) + 8 * (i >> 2)] = acc[i];
    }
    async_proxy_fence();
    __syncthreads();
    // ---- output: O^T_g += X_g^T P^T, the tile transposed: registers 0, 1 tokens 2t, 2t + 1; 2, 3 tokens
    // 2t + 8, 2t + 9 (16 u) of K-tile kt ----
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
      const int b = g & 1;
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        const int pair = (kt * GROUPS + g) * 16 + 2 * tq;
        const __half2 s_lo = *reinterpret_cast<const __half2*>(ssc + pair);
        const __half2 m_lo = *reinterpret_cast<const __half2*>(smn + pair);
        const __half2 s_hi = __hmul2(*reinterpret_cast<const __half2*>(ssc + pair + 8), sixteenth);
        const __half2 m_hi = *reinterpret_cast<const __half2*>(smn + pair + 8);
        uint32_t u[4];
        operand4_x16<true>(u, output_word(sw + ((kt * TILES) + 4 * g + warp) * 32, lane), MAGIC);
        a[b][kt][0] = dequant_pair(u[0], s_lo, m_lo);
        a[b][kt][1] = dequant_pair(u[1], s_lo, m_lo);
        a[b][kt][2] = dequant_pair(u[2], s_hi, m_hi);
        a[b][kt][3] = dequant_pair(u[3], s_hi, m_hi);
      }
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) wgmma_m64n16k16(acc_o[g], a[b][kt], smem_desc(p_smem + kt * 512, lbo, sbo), 1);
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
  }
  cp_async_wait<0>();
  store_partial(acc_o, partial, warp, lane);
}

}  // namespace h16s
}  // namespace quantmla

extern "C" int quantmla_stream_h16(const uint32_t* words, const void* scale, const void* minimum, const void* q,
                                   const void* p, float* scores, float* partial, float* rank1, int tokens,
                                   int per_cta, int ctas, int write_scores, int variant, unsigned lbo, unsigned sbo,
                                   void* stream) {
  using namespace quantmla::h16s;
  if (tokens % STEP || per_cta % STEP) return -2;
  if (variant != 0 && variant != 1) return -3;
  const auto kernel = variant ? stream_h16_kernel<true> : stream_h16_kernel<false>;
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  kernel<<<ctas, 128, SMEM_BYTES, static_cast<cudaStream_t>(stream)>>>(
      words, static_cast<const half*>(scale), static_cast<const half*>(minimum), static_cast<const half*>(q),
      static_cast<const half*>(p), scores, partial, rank1, tokens, per_cta, write_scores, lbo, sbo);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int quantmla_stream_h16_dq(const uint32_t* words, const void* scale_gm, const void* minimum_gm,
                                      const void* q, const void* p, float* scores, float* partial, int tokens,
                                      int per_cta, int ctas, int write_scores, unsigned lbo, unsigned sbo,
                                      void* stream) {
  using namespace quantmla::h16s;
  if (tokens % STEP || per_cta % STEP) return -2;
  constexpr int smem_bytes = Q_BYTES + P_BYTES + STAGES * STAGE_BYTES;
  const cudaError_t attr =
      cudaFuncSetAttribute(stream_h16_dq_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  stream_h16_dq_kernel<<<ctas, 128, smem_bytes, static_cast<cudaStream_t>(stream)>>>(
      words, static_cast<const half*>(scale_gm), static_cast<const half*>(minimum_gm), static_cast<const half*>(q),
      static_cast<const half*>(p), scores, partial, tokens, per_cta, write_scores, lbo, sbo);
  return static_cast<int>(cudaGetLastError());
}
