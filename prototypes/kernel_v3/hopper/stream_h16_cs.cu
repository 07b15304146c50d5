// Decode kernel v3, the h = 16 inner loop, variant 3: the channels split across the warps, each code unpacked
// and dequantised once (issue 19).
//
// Why: with wgmma and the A operand in registers, the scores (tokens on M) give warp w the step's tokens
// 16w..16w+15 for every channel, and the output (channels on M, tokens on K) needs warp w's channel rows for
// *every* token of a K-step: the other warps' tokens. So variants 0-2 unpack and dequantise each code twice, once
// per product layout (the packed words of other warps read from shared memory), and that unpacking is most of
// their ~1,550 instructions a warp and 64-token step (Nsight Compute, prototypes/kernel_v3/README.md).
//
// Here each warp owns 128 channels (8 channel tiles, 2 groups; WARPS = 4, 248 registers, 2 CTAs an SM) or 64 (4
// tiles, 1 group; WARPS = 8, 124 registers, 16 warps an SM) for all tokens, on the warp-level tensor cores
// (mma.sync m16n8k16):
//   - scores: S[tokens, heads] partial over the warp's channels = X Q^T, A = the dequantised tile (tokens on M,
//     the one-shift operand and one HFMA2 a register, as variant 2), B = Q^T fragments held in registers for the
//     whole kernel; the four warps' partial scores are summed through shared memory (2 KB a warp and step), where
//     the real kernel's softmax goes, then P is published (a second barrier, kept here to pay its cost);
//   - output: O^T[channels, heads] += X^T P, A = the same dequantised tile transposed in registers (four
//     movmatrix.trans: the transposed tile's registers 0-3 are the transposes of registers 0, 2, 1, 3), B = P's
//     fragments by one ldmatrix.x4.trans a 16-token block from shared memory.
// The tiles of a step are kept (transposed) in registers between the products, as the real kernel must keep them
// until P exists: 32 tokens a step (64 registers of tiles). Copies by cp.async, STAGES - 1 steps ahead, of the
// step's codes, group-major scales and minima ([T/16][8][16] fp16, variant 2's layout) and P.
// P is an input (token-major [T][16], no softmax) and the scores are written out when asked, as in variants 0-2.
#include <cstdint>
#include <cuda_fp16.h>

#include "fragment.cuh"
#include "sm90.cuh"

namespace quantmla {
namespace h16c {

constexpr int HEADS = 16, DIM = 512, GROUPS = 8, TILES = 32, STEP = 32, BLOCKS = STEP / 16, STAGES = 3;
constexpr uint32_t MAGIC = 0x64006400u;
// one stage: codes [2 blocks][32 tiles][32 lanes] words, scales and minima [2 blocks][8 groups][16 tokens] fp16,
// P [32 tokens][16 heads] fp16
constexpr int CODE_BYTES = STEP * DIM / 2, META_BYTES = STEP * GROUPS * 2, P_BYTES = STEP * HEADS * 2;
constexpr int STAGE_BYTES = CODE_BYTES + 2 * META_BYTES + P_BYTES;  // 10,240
// the warps' partial scores, fp32: 38,912 B of shared memory a CTA with 4 warps, 47,104 with 8
template <int WARPS>
constexpr int RED_BYTES = WARPS * STEP * HEADS * 4;
template <int WARPS>
constexpr int SMEM_BYTES = RED_BYTES<WARPS> + STAGES * STAGE_BYTES;

// copy step tokens t0 .. t0 + 31 into its stage (every thread commits one group whether or not it copied)
template <int THREADS>
__device__ __forceinline__ void load_step(unsigned char* stage, const uint32_t* words, const half* scale_gm,
                                          const half* minimum_gm, const half* p, int t0, int tid) {
  const unsigned char* code_src = reinterpret_cast<const unsigned char*>(words) + size_t(t0) * (DIM / 2);
#pragma unroll
  for (int k = 0; k < CODE_BYTES / 16 / THREADS; ++k) {
    const int c = tid + THREADS * k;
    cp_async16(stage + 16 * c, code_src + 16 * c);
  }
  // 32 chunks of scales, 32 of minima, 64 of P: one a thread of the first 128
  const int c = tid;
  if (c >= 128) return;
  const unsigned char* src =
      c < 32 ? reinterpret_cast<const unsigned char*>(scale_gm + size_t(t0) * GROUPS) + 16 * c
      : c < 64 ? reinterpret_cast<const unsigned char*>(minimum_gm + size_t(t0) * GROUPS) + 16 * (c - 32)
               : reinterpret_cast<const unsigned char*>(p + size_t(t0) * HEADS) + 16 * (c - 64);
  cp_async16(stage + CODE_BYTES + 16 * c, src);
}

// this CTA's tokens: its first (t_begin) and how many whole steps of STEP tokens it streams
__device__ __forceinline__ int cta_steps(int tokens, int per_cta, int& t_begin) {
  t_begin = blockIdx.x * per_cta;
  return max(0, (min(tokens, t_begin + per_cta) - t_begin) / STEP);
}

// the ring's first STAGES - 1 steps (a group committed for each, copied or not)
template <int THREADS>
__device__ __forceinline__ void prefetch_steps(unsigned char* stages, const uint32_t* words, const half* scale_gm,
                                               const half* minimum_gm, const half* p, int t_begin, int steps,
                                               int tid) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load_step<THREADS>(stages + s * STAGE_BYTES, words, scale_gm, minimum_gm, p, t_begin + s * STEP, tid);
    cp_async_commit();
  }
}

