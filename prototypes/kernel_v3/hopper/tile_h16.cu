// Decode kernel v3, the h = 16 inner loop as a prototype (issue 19): both products on wgmma with the codes as
// the register A operand straight from the fragment-ordered words (prototypes/kernel_v3/fragment.py), no
// dequantised tile anywhere, the scale and minimum folded out of the products (prototypes/kernel_v3/folded.py).
//
// One CTA = one warpgroup (128 threads) over a contiguous run of tokens, 64 tokens a step (warp w: tokens
// 16w..16w+15 of the step). Content latent of 512 channels, INT4 codes, groups of 64 channels, 16 heads.
//   scores  S^T[t, h] = sum_g s_g[t] * (U_g Q_g^T)[t, h] + m'_g[t] * qsum_g[h]          (m' = m - 1024 s)
//           wgmma m64n16k16: A = scores operand (registers), B = Q^T (shared memory, K-major core matrices)
//   output  O^T_g = U_g^T W_g + rank-1,  W_g = (s_g o P)^T rounded to fp16,
//           rank-1[h, g] = sum_t m_g[t] P[h, t] - 1024 sum_t W_g[t, h]
//           wgmma m64n16k16 per group: A = output operand (two words + prmt), B = W_g (shared memory)
// The probabilities P are an input here (the prototype measures the two products and their operands, not
// the softmax); partial outputs per CTA are summed by the caller. Pure CUDA: `nvcc -gencode
// arch=compute_90a,code=sm_90a -cubin` compiles it alone.
#include <cstdint>
#include <cuda_fp16.h>

#include "fragment.cuh"
#include "sm90.cuh"

namespace quantmla {
namespace h16 {

constexpr int HEADS = 16, DIM = 512, GROUP = 64, GROUPS = DIM / GROUP, TILES = DIM / 16, STEP = 64;
constexpr uint32_t MAGIC = 0x64006400u;  // fp16 operands

// words [T/16][32 tiles][32 lanes]; scale, minimum [T][8] fp16; q [16][512] fp16; p [16][T] fp16;
// scores [T][16] fp32; partial [ctas][16][512] fp32; rank1 [ctas][16][8] fp32
__global__ void __launch_bounds__(128) tile_h16_kernel(const uint32_t* __restrict__ words, const half* __restrict__ scale,
                                                       const half* __restrict__ minimum, const half* __restrict__ q,
                                                       const half* __restrict__ p, float* __restrict__ scores,
                                                       float* __restrict__ partial, float* __restrict__ rank1_out,
                                                       int tokens, int per_cta, uint32_t lbo, uint32_t sbo) {
  __shared__ __align__(128) unsigned char q_smem[HEADS * DIM * 2];                // 16 KB
  __shared__ __align__(128) unsigned char w_smem[GROUPS * HEADS * STEP * 2];     // 16 KB
  __shared__ float qsum[GROUPS][HEADS];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < HEADS * DIM; i += 128) {
    const int n = i / DIM, k = i % DIM;
    *reinterpret_cast<half*>(q_smem + (k >> 4) * 512 + core_offset(n, k & 15)) = q[i];
  }
  const int my_h = tid >> 3, my_g = tid & 7;  // one (head, group) per thread: query sums and the rank-1 term
  {
    float s = 0.f;
    for (int i = 0; i < GROUP; ++i) s += __half2float(q[my_h * DIM + my_g * GROUP + i]);
    qsum[my_g][my_h] = s;
  }
  async_proxy_fence();
  __syncthreads();
  float acc_o[GROUPS][8];
#pragma unroll
  for (int g = 0; g < GROUPS; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_o[g][i] = 0.f;
  float rank1 = 0.f;
  const int t_begin = blockIdx.x * per_cta, t_end = min(tokens, t_begin + per_cta);
  for (int t0 = t_begin; t0 < t_end; t0 += STEP) {
    // ---- scores: warp w's 16 tokens, one accumulator per group, folded after ----
    const int tb = t0 / 16 + warp;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int g = 0; g < GROUPS; ++g) {
      float acc_g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      uint32_t a[4][4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        operand<4, false>(a[c], words[(size_t(tb) * TILES + 4 * g + c) * 32 + lane], 0, MAGIC);
      }
      wgmma_fence();
#pragma unroll
      for (int c = 0; c < 4; ++c) wgmma_m64n16k16(acc_g, a[c], smem_desc(q_smem + (4 * g + c) * 512, lbo, sbo), c > 0);
      wgmma_commit();
      wgmma_wait();
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int t = t0 + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1), h = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
        const float s = __half2float(scale[t * GROUPS + g]), m = __half2float(minimum[t * GROUPS + g]);
        acc[i] += s * acc_g[i] + (m - 1024.f * s) * qsum[g][h];
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = t0 + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1), h = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      scores[t * HEADS + h] = acc[i];
    }
    // ---- output: W_g = (s_g o P)^T in shared memory (each thread its (head, group)), then the products ----
    for (int k = 0; k < STEP; ++k) {
      const int t = t0 + k;
      const float pv = __half2float(p[my_h * tokens + t]);
      const half w = __float2half_rn(__half2float(scale[t * GROUPS + my_g]) * pv);
      *reinterpret_cast<half*>(w_smem + my_g * 2048 + (k >> 4) * 512 + core_offset(my_h, k & 15)) = w;
      rank1 += __half2float(minimum[t * GROUPS + my_g]) * pv - 1024.f * __half2float(w);
    }
    async_proxy_fence();
    __syncthreads();
#pragma unroll  // acc_o[g] must stay in registers: g known at compile time
    for (int g = 0; g < GROUPS; ++g) {
      uint32_t a[4][4];
#pragma unroll
      for (int kt = 0; kt < 4; ++kt)  // the tile (tokens t0 + 16 kt.., channels 64 g + 16 warp..) transposed
        operand<4, true>(a[kt], output_word(words + (size_t(t0 / 16 + kt) * TILES + 4 * g + warp) * 32, lane), 0, MAGIC);
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) wgmma_m64n16k16(acc_o[g], a[kt], smem_desc(w_smem + g * 2048 + kt * 512, lbo, sbo), 1);
      wgmma_commit();
      wgmma_wait();
    }
    __syncthreads();  // W is rewritten by the next step
  }
  float* out = partial + size_t(blockIdx.x) * HEADS * DIM;
#pragma unroll
  for (int g = 0; g < GROUPS; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int ch = GROUP * g + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1), h = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      out[h * DIM + ch] = acc_o[g][i];
    }
  rank1_out[(size_t(blockIdx.x) * HEADS + my_h) * GROUPS + my_g] = rank1;
}

}  // namespace h16
}  // namespace quantmla

extern "C" int quantmla_tile_h16(const uint32_t* words, const void* scale, const void* minimum, const void* q,
                                 const void* p, float* scores, float* partial, float* rank1, int tokens, int per_cta,
                                 int ctas, unsigned lbo, unsigned sbo, void* stream) {
  if (tokens % quantmla::h16::STEP || per_cta % quantmla::h16::STEP) return -2;
  quantmla::h16::tile_h16_kernel<<<ctas, 128, 0, static_cast<cudaStream_t>(stream)>>>(
      words, static_cast<const half*>(scale), static_cast<const half*>(minimum), static_cast<const half*>(q),
      static_cast<const half*>(p), scores, partial, rank1, tokens, per_cta, lbo, sbo);
  return static_cast<int>(cudaGetLastError());
}
