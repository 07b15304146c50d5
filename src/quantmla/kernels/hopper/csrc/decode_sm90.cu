// quantmla's sm_90a MLA decode over low-bit pages (INT4 or INT2 content, INT4 RoPE key, groups of 64) for
// 64 query rows a CTA: the page splits of quantmla.kernels.decode.mla_decode at >= 64 rows a sequence.
//
// Schedule (after FlashMLA's dense SM90 decode; our own code): 384 threads.
//  * warpgroup 2, the producer (setmaxnreg 72): loads a 64-token tile's code and scale words straight from the
//    pages (16-byte loads, before it waits for a free buffer), turns them into fp16 with the group-planar
//    unpack (lop3 + sub + fma per pair of values) and stores the K tile, 9 blocks of 64 tokens x 64 channels
//    with the 128-byte swizzle, into one of two buffers; it arrives on the buffer's `full` mbarrier.
//  * warpgroups 0 and 1, the consumers (setmaxnreg 216), each own half of the output (256 channels, 128 fp32
//    registers a thread) and the "seesaw": of each pair of tiles, warpgroup 0 computes the scores of the
//    first (S = Q K^T, wgmma m64n64k16, Q's content part from shared memory, its RoPE part from registers),
//    warpgroup 1 those of the second; the running maximum, the rescale factors and the probabilities P pass
//    through shared memory (named barriers), and each warpgroup multiplies both tiles' P into its half of V
//    (wgmma m64n256k16, P from registers, V = the same K tile read N-major).
// Partials are written as the Triton page splits write theirs (normalised output, natural log-sum-exp), so
// the combine pass and the window programs are shared.
#include <cuda_runtime.h>

#include <cstdint>

#include "decode_sm90.h"
#include "sm90_ops.cuh"

