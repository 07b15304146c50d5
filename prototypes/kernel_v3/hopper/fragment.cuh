// The fragment-ordered pack layout's register operands (prototypes/kernel_v3/fragment.py), shared by the Hopper
// kernels: a 16 x 16 tile of codes is 32 words in lane order, code (r, e) of tile j at bit 16 e + bits (4 j + r).
#pragma once
#include <cstdint>
#include <cuda_fp16.h>

namespace quantmla {

// two fp16 (or bf16) values magic + code from the code pair at `shift`: one shift and one lop3, (a & b) | c
__device__ __forceinline__ uint32_t magic_pair(uint32_t w, int shift, uint32_t mask, uint32_t magic) {
  uint32_t r;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(w >> shift), "r"(mask), "r"(magic));
  return r;
}

// the word whose code pairs the output product's (transposed) operand reads, for lane (g, t) of the tile at
// `wp`: tokens 2t, 2t+8 from lane (2t, g/2), 2t+1, 2t+9 from lane (2t+1, g/2), half g % 2 of each
__device__ __forceinline__ uint32_t output_word(const uint32_t* wp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  return __byte_perm(wp[4 * (2 * t) + g / 2], wp[4 * (2 * t + 1) + g / 2], (g & 1) ? 0x7632 : 0x5410);
}

// the A operand's four registers of tile j of word c; the output operand reads positions (0, 2, 1, 3)
template <int BITS, bool OUTPUT>
__device__ __forceinline__ void operand(uint32_t (&a)[4], uint32_t c, int j, uint32_t magic) {
  constexpr uint32_t MASK = ((1u << BITS) - 1) * 0x00010001u;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int pos = OUTPUT ? ((r == 1) ? 2 : (r == 2) ? 1 : r) : r;
    a[r] = magic_pair(c, BITS * (4 * j + pos), MASK, magic);
  }
}

// INT4 only, one shift instead of four: the high code of each byte is read in place by the mask 0x00F000F0,
// which gives 1024 + 16 u (exact in fp16). The registers holding 16 u are those of rows g + 8 of the scores
// operand (r = 1, 3) and columns 2t + 8 of the output operand (r = 2, 3): in both products, tokens 8-15 of each
// 16-token tile. A kernel using it divides those tokens' scales by 16 in both products (exact: a power of 2).
template <bool OUTPUT>
__device__ __forceinline__ void operand4_x16(uint32_t (&a)[4], uint32_t c, uint32_t magic) {
  const uint32_t lo = magic_pair(c, 0, 0x000F000Fu, magic), lo16 = magic_pair(c, 0, 0x00F000F0u, magic);
  const uint32_t hi = magic_pair(c, 8, 0x000F000Fu, magic), hi16 = magic_pair(c, 8, 0x00F000F0u, magic);
  a[0] = lo;  // positions 0 and 1 (bits 0-3, 4-7); 2 and 3 (bits 8-11, 12-15)
  a[OUTPUT ? 2 : 1] = lo16;
  a[OUTPUT ? 1 : 2] = hi;
  a[3] = hi16;
}

// a register of two fp16 1024 + u (the magic pair) dequantised: x = u s + m, the magic off exactly (HSUB2), then
// one rounding (HFMA2), the Triton kernels' precision
__device__ __forceinline__ uint32_t dequant_pair(uint32_t u, __half2 s, __half2 m) {
  const __half2 code = __hsub2(*reinterpret_cast<const __half2*>(&u), __half2half2(__ushort_as_half(0x6400)));
  const __half2 x = __hfma2(code, s, m);
  return *reinterpret_cast<const uint32_t*>(&x);
}

}  // namespace quantmla