// step s's stage, once it has landed: one barrier (every thread is also done with step s - 1's stage, which the
// copy of step s + STAGES - 1 issued here overwrites)
template <int THREADS>
__device__ __forceinline__ const unsigned char* begin_step(unsigned char* stages, const uint32_t* words,
                                                           const half* scale_gm, const half* minimum_gm,
                                                           const half* p, int t_begin, int s, int steps, int tid) {
  cp_async_wait<STAGES - 2>();
  __syncthreads();
  if (s + STAGES - 1 < steps)
    load_step<THREADS>(stages + ((s + STAGES - 1) % STAGES) * STAGE_BYTES, words, scale_gm, minimum_gm, p,
                       t_begin + (s + STAGES - 1) * STEP, tid);
  cp_async_commit();
  return stages + (s % STAGES) * STAGE_BYTES;
}

// Q^T as the scores' B fragments of this warp's tiles (8 warp + c with 4 warps), both head halves: lane (g, t)
// holds Q[h][2t, 2t + 1] and Q[h][2t + 8, 2t + 9] of the tile, head h = 8 half + g
template <int WARPS>
__device__ __forceinline__ void load_queries(uint32_t (&qf)[TILES / WARPS][2][2], const half* q, int warp, int g,
                                             int t) {
#pragma unroll
  for (int c = 0; c < TILES / WARPS; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const half* row = q + (8 * h + g) * DIM + 16 * (TILES / WARPS * warp + c) + 2 * t;
      qf[c][h][0] = *reinterpret_cast<const uint32_t*>(row);
      qf[c][h][1] = *reinterpret_cast<const uint32_t*>(row + 8);
    }
}