namespace quantmla_sm90 {

constexpr int ROWS = 64;  // query rows a CTA
constexpr int TILE = 64;  // tokens a K tile
constexpr int DC = 512;
constexpr int BLOCK_BYTES = TILE * 128;         // 64 tokens x 64 fp16 channels
constexpr int TILE_BYTES = 9 * BLOCK_BYTES;     // 576 channels
constexpr int Q_BYTES = 8 * BLOCK_BYTES;        // Q's content channels (its RoPE channels stay in registers)
constexpr int P_WORDS = ROWS * TILE / 2;        // one tile's probabilities, fp16 pairs
constexpr int OFF_K = Q_BYTES;
constexpr int OFF_P = OFF_K + 2 * TILE_BYTES;
constexpr int OFF_ROW = OFF_P + 2 * P_WORDS * 4;  // 6 row arrays of 64 floats
constexpr int OFF_BAR = OFF_ROW + 6 * ROWS * 4;
constexpr int OFF_PLAN = OFF_BAR + 4 * 8;
constexpr int SMEM_BYTES = OFF_PLAN + 16 + 1024;  // + slack to align the base to 1024 B
constexpr int THREADS = 384;
// setmaxnreg: the producer gives back what the consumers take (168 at entry: 3 x 168 = 2 x 216 + 72)
constexpr int PRODUCER_REGS = 72, CONSUMER_REGS = 216;
static_assert(2 * CONSUMER_REGS + PRODUCER_REGS <= 3 * 168, "setmaxnreg.inc would wait forever");
constexpr int BAR_Q = 1, BAR_P0 = 2, BAR_P1 = 3, BAR_L = 4;  // named barriers of the 256 consumer threads


__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ int paged_tokens(int total, int ws, int wr) {
  return (ws + wr > 0) ? (total > ws + wr ? total - wr : 0) : total;
}

// quantmla.kernels.splits.plan_pages_per_split, by one warp
__device__ int plan_pages_per_split(const Params& p, int hg, int lane) {
  int act = 0, mx = 0;
  long long tot = 0;
  for (int i = lane; i < p.B; i += 32) {
    const int pg = cdiv(paged_tokens(p.npaged[i], p.ws, p.wr), p.page);
    act += pg > 0;
    mx = max(mx, pg);
    tot += pg;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    act += __shfl_xor_sync(0xffffffffu, act, o);
    mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    tot += __shfl_xor_sync(0xffffffffu, tot, o);
  }
  const int seqs = max(act, 1), bh = seqs * hg;
  const int c8 = cdiv(8 * p.sms, bh);
  const bool small = bh <= 32;
  const bool shortp = mx < (small ? 24 : 4) * c8;
  const int per_sm = (small && mx < 4 * c8) ? 2 : (shortp ? 4 : 8);
  int ns = min(min(cdiv(per_sm * p.sms, bh), mx), p.maxs);
  ns = max(min(ns, p.ns), 1);
  const long long a = (tot + (long long)seqs * ns - 1) / ((long long)seqs * ns);
  return max(max(static_cast<int>(a), cdiv(mx, p.ns)), 1);
}

template <int BITS, int POS>
__device__ __forceinline__ void store_plane(uint32_t addr, const uint32_t (&x)[4], uint32_t sm) {
  st_shared_v4(addr, dequant_pair<BITS, POS>(x[0], sm), dequant_pair<BITS, POS>(x[1], sm),
               dequant_pair<BITS, POS>(x[2], sm), dequant_pair<BITS, POS>(x[3], sm));
}

// one content unit (8 channels of each of the 8 planes of one token) into the K tile: `off` is the unit's
// (row, chunk) offset inside a 64-channel block; plane k goes to block k
template <int CBITS>
__device__ __forceinline__ void store_content_unit(uint32_t kbase, uint32_t off, const uint4* w, const uint32_t (&sm)[8]) {
  if constexpr (CBITS == 4) {  // 8 words of 8 nibbles: pair the words' halves first (Triton's prmt pair)
    const uint32_t wd[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo[i] = __byte_perm(wd[2 * i], wd[2 * i + 1], 0x5410);
      hi[i] = __byte_perm(wd[2 * i], wd[2 * i + 1], 0x7632);
    }
    store_plane<4, 0>(kbase + 0 * BLOCK_BYTES + off, lo, sm[0]);
    store_plane<4, 4>(kbase + 1 * BLOCK_BYTES + off, lo, sm[1]);
    store_plane<4, 8>(kbase + 2 * BLOCK_BYTES + off, lo, sm[2]);
    store_plane<4, 12>(kbase + 3 * BLOCK_BYTES + off, lo, sm[3]);
    store_plane<4, 0>(kbase + 4 * BLOCK_BYTES + off, hi, sm[4]);
    store_plane<4, 4>(kbase + 5 * BLOCK_BYTES + off, hi, sm[5]);
    store_plane<4, 8>(kbase + 6 * BLOCK_BYTES + off, hi, sm[6]);
    store_plane<4, 12>(kbase + 7 * BLOCK_BYTES + off, hi, sm[7]);
  } else {  // 8 16-bit words of 8 2-bit codes: a register holds the words of two channels already
    const uint32_t x[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
    store_plane<2, 0>(kbase + 0 * BLOCK_BYTES + off, x, sm[0]);
    store_plane<2, 2>(kbase + 1 * BLOCK_BYTES + off, x, sm[1]);
    store_plane<2, 4>(kbase + 2 * BLOCK_BYTES + off, x, sm[2]);
    store_plane<2, 6>(kbase + 3 * BLOCK_BYTES + off, x, sm[3]);
    store_plane<2, 8>(kbase + 4 * BLOCK_BYTES + off, x, sm[4]);
    store_plane<2, 10>(kbase + 5 * BLOCK_BYTES + off, x, sm[5]);
    store_plane<2, 12>(kbase + 6 * BLOCK_BYTES + off, x, sm[6]);
    store_plane<2, 14>(kbase + 7 * BLOCK_BYTES + off, x, sm[7]);
  }
}

// The producer: thread p handles token p / 2 of each tile, half (p % 2) of its content channels (4 units) and
// of its RoPE channels. Codes and scales of tile i are loaded before the wait for its buffer; tokens outside
// [kstart, t_end) are stored as zeros, never loaded (their pages may hold anything).
template <int CBITS>
__device__ void produce(const Params& p, uint8_t* smem, uint64_t* full, uint64_t* empty, int b, int t_begin,
                        int t_end, int kstart, int ntiles) {
  constexpr int CTOK = CBITS == 4 ? 256 : 128;  // content code bytes a token
  constexpr int NLOAD = CTOK / 32;               // 16-byte loads of a thread's half: 8 (INT4) or 4 (INT2)
  const int tid = threadIdx.x - 256, j = tid >> 1, half = tid & 1;
  const int* bt = p.bt + static_cast<long long>(b) * p.maxp;
  for (int i = 0; i < ntiles; ++i) {
    const int s = i & 1;
    const int pos = t_begin + i * TILE + j;
    const bool valid = pos < t_end && pos >= kstart;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 w[NLOAD];
    uint4 sm0 = zero, sm1 = zero, rwv = zero;
    uint32_t rsm = 0;
#pragma unroll
    for (int k = 0; k < NLOAD; ++k) w[k] = zero;
    if (valid) {
      const long long page = bt[pos / p.page];
      const int slot = pos % p.page;
      const uint8_t* cw = p.cw + page * p.cw_ps + slot * CTOK + half * (CTOK / 2);
#pragma unroll
      for (int k = 0; k < NLOAD; ++k) w[k] = ld_v4(cw + 16 * k);
      const uint8_t* csm = p.csm + page * p.csm_ps + slot * 32;
      sm0 = ld_v4(csm);
      sm1 = ld_v4(csm + 16);
      rwv = ld_v4(p.rw + page * p.rw_ps + slot * 32 + half * 16);
      rsm = *reinterpret_cast<const uint32_t*>(p.rsm + page * p.rsm_ps + slot * 4);
    }
    if (i >= 2) mbar_wait(&empty[s], ((i >> 1) - 1) & 1);
    const uint32_t kbase = smem_addr(smem + OFF_K + s * TILE_BYTES);
    const uint32_t sm[8] = {sm0.x, sm0.y, sm0.z, sm0.w, sm1.x, sm1.y, sm1.z, sm1.w};
#pragma unroll
    for (int k = 0; k < 4; ++k)  // unit e8 = 4 half + k: channels 8 e8 .. 8 e8 + 7 of every plane
      store_content_unit<CBITS>(kbase, sw128_offset(j, 4 * half + k), &w[k * NLOAD / 4], sm);
    // RoPE: 4 planes of 16 channels; this half's 8 channels of plane k are chunk 2 k + half of block 8
    const uint32_t rx[4] = {rwv.x, rwv.y, rwv.z, rwv.w};
    const uint32_t rb = kbase + 8 * BLOCK_BYTES;
    store_plane<4, 0>(rb + sw128_offset(j, 0 + half), rx, rsm);
    store_plane<4, 4>(rb + sw128_offset(j, 2 + half), rx, rsm);
    store_plane<4, 8>(rb + sw128_offset(j, 4 + half), rx, rsm);
    store_plane<4, 12>(rb + sw128_offset(j, 6 + half), rx, rsm);
    async_proxy_fence();
    mbar_arrive(&full[s]);
  }
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// S = Q K^T for one tile (the scores of 64 rows x 64 tokens, wgmma accumulator layout)
__device__ __forceinline__ void scores(float (&sc)[32], uint32_t qbase, uint32_t kbase, const uint32_t (&rq)[4][4]) {
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < 8; ++kb) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint32_t o = kb * BLOCK_BYTES + ks * 32;
      wgmma_m64n64_ss(sc, sw128_desc(qbase + o, 16, 1024), sw128_desc(kbase + o, 16, 1024), kb | ks);
    }
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    wgmma_m64n64_rs(sc, rq[ks], sw128_desc(kbase + 8 * BLOCK_BYTES + ks * 32, 16, 1024), 1);
  wgmma_commit();
  wgmma_wait<0>();
}

// O += P V for one tile: V = channels [256 wg, 256 wg + 256) of the K tile, read N-major (4 blocks, LBO)
__device__ __forceinline__ void pv(float (&o)[128], const uint32_t (&pa)[4][4], uint32_t vbase) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma_m64n256_rs_mn(o, pa[ks], sw128_desc(vbase + ks * 16 * 128, BLOCK_BYTES, 1024), 1);
}

