// The sm_90a primitives of the Hopper decode kernel: shared-memory matrix descriptors (128-byte swizzle),
// mbarriers, named barriers, register reallocation, fences, and the group-planar code unpack into fp16.
#pragma once
#include <cstdint>

#include "wgmma_ops.cuh"

namespace quantmla_sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Descriptor of an operand in 128-byte-swizzled 8-row atoms (1024 B, 1024-aligned): `lbo` is the byte
// stride between 64-element blocks along M/N of an N-major operand (unused K-major), `sbo` between 8-row
// groups. Layout type 1 (bits 62-63) is the 128-byte swizzle.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) |
         (uint64_t(1) << 62);
}

// byte offset of (row, 16-byte chunk) in a 128-byte-swizzled tile of 128-byte rows
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// generic-proxy shared-memory writes made visible to the tensor cores (async proxy)
__device__ __forceinline__ void async_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar))
               : "memory");
}
// wait until the phase of parity `parity` of `bar` has completed; after 2^28 unsuccessful tries (seconds: each
// try waits a while in hardware) it traps, a launch error instead of a hang
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n.reg .u32 n;\nmov.u32 n, 0;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@done bra DONE_%=;\n"
      "add.u32 n, n, 1;\n"
      "setp.gt.u32 done, n, 268435456;\n"
      "@done trap;\n"
      "bra WAIT_%=;\n"
      "DONE_%=:\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// named barriers between the two consumer warpgroups (ids 1..; 0 is __syncthreads)
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int N>
__device__ __forceinline__ void regs_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void regs_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// 16 bytes of read-only global memory (the cache pages; the kernel never writes them)
__device__ __forceinline__ uint4 ld_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Code at bit POS of each 16-bit half of `x` (BITS wide) -> fp16x2 of `code * s + m`, with the fp16 scale `s`
// (low half of `sm`) and minimum `m` (high half): lop3 puts the code into an fp16 mantissa under the exponent
// of 2^(10 - bit), giving 2^(10 - bit) + code exactly; sub.f16x2 removes the magic (exact); fma rounds once.
// The same three instructions as quantmla.kernels.unpack's PTX.
template <int BITS, int POS>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t x, uint32_t sm) {
  constexpr int SHIFT = (POS + BITS > 10) ? 8 : 0;
  constexpr int BIT = POS - SHIFT;
  constexpr uint32_t MASK1 = ((1u << BITS) - 1u) << BIT;
  constexpr uint32_t MASK = MASK1 | (MASK1 << 16);
  constexpr uint32_t MAGIC1 = static_cast<uint32_t>(25 - BIT) << 10;
  constexpr uint32_t MAGIC = MAGIC1 | (MAGIC1 << 16);
  const uint32_t v = SHIFT ? (x >> SHIFT) : x;
  uint32_t r;
  asm("{\n.reg .b32 t, c, s, m;\n.reg .b16 sl, mh;\n"
      "lop3.b32 t, %1, %3, %4, 0xea;\n"
      "mov.b32 c, %4;\n"
      "sub.f16x2 t, t, c;\n"
      "mov.b32 {sl, mh}, %2;\nmov.b32 s, {sl, sl};\nmov.b32 m, {mh, mh};\n"
      "fma.rn.f16x2 %0, t, s, m;\n}\n"
      : "=r"(r)
      : "r"(v), "r"(sm), "n"(MASK), "n"(MAGIC));
  return r;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t bf16x2_to_half2(uint32_t x) {
  const float lo = __uint_as_float(x << 16), hi = __uint_as_float(x & 0xFFFF0000u);
  return pack_half2(lo, hi);
}

__device__ __forceinline__ uint32_t hmul2(uint32_t x, uint32_t s) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(x), "r"(s));
  return r;
}

}  // namespace quantmla_sm90