// a step's partial scores over this warp's channels (acc_s), each code unpacked and dequantised once; the tiles
// kept transposed for the output (xt)
// SPLIT: the odd tiles accumulate apart and are added at the end (two dependent mma chains of 4 instead of one
// of 8 a block and head half; 16 more registers)
template <int WARPS, bool SPLIT = false>
__device__ __forceinline__ void step_scores(float (&acc_s)[BLOCKS][2][4], uint32_t (&xt)[BLOCKS][TILES / WARPS][4],
                                            const uint32_t (&qf)[TILES / WARPS][2][2], const uint32_t* sw,
                                            const half* ssc, const half* smn, int warp, int lane) {
  constexpr int WARP_TILES = TILES / WARPS, WARP_GROUPS = GROUPS / WARPS;
  const int g = lane >> 2;
  const __half2 sixteenth = __half2half2(__ushort_as_half(0x2C00));  // 1/16
  float acc_odd[BLOCKS][2][4];
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_s[b][h][i] = acc_odd[b][h][i] = 0.f;
#pragma unroll
    for (int gl = 0; gl < WARP_GROUPS; ++gl) {  // rows: tokens g (registers 0, 2), g + 8 (1, 3: 16 u, scale / 16)
      const int row = (b * GROUPS + WARP_GROUPS * warp + gl) * 16 + g;
      const __half2 s_a = __half2half2(ssc[row]), m_a = __half2half2(smn[row]);
      const __half2 s_b = __hmul2(__half2half2(ssc[row + 8]), sixteenth), m_b = __half2half2(smn[row + 8]);
#pragma unroll
      for (int c4 = 0; c4 < 4; ++c4) {
        const int c = 4 * gl + c4;
        uint32_t u[4], a[4];
        operand4_x16<false>(u, sw[(b * TILES + WARP_TILES * warp + c) * 32 + lane], MAGIC);
        a[0] = dequant_pair(u[0], s_a, m_a);
        a[1] = dequant_pair(u[1], s_b, m_b);
        a[2] = dequant_pair(u[2], s_a, m_a);
        a[3] = dequant_pair(u[3], s_b, m_b);
        float(&acc)[2][4] = SPLIT && (c4 & 1) ? acc_odd[b] : acc_s[b];
        mma_m16n8k16(acc[0], a, qf[c][0][0], qf[c][0][1]);
        mma_m16n8k16(acc[1], a, qf[c][1][0], qf[c][1][1]);
        xt[b][c][0] = movmatrix_trans(a[0]);  // channels 0-7 x tokens 0-7
        xt[b][c][1] = movmatrix_trans(a[2]);  // channels 8-15 x tokens 0-7
        xt[b][c][2] = movmatrix_trans(a[1]);  // channels 0-7 x tokens 8-15
        xt[b][c][3] = movmatrix_trans(a[3]);
      }
    }
    if (SPLIT)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_s[b][h][i] += acc_odd[b][h][i];
  }
}

// the warps' partial scores through shared memory (red [WARPS][32 tokens][16 heads]), one barrier, then summed
// over the warps in order, four (token, head) a thread of the first 128 (the softmax's place), written to scores
// from token t0 when asked
// pub (variant 5): where the summing thread writes its four P values (token-major [32][16] fp16, from p_in): the
// real kernel's softmax writes P there from the sums
template <int WARPS>
__device__ __forceinline__ void reduce_scores(float* red, const float (&acc_s)[BLOCKS][2][4], float* scores, int t0,
                                              int write_scores, int tid, const unsigned char* p_in = nullptr,
                                              unsigned char* pub = nullptr) {
  const int warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
  float* rw = red + warp * STEP * HEADS;
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<float2*>(rw + (16 * b + g) * HEADS + 8 * h + 2 * t) = make_float2(acc_s[b][h][0], acc_s[b][h][1]);
      *reinterpret_cast<float2*>(rw + (16 * b + g + 8) * HEADS + 8 * h + 2 * t) =
          make_float2(acc_s[b][h][2], acc_s[b][h][3]);
    }
  __syncthreads();
  if (tid < 128) {
    const int i = 4 * tid;
    float4 v = *reinterpret_cast<const float4*>(red + i);
#pragma unroll
    for (int w = 1; w < WARPS; ++w) {
      const float4 o = *reinterpret_cast<const float4*>(red + w * STEP * HEADS + i);
      v.x += o.x;
      v.y += o.y;
      v.z += o.z;
      v.w += o.w;
    }
    if (write_scores) *reinterpret_cast<float4*>(scores + size_t(t0) * HEADS + i) = v;
    if (pub != nullptr) *reinterpret_cast<uint2*>(pub + 2 * i) = *reinterpret_cast<const uint2*>(p_in + 2 * i);
  }
}