// a warpgroup's P (A fragments) to shared memory and back: word (ks * 4 + a) * 128 + t of a buffer is register
// pa[ks][a] of thread t, so the other warpgroup's thread t reads back its own fragment layout
__device__ __forceinline__ void put_p(uint32_t* buf, int t, const uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int a = 0; a < 4; ++a) buf[(ks * 4 + a) * 128 + t] = pa[ks][a];
}
__device__ __forceinline__ void get_p(const uint32_t* buf, int t, uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int a = 0; a < 4; ++a) pa[ks][a] = buf[(ks * 4 + a) * 128 + t];
}

// scale to the log2 domain and mask: column 8 j + 2 c + e of the tile is position pos0 + that; row i's limit
__device__ __forceinline__ void mask_scores(float (&sc)[32], int pos0, int c, int lo, int hi, const int (&lim)[2],
                                            float scale_log2) {
#pragma unroll
  for (int jj = 0; jj < 8; ++jj)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int pos = pos0 + 8 * jj + 2 * c + e;
        const bool ok = pos >= lo && pos < hi && pos < lim[r];
        float& x = sc[4 * jj + 2 * r + e];
        x = ok ? x * scale_log2 : neg_inf();
      }
}

// the output rows of this thread (accumulator layout: registers 4 j + {0, 1} row 0, 4 j + {2, 3} row 1) times f0, f1
__device__ __forceinline__ void scale_rows(float (&o)[128], float f0, float f1) {
#pragma unroll
  for (int jj = 0; jj < 32; ++jj) {
    o[4 * jj + 0] *= f0;
    o[4 * jj + 1] *= f0;
    o[4 * jj + 2] *= f1;
    o[4 * jj + 3] *= f1;
  }
}

