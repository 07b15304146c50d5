// The decode kernel v3's register operands (issue 19), probed on the tensor cores: one warp per 16 x 16 tile
// takes its lane's word(s) of the fragment-ordered pack (prototypes/kernel_v3/fragment.py), builds the A operand
// with the kernel's instructions (shift + lop3 with the magic pattern; for the output product's transposed
// operand two words and one prmt first) and multiplies it by a 16 x 16 B on mma.sync.m16n8k16. The same A
// register layout is each warp's slice of wgmma.m64nNk16 with A in registers, so this checks the layout and the
// conversion the v3 kernel builds on. Pure CUDA (no torch headers): `nvcc -gencode arch=compute_90a,code=sm_90a
// -cubin` compiles it alone.
#include <cstdint>

#include "fragment.cuh"

namespace quantmla {

template <int BITS, bool OUTPUT, bool BF16>
__global__ void fragment_probe_kernel(const uint32_t* __restrict__ words, const uint16_t* __restrict__ b,
                                      float* __restrict__ d) {
  constexpr int K = 4 / BITS;  // tiles per word
  constexpr uint32_t MAGIC = BF16 ? 0x43004300u : 0x64006400u;
  const int tile = blockIdx.x, lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const uint32_t* wp = words + (tile / K) * 32;
  uint32_t a[4];
  operand<BITS, OUTPUT>(a, OUTPUT ? output_word(wp, lane) : wp[lane], tile % K, MAGIC);
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {  // B [16 x 16] (K x N) row-major raw 16-bit patterns; fragment "col"
    const int n = nb * 8 + g;
    const uint32_t b0 = uint32_t(b[(2 * t) * 16 + n]) | (uint32_t(b[(2 * t + 1) * 16 + n]) << 16);
    const uint32_t b1 = uint32_t(b[(2 * t + 8) * 16 + n]) | (uint32_t(b[(2 * t + 9) * 16 + n]) << 16);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (BF16) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    float* out = d + tile * 256;  // D fragment: c0,c1 -> (g, 2t + i), c2,c3 -> (g + 8, 2t + i)
    out[g * 16 + nb * 8 + 2 * t] = acc[0];
    out[g * 16 + nb * 8 + 2 * t + 1] = acc[1];
    out[(g + 8) * 16 + nb * 8 + 2 * t] = acc[2];
    out[(g + 8) * 16 + nb * 8 + 2 * t + 1] = acc[3];
  }
}

}  // namespace quantmla

// C entry: `tiles` 16 x 16 tiles from `words` ([tiles * bits / 4][32]); b [16][16] raw fp16/bf16 bits; d [tiles][16][16]
extern "C" int quantmla_fragment_probe(const uint32_t* words, const uint16_t* b, float* d, int tiles, int bits,
                                       int output, int bf16, void* stream) {
  const dim3 grid(tiles), block(32);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#define QUANTMLA_PROBE(BITS, OUT, BF)                                                              \
  if (bits == BITS && output == OUT && bf16 == BF) {                                               \
    quantmla::fragment_probe_kernel<BITS, OUT, BF><<<grid, block, 0, s>>>(words, b, d);            \
    return static_cast<int>(cudaGetLastError());                                                   \
  }
  QUANTMLA_PROBE(4, false, false) QUANTMLA_PROBE(4, true, false) QUANTMLA_PROBE(4, false, true)
  QUANTMLA_PROBE(4, true, true) QUANTMLA_PROBE(2, false, false) QUANTMLA_PROBE(2, true, false)
  QUANTMLA_PROBE(2, false, true) QUANTMLA_PROBE(2, true, true)
#undef QUANTMLA_PROBE
  return -1;
}