// a step's output O^T += X^T P over its two 16-token blocks, P token-major [32][16] fp16 in shared memory
template <int WARP_TILES>
__device__ __forceinline__ void step_output(float (&acc_o)[WARP_TILES][2][4], const uint32_t (&xt)[BLOCKS][WARP_TILES][4],
                                            const unsigned char* sp, int lane) {
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b) {
    uint32_t pb[4];  // B fragments: heads 0-7 (registers 0, 1: tokens 0-7, 8-15), heads 8-15 (2, 3)
    const int j = lane >> 3, r = lane & 7;
    ldmatrix_x4_trans(pb, sp + (16 * b + 8 * (j & 1) + r) * (HEADS * 2) + (j >> 1) * 16);
#pragma unroll
    for (int c = 0; c < WARP_TILES; ++c) {
      mma_m16n8k16(acc_o[c][0], xt[b][c], pb[0], pb[1]);
      mma_m16n8k16(acc_o[c][1], xt[b][c], pb[2], pb[3]);
    }
  }
}

template <int WARP_TILES>
__device__ __forceinline__ void zero_output(float (&acc_o)[WARP_TILES][2][4]) {
#pragma unroll
  for (int c = 0; c < WARP_TILES; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[c][h][i] = 0.f;
}

// this CTA's O^T partial, [16 heads][512 channels] fp32: rows channels g, g + 8 of the warp's tile c, columns
// heads 8 half + 2t, 2t + 1
template <int WARP_TILES>
__device__ __forceinline__ void store_output(float* partial, const float (&acc_o)[WARP_TILES][2][4], int warp, int g,
                                             int t) {
  float* out = partial + size_t(blockIdx.x) * HEADS * DIM;
#pragma unroll
  for (int c = 0; c < WARP_TILES; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int ch = 16 * (WARP_TILES * warp + c) + g + 8 * (i >> 1), head = 8 * h + 2 * t + (i & 1);
        out[head * DIM + ch] = acc_o[c][h][i];
      }
}

// words [T/16][32 tiles][32 lanes]; scale_gm, minimum_gm [T/16][8][16] fp16; q [16][512] fp16; p [T][16] fp16;
// scores [T][16] fp32 (written when write_scores); partial [ctas][16][512] fp32. WARPS 4: each warp owns 128
// channels (groups 2w, 2w + 1); WARPS 8: 64 (group w), half the registers a thread, twice the warps an SM.
template <int WARPS, bool SPLIT>
__global__ void __launch_bounds__(32 * WARPS, 2)
    stream_h16_cs_kernel(const uint32_t* __restrict__ words, const half* __restrict__ scale_gm,
                         const half* __restrict__ minimum_gm, const half* __restrict__ q, const half* __restrict__ p,
                         float* __restrict__ scores, float* __restrict__ partial, int tokens, int per_cta,
                         int write_scores) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int THREADS = 32 * WARPS, WARP_TILES = TILES / WARPS;
  float* red = reinterpret_cast<float*>(smem);  // [WARPS][32 tokens][16 heads]
  unsigned char* stages = smem + RED_BYTES<WARPS>;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  int t_begin;
  const int steps = cta_steps(tokens, per_cta, t_begin);
  prefetch_steps<THREADS>(stages, words, scale_gm, minimum_gm, p, t_begin, steps, tid);
  uint32_t qf[WARP_TILES][2][2];
  load_queries<WARPS>(qf, q, warp, g, t);
  float acc_o[WARP_TILES][2][4];  // O^T: rows channels g, g + 8 of tile c, columns heads 8 half + 2t, 2t + 1
  zero_output<WARP_TILES>(acc_o);
  for (int s = 0; s < steps; ++s) {
    // step s landed; step s - 1 is done with its stage and with the partial scores
    const unsigned char* st = begin_step<THREADS>(stages, words, scale_gm, minimum_gm, p, t_begin, s, steps, tid);
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(st);
    const half* ssc = reinterpret_cast<const half*>(st + CODE_BYTES);
    const half* smn = reinterpret_cast<const half*>(st + CODE_BYTES + META_BYTES);
    const unsigned char* sp = st + CODE_BYTES + 2 * META_BYTES;
    float acc_s[BLOCKS][2][4];
    uint32_t xt[BLOCKS][WARP_TILES][4];
    step_scores<WARPS, SPLIT>(acc_s, xt, qf, sw, ssc, smn, warp, lane);
    reduce_scores<WARPS>(red, acc_s, scores, t_begin + s * STEP, write_scores, tid);
    __syncthreads();  // the real kernel publishes P here
    step_output<WARP_TILES>(acc_o, xt, sp, lane);  // O^T += X^T P over the step's two 16-token blocks
  }
  cp_async_wait<0>();
  store_output<WARP_TILES>(partial, acc_o, warp, g, t);
}