__device__ __forceinline__ void row_max(const float (&sc)[32], float (&mx)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = neg_inf();
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) m = fmaxf(m, fmaxf(sc[4 * jj + 2 * r], sc[4 * jj + 2 * r + 1]));
    mx[r] = quad_max(m);
  }
}

// P = exp2(S - m) as wgmma A fragments (k step ks: columns 16 ks .. 16 ks + 15); returns the row sums
__device__ __forceinline__ void probabilities(const float (&sc)[32], const float (&m)[2], uint32_t (&pa)[4][4],
                                              float (&sum)[2]) {
  sum[0] = sum[1] = 0.f;
  float pr[32];
#pragma unroll
  for (int jj = 0; jj < 8; ++jj)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * jj + 2 * r + e;
        pr[i] = exp2f(sc[i] - m[r]);
        sum[r] += pr[i];
      }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int a = 0; a < 4; ++a) pa[ks][a] = pack_half2(pr[8 * ks + 2 * a], pr[8 * ks + 2 * a + 1]);
}

// One warpgroup's softmax step on its tile: the new running maximum m = max(prev, mx) (a row with nothing attended
// yet keeps -inf, and exponents of 0), the factor f = exp2(prev - m) that rescales what was relative to prev, and P
// relative to m with its row sums
__device__ __forceinline__ void softmax_step(const float (&sc)[32], const float (&prev)[2], const float (&mx)[2],
                                             uint32_t (&pa)[4][4], float (&sum)[2], float (&m)[2], float (&f)[2]) {
  float msafe[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = fmaxf(prev[r], mx[r]);
    msafe[r] = m[r] == neg_inf() ? 0.f : m[r];
    f[r] = exp2f(prev[r] - msafe[r]);
  }
  probabilities(sc, msafe, pa, sum);
}

template <int CBITS, bool HALF_OUT>
__global__ void __launch_bounds__(THREADS, 1) decode_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + OFF_BAR);
  uint64_t* empty = full + 2;
  int* plan = reinterpret_cast<int*>(smem + OFF_PLAN);
  const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  if (tid < 32) {
    const int per = p.plan ? plan_pages_per_split(p, gridDim.y, tid) : 0;
    if (tid == 0) {
      plan[0] = per;
      mbar_init(&full[0], 128);
      mbar_init(&full[1], 128);
      mbar_init(&empty[0], 256);
      mbar_init(&empty[1], 256);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
  }
  __syncthreads();
  // this split's pages (quantmla.kernels.splits.split_pages)
  const int total = p.npaged[b];
  const int n = paged_tokens(total, p.ws, p.wr);
  const int kstart = (p.ws + p.wr > 0) ? (total > p.ws + p.wr ? p.ws : 0) : p.kstart[b];
  const int npages = cdiv(n, p.page);
  const int per = p.plan ? plan[0] : cdiv(npages, p.ns);
  const int p0 = split * per, p1 = min(p0 + per, npages);
  if (split == 0 && hg == 0 && tid == 0) p.nused[b] = cdiv(npages, max(per, 1));
  const long long part = static_cast<long long>(b) * p.nsp + split;  // this split's partial slot
  const int row0 = hg * ROWS;
  if (p0 >= p1) {  // nothing to read: only the -inf log-sum-exp
    if (tid < ROWS && row0 + tid < p.R) p.lp[part * p.R + row0 + tid] = neg_inf();
    return;
  }
  const int t_begin = p0 * p.page, t_end = min(p1 * p.page, n);
  const int ntiles = 2 * cdiv(cdiv(t_end - t_begin, TILE), 2);  // whole pairs (a last empty tile is zeros)

  if (tid >= 256) {
    regs_dealloc<PRODUCER_REGS>();
    produce<CBITS>(p, smem, full, empty, b, t_begin, t_end, kstart, ntiles);
    return;
  }
  regs_alloc<CONSUMER_REGS>();
  const int wg = tid >> 7, t = tid & 127, warp = t >> 5, lane = t & 31, g = lane >> 2, c = lane & 3;
  const int rr[2] = {warp * 16 + g, warp * 16 + g + 8};  // this thread's two rows of the 64
  float* sm0 = reinterpret_cast<float*>(smem + OFF_ROW);  // m0 (WG0 -> WG1)
  float* ssa = sm0 + ROWS;                                // scale_a
  float* sm1 = ssa + ROWS;                                // m1 (WG1 -> WG0)
  float* ssb = sm1 + ROWS;                                // scale_b
  float* sl = ssb + ROWS;                                 // row sums, 2 x 64
  uint32_t* sp = reinterpret_cast<uint32_t*>(smem + OFF_P);  // P0, P1 as each thread's fragment registers

  // Q: content channels into shared memory (fp16, swizzled), RoPE channels into registers (A fragments)
  const uint32_t qbase = smem_addr(smem);
  for (int u = tid; u < ROWS * 64; u += 256) {
    const int row = u >> 6, ch = u & 63, gr = row0 + row;
    uint32_t v[4] = {0, 0, 0, 0};
    if (gr < p.R) {
      const int ti = gr / p.H, h = gr % p.H;
      const uint32_t* src = reinterpret_cast<const uint32_t*>(p.q + b * p.sqb + ti * p.sqt + h * p.sqh + ch * 8);
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = bf16x2_to_half2(src[k]);
    }
    st_shared_v4(qbase + (ch >> 3) * BLOCK_BYTES + sw128_offset(row, ch & 7), v[0], v[1], v[2], v[3]);
  }
  uint32_t rq[4][4];
  int lim[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int gr = row0 + rr[r];
    lim[r] = n;
    const uint32_t* src = nullptr;
    if (gr < p.R) {
      const int ti = gr / p.H, h = gr % p.H;
      lim[r] = paged_tokens(total - (p.QT - 1 - ti), p.ws, p.wr);
      src = reinterpret_cast<const uint32_t*>(p.qr + b * p.srb + ti * p.srt + h * p.srh);
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {  // a0/a2: row rr[0], columns 16 ks + 2 c (+8); a1/a3: row rr[1]
      rq[ks][r] = src ? bf16x2_to_half2(src[(16 * ks + 2 * c) / 2]) : 0u;
      rq[ks][r + 2] = src ? bf16x2_to_half2(src[(16 * ks + 2 * c + 8) / 2]) : 0u;
    }
  }
  async_proxy_fence();
  named_sync(BAR_Q, 256);

  const uint32_t kb0 = smem_addr(smem + OFF_K), kb1 = kb0 + TILE_BYTES;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {neg_inf(), neg_inf()}, lsum[2] = {0.f, 0.f};
  const int npairs = ntiles / 2;
  for (int pr = 0; pr < npairs; ++pr) {
    float sc[32];
    mbar_wait(&full[wg], pr & 1);
    scores(sc, qbase, wg ? kb1 : kb0, rq);
    mask_scores(sc, t_begin + (2 * pr + wg) * TILE, c, kstart, t_end, lim, p.scale_log2);
    float mx[2];
    row_max(sc, mx);
    uint32_t pa[4][4], pb[4][4];
    float sum[2];
    if (wg == 0) {
      float m0[2], sa[2];
      softmax_step(sc, m_run, mx, pa, sum, m0, sa);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        lsum[r] = lsum[r] * sa[r] + sum[r];
        if (c == 0) {
          sm0[rr[r]] = m0[r];
          ssa[rr[r]] = sa[r];
        }
      }
      scale_rows(o, sa[0], sa[1]);
      put_p(sp, t, pa);
      named_arrive(BAR_P0, 256);
      wgmma_fence();
      pv(o, pa, kb0);
      wgmma_commit();
      named_sync(BAR_P1, 256);  // WG1's maximum, its rescale factor and P1
      float sb[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m_run[r] = sm1[rr[r]];
        sb[r] = ssb[rr[r]];
      }
      get_p(sp + P_WORDS, t, pb);
      wgmma_wait<0>();
      mbar_arrive(&empty[0]);
      scale_rows(o, sb[0], sb[1]);
      lsum[0] *= sb[0];
      lsum[1] *= sb[1];
      wgmma_fence();
      pv(o, pb, kb1);
      wgmma_commit();
      wgmma_wait<0>();
      mbar_arrive(&empty[1]);
    } else {
      named_sync(BAR_P0, 256);  // WG0's maximum, its rescale factor and P0
      float m0[2], sa[2], m1[2], sb[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m0[r] = sm0[rr[r]];
        sa[r] = ssa[rr[r]];
      }
      get_p(sp, t, pa);
      softmax_step(sc, m0, mx, pb, sum, m1, sb);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        lsum[r] = lsum[r] * sa[r] * sb[r] + sum[r];
        if (c == 0) {
          sm1[rr[r]] = m1[r];
          ssb[rr[r]] = sb[r];
        }
      }
      put_p(sp + P_WORDS, t, pb);
      named_arrive(BAR_P1, 256);
      m_run[0] = m1[0];
      m_run[1] = m1[1];
      const float f0 = sa[0] * sb[0], f1 = sa[1] * sb[1];
      scale_rows(o, f0, f1);
      // P0 relative to m1: times scale_b (a0/a2 are row rr[0], a1/a3 row rr[1])
      const uint32_t s0 = pack_half2(sb[0], sb[0]), s1 = pack_half2(sb[1], sb[1]);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        pa[ks][0] = hmul2(pa[ks][0], s0);
        pa[ks][2] = hmul2(pa[ks][2], s0);
        pa[ks][1] = hmul2(pa[ks][1], s1);
        pa[ks][3] = hmul2(pa[ks][3], s1);
      }
      wgmma_fence();
      pv(o, pa, kb0 + 4 * BLOCK_BYTES);
      wgmma_commit();
      pv(o, pb, kb1 + 4 * BLOCK_BYTES);
      wgmma_commit();
      wgmma_wait<1>();
      mbar_arrive(&empty[0]);
      wgmma_wait<0>();
      mbar_arrive(&empty[1]);
    }
  }

  // epilogue: both warpgroups' row sums, then each writes its half of the normalised output
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lsum[r] = quad_sum(lsum[r]);
    if (c == 0) sl[wg * ROWS + rr[r]] = lsum[r];
  }
  named_sync(BAR_L, 256);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int gr = row0 + rr[r];
    const float l = sl[rr[r]] + sl[ROWS + rr[r]];
    const bool has = l > 0.f;
    const float inv = has ? 1.f / l : 1.f;
    if (gr < p.R) {
      if (wg == 0 && c == 0)
        p.lp[part * p.R + gr] = has ? (m_run[r] + log2f(l)) * 0.6931471805599453f : neg_inf();
      const long long base = (part * p.R + gr) * DC + 256 * wg + 2 * c;
#pragma unroll
      for (int jj = 0; jj < 32; ++jj) {
        const float x0 = o[4 * jj + 2 * r] * inv, x1 = o[4 * jj + 2 * r + 1] * inv;
        if constexpr (HALF_OUT) {
          reinterpret_cast<uint32_t*>(p.op)[(base + 8 * jj) / 2] = pack_half2(x0, x1);
        } else {
          reinterpret_cast<float2*>(p.op)[(base + 8 * jj) / 2] = make_float2(x0, x1);
        }
      }
    }
  }
}

template <int CBITS, bool HALF_OUT>
int launch(const Params& p, cudaStream_t stream) {
  auto k = decode_kernel<CBITS, HALF_OUT>;
  static bool configured = false;  // one attribute call a kernel instance and process
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (e != cudaSuccess) return static_cast<int>(e);
    configured = true;
  }
  const dim3 grid(p.ns, (p.R + ROWS - 1) / ROWS, p.B);
  k<<<grid, THREADS, SMEM_BYTES, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace quantmla_sm90

extern "C" int quantmla_sm90_decode(const quantmla_sm90::Params* p, int cbits, int half_out, void* stream) {
  using namespace quantmla_sm90;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (cbits == 4) return half_out ? launch<4, true>(*p, st) : launch<4, false>(*p, st);
  if (cbits == 2) return half_out ? launch<2, true>(*p, st) : launch<2, false>(*p, st);
  return -1;
}

extern "C" int quantmla_sm90_smem_bytes() { return quantmla_sm90::SMEM_BYTES; }