// Variant 5: variant 3 skewed by one step. Step s's output product runs after the barrier that opens step s + 1,
// beside step s + 1's scores in the same warp (independent chains for the scheduler to interleave: the output's
// mma.sync on the previous tiles while the next tiles are unpacked), and that barrier also publishes P: two
// barriers a step instead of three. P goes to its own double-buffered slot (written by the summing threads,
// where the real kernel's softmax writes it), since the copy ring reuses step s's stage at step s + 1. The tiles
// in registers are the previous step's until the scores overwrite them, tile by tile. SPLIT: variant 5 with the
// scores' mma chain split in two (step_scores).
constexpr int PUB_BYTES = 2 * P_BYTES;
constexpr int SMEM_SKEW_BYTES = RED_BYTES<4> + PUB_BYTES + STAGES * STAGE_BYTES;  // 41,984

template <bool SPLIT>
__global__ void __launch_bounds__(128, 2)
    stream_h16_cs_skew_kernel(const uint32_t* __restrict__ words, const half* __restrict__ scale_gm,
                              const half* __restrict__ minimum_gm, const half* __restrict__ q,
                              const half* __restrict__ p, float* __restrict__ scores, float* __restrict__ partial,
                              int tokens, int per_cta, int write_scores) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int WT = TILES / 4;
  float* red = reinterpret_cast<float*>(smem);
  unsigned char* pub = smem + RED_BYTES<4>;  // [2 steps][32 tokens][16 heads] fp16
  unsigned char* stages = pub + PUB_BYTES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  int t_begin;
  const int steps = cta_steps(tokens, per_cta, t_begin);
  prefetch_steps<128>(stages, words, scale_gm, minimum_gm, p, t_begin, steps, tid);
  uint32_t qf[WT][2][2];
  load_queries<4>(qf, q, warp, g, t);
  float acc_o[WT][2][4];
  zero_output<WT>(acc_o);
  uint32_t xt[BLOCKS][WT][4];
  for (int s = 0; s < steps; ++s) {
    // step s landed; step s - 1's P is published; its partial scores and stage are consumed
    const unsigned char* st = begin_step<128>(stages, words, scale_gm, minimum_gm, p, t_begin, s, steps, tid);
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(st);
    const half* ssc = reinterpret_cast<const half*>(st + CODE_BYTES);
    const half* smn = reinterpret_cast<const half*>(st + CODE_BYTES + META_BYTES);
    if (s > 0) step_output<WT>(acc_o, xt, pub + ((s - 1) & 1) * P_BYTES, lane);  // step s - 1's output
    float acc_s[BLOCKS][2][4];
    step_scores<4, SPLIT>(acc_s, xt, qf, sw, ssc, smn, warp, lane);
    reduce_scores<4>(red, acc_s, scores, t_begin + s * STEP, write_scores, tid, st + CODE_BYTES + 2 * META_BYTES,
                     pub + (s & 1) * P_BYTES);
  }
  if (steps > 0) {
    __syncthreads();  // the last step's P is published
    step_output<WT>(acc_o, xt, pub + ((steps - 1) & 1) * P_BYTES, lane);
  }
  cp_async_wait<0>();
  store_output<WT>(partial, acc_o, warp, g, t);
}

// Variant 4: variant 3 with the output product on wgmma. Warp w owns channel tiles 8w .. 8w + 7 as in variant 3;
// the c-th wgmma m64n16k16 of a block takes tile c of every warp as its 64 rows (M row 16w + r is channel
// 16 (8w + c) + r), each warp's 16 rows in its registers: the transposed tile xt, whose fragment layout is
// wgmma's A layout. (A first version took tiles 4j + w, one group a wgmma, and paid 8 groups' scale loads a warp
// and block: +22% instructions.) B = P^T of a 16-token block in shared memory (no-swizzle core matrices,
// written by one stmatrix.trans of warp b for block b, as variant 2 writes it). The 16 wgmma a step (2 blocks x 8
// groups) run asynchronously; their registers (xt, acc_o) are waited for before the next step's scores write xt.
// The scores are variant 3's (mma.sync, partial sums through shared memory).
constexpr int PT_BYTES = BLOCKS * 512;  // P^T of a step: 2 K-tiles of 16 tokens x 16 heads fp16
constexpr int SMEM_WG_BYTES = RED_BYTES<4> + PT_BYTES + STAGES * STAGE_BYTES;  // 39,936

__global__ void __launch_bounds__(128, 2)
    stream_h16_cs_wg_kernel(const uint32_t* __restrict__ words, const half* __restrict__ scale_gm,
                            const half* __restrict__ minimum_gm, const half* __restrict__ q,
                            const half* __restrict__ p, float* __restrict__ scores, float* __restrict__ partial,
                            int tokens, int per_cta, int write_scores) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int WT = TILES / 4;  // a warp's tiles: 8 warp + c
  float* red = reinterpret_cast<float*>(smem);
  unsigned char* pt_smem = smem + RED_BYTES<4>;
  unsigned char* stages = pt_smem + PT_BYTES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  int t_begin;
  const int steps = cta_steps(tokens, per_cta, t_begin);
  prefetch_steps<128>(stages, words, scale_gm, minimum_gm, p, t_begin, steps, tid);
  uint32_t qf[WT][2][2];
  load_queries<4>(qf, q, warp, g, t);
  // wgmma D of product c: rows 16 warp + g (+ 8), i.e. channels 16 (8 warp + c) + g (+ 8), columns heads 2t,
  // 2t + 1 (+ 8); zeroed by the first step's first product (scale-d 0), not by ordinary instructions, which would
  // make ptxas serialise the wgmma pipeline
  float acc_o[WT][8];
  if (steps == 0) {  // (every CTA has a step when tokens and per_cta are multiples of 32; kept for safety)
    for (int i = tid; i < HEADS * DIM; i += 128) partial[size_t(blockIdx.x) * HEADS * DIM + i] = 0.f;
    return;
  }
  const int stsm_off = ((((lane >> 3) & 1) * 2) + (lane >> 4)) * 128 + (lane & 7) * 16;
  const uint32_t lbo = 256, sbo = 128;
  uint32_t xt[BLOCKS][WT][4];
  for (int s = 0; s < steps; ++s) {
    // step s landed; step s - 1 is done with its stage and the partial scores
    const unsigned char* st = begin_step<128>(stages, words, scale_gm, minimum_gm, p, t_begin, s, steps, tid);
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(st);
    const half* ssc = reinterpret_cast<const half*>(st + CODE_BYTES);
    const half* smn = reinterpret_cast<const half*>(st + CODE_BYTES + META_BYTES);
    const uint32_t* sp = reinterpret_cast<const uint32_t*>(st + CODE_BYTES + 2 * META_BYTES);
    wgmma_wait<0>();  // step s - 1's output products are done with xt and with P^T
    float acc_s[BLOCKS][2][4];
    step_scores<4>(acc_s, xt, qf, sw, ssc, smn, warp, lane);
    reduce_scores<4>(red, acc_s, scores, t_begin + s * STEP, write_scores, tid);
    if (warp < BLOCKS) {  // P^T of block `warp` into its core matrices (the real kernel's softmax writes it here)
      const int tl0 = 16 * warp + g, hp = t;  // head pair 2t, 2t + 1 (and + 8)
      const uint32_t pr[4] = {sp[tl0 * 8 + hp], sp[(tl0 + 8) * 8 + hp], sp[tl0 * 8 + hp + 4],
                              sp[(tl0 + 8) * 8 + hp + 4]};
      stmatrix_x4_trans(pt_smem + warp * 512 + stsm_off, pr);
    }
    async_proxy_fence();
    __syncthreads();  // P^T is published
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b)
#pragma unroll
      for (int c = 0; c < WT; ++c)
        wgmma_m64n16k16(acc_o[c], xt[b][c], smem_desc(pt_smem + b * 512, lbo, sbo), s > 0 || b > 0);
    wgmma_commit();
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
  float* out = partial + size_t(blockIdx.x) * HEADS * DIM;
#pragma unroll
  for (int c = 0; c < WT; ++c)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int ch = 16 * (WT * warp + c) + g + 8 * ((i >> 1) & 1), head = 2 * t + (i & 1) + 8 * (i >> 2);
      out[head * DIM + ch] = acc_o[c][i];
    }
}

}  // namespace h16c
}  // namespace quantmla

namespace {
template <int WARPS, bool SPLIT = false>
int launch_cs(const uint32_t* words, const void* scale_gm, const void* minimum_gm, const void* q, const void* p,
              float* scores, float* partial, int tokens, int per_cta, int ctas, int write_scores, void* stream) {
  using namespace quantmla::h16c;
  auto kernel = stream_h16_cs_kernel<WARPS, SPLIT>;
  if (SMEM_BYTES<WARPS> > 48 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES<WARPS>);
  kernel<<<ctas, 32 * WARPS, SMEM_BYTES<WARPS>, static_cast<cudaStream_t>(stream)>>>(
      words, static_cast<const half*>(scale_gm), static_cast<const half*>(minimum_gm), static_cast<const half*>(q),
      static_cast<const half*>(p), scores, partial, tokens, per_cta, write_scores);
  return static_cast<int>(cudaGetLastError());
}
}  // namespace

namespace {
template <bool SPLIT>
int launch_skew(const uint32_t* words, const void* scale_gm, const void* minimum_gm, const void* q, const void* p,
                float* scores, float* partial, int tokens, int per_cta, int ctas, int write_scores, void* stream) {
  using namespace quantmla::h16c;
  stream_h16_cs_skew_kernel<SPLIT><<<ctas, 128, SMEM_SKEW_BYTES, static_cast<cudaStream_t>(stream)>>>(
      words, static_cast<const half*>(scale_gm), static_cast<const half*>(minimum_gm), static_cast<const half*>(q),
      static_cast<const half*>(p), scores, partial, tokens, per_cta, write_scores);
  return static_cast<int>(cudaGetLastError());
}
}  // namespace

// warps 4 or 8 (-3 otherwise); schedule 0: variant 3, 1: variant 4 (the output on wgmma), 2: variant 5 (skewed),
// 3: variant 5 with the scores' chain split, 4: variant 3 with it; 1-4 with 4 warps only (-3 otherwise); -2:
// tokens or per_cta not a multiple of 32
extern "C" int quantmla_stream_h16_cs(const uint32_t* words, const void* scale_gm, const void* minimum_gm,
                                      const void* q, const void* p, float* scores, float* partial, int tokens,
                                      int per_cta, int ctas, int write_scores, int warps, int schedule,
                                      void* stream) {
  using namespace quantmla::h16c;
  if (tokens % STEP || per_cta % STEP) return -2;
  if (schedule < 0 || schedule > 4 || (schedule > 0 && warps != 4)) return -3;
  if (schedule == 4)
    return launch_cs<4, true>(words, scale_gm, minimum_gm, q, p, scores, partial, tokens, per_cta, ctas,
                              write_scores, stream);
  if (schedule >= 2)
    return schedule == 2 ? launch_skew<false>(words, scale_gm, minimum_gm, q, p, scores, partial, tokens, per_cta,
                                              ctas, write_scores, stream)
                         : launch_skew<true>(words, scale_gm, minimum_gm, q, p, scores, partial, tokens, per_cta,
                                             ctas, write_scores, stream);
  if (schedule == 1) {
    stream_h16_cs_wg_kernel<<<ctas, 128, SMEM_WG_BYTES, static_cast<cudaStream_t>(stream)>>>(
        words, static_cast<const half*>(scale_gm), static_cast<const half*>(minimum_gm),
        static_cast<const half*>(q), static_cast<const half*>(p), scores, partial, tokens, per_cta, write_scores);
    return static_cast<int>(cudaGetLastError());
  }
  if (warps == 4)
    return launch_cs<4>(words, scale_gm, minimum_gm, q, p, scores, partial, tokens, per_cta, ctas, write_scores,
                        stream);
  if (warps == 8)
    return launch_cs<8>(words, scale_gm, minimum_gm, q, p, scores, partial, tokens, per_cta, ctas, write_scores,
                        stream);
  return -3;
}
