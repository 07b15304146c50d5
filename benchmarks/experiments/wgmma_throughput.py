"""Hopper tensor-core throughput of the shapes a 64-128-head MLA decode kernel issues: ``wgmma`` m64n64k16 with both
operands in shared memory (SS, the scores ``Q K^T`` of a 64-token tile) or A from registers (RS, ``P V`` with P in
registers), and m64n256k16 SS as the reference of the peak; one or two warpgroups a CTA, one CTA an SM, chains of
``chain`` k16 steps into one accumulator between commits (576 / 16 = 36 for a score tile). Operand contents are
garbage (timing only). The first measurement of the issue's plan ("RS/SS wgmma throughput at m64n64").

    PYTHONPATH=src python benchmarks/experiments/wgmma_throughput.py      # sm_90a, nvcc on PATH

Prints TFLOP/s per variant with the SM clock sampled meanwhile.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

CUDA = r"""
#include <cstdint>
#include <torch/extension.h>

__device__ __forceinline__ uint64_t desc128(uint32_t addr) {  // K-major, 128-byte swizzle, 8-row groups 1024 B apart
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

#define D32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

__device__ __forceinline__ void ss64(float* d, uint64_t a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " R32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
               : D32 : "l"(a), "l"(b), "r"(1));
}
__device__ __forceinline__ void rs64(float* d, const uint32_t* a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " R32
               ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
               : D32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <int MODE, int CHAIN>  // MODE 0: SS n64, 1: RS n64, 2: SS n256 (four n64 accumulators through one n256)
__global__ void __launch_bounds__(256, 1) bench(float* out, int iters) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  base = (base + 1023) & ~1023u;
  const int wg = threadIdx.x / 128;
  uint64_t da = desc128(base + wg * 8192), db = desc128(base + 16384);
  float d[MODE == 2 ? 128 : 32];
#pragma unroll
  for (int i = 0; i < (MODE == 2 ? 128 : 32); ++i) d[i] = 0.f;
  uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x * 5u, threadIdx.x * 7u};
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < CHAIN; ++k) {
      const uint64_t step = (uint64_t)((k % 4) * 2);  // 32 bytes along K inside the 128-byte swizzled row
      if constexpr (MODE == 0) ss64(d, da + step, db + step);
      else if constexpr (MODE == 1) rs64(d, a, db + step);
      else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
          "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
          "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, "
          "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, "
          "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, "
          "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "
          "%123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
            "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
            "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
            "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
            "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
            "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
            "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
            "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
            "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
            "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
            "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
            "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]),
            "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
            "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),
            "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]),
            "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
          : "l"(da + step), "l"(db + step), "r"(1));
      }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < (MODE == 2 ? 128 : 32); ++i) s += d[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int MODE, int CHAIN>
void launch(torch::Tensor out, int64_t iters, int64_t warpgroups) {
  auto k = bench<MODE, CHAIN>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024);
  k<<<out.size(0), 128 * warpgroups, 64 * 1024>>>(out.data_ptr<float>(), (int)iters);
}

void run(torch::Tensor out, int64_t mode, int64_t chain, int64_t iters, int64_t warpgroups) {
  if (mode == 0 && chain == 4) launch<0, 4>(out, iters, warpgroups);
  else if (mode == 0 && chain == 36) launch<0, 36>(out, iters, warpgroups);
  else if (mode == 1 && chain == 4) launch<1, 4>(out, iters, warpgroups);
  else if (mode == 1 && chain == 36) launch<1, 36>(out, iters, warpgroups);
  else if (mode == 2 && chain == 4) launch<2, 4>(out, iters, warpgroups);
  else TORCH_CHECK(false, "mode/chain not built: ", mode, "/", chain);
}
"""
CPP = "void run(torch::Tensor out, int64_t mode, int64_t chain, int64_t iters, int64_t warpgroups);"


def main() -> None:
    from torch.utils.cpp_extension import load_inline

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flashmla_baseline import SmClock

    mod = load_inline("qm_wgmma_bench", CPP, cuda_sources=CUDA, functions=["run"], verbose=False,
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])  # fmt: skip
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs")
    for mode, name, n in ((0, "SS m64n64k16", 64), (1, "RS m64n64k16", 64), (2, "SS m64n256k16", 256)):
        for chain in (4, 36) if mode < 2 else (4,):
            for wgs in (1, 2):
                out = torch.empty(sms * 128 * wgs, device="cuda")
                iters = 20000 // chain * 4
                mod.run(out, mode, chain, 100, wgs)
                torch.cuda.synchronize()
                clk = SmClock()
                clk.start()
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                mod.run(out, mode, chain, iters, wgs)
                t1.record()
                torch.cuda.synchronize()
                ms = t0.elapsed_time(t1)
                mhz = clk.stop()
                flop = 2 * 64 * n * 16 * chain * iters * wgs * sms
                print(f"{name} chain {chain:2d}, {wgs} warpgroup(s) a CTA: {flop / ms / 1e9:7.1f} TFLOP/s  "
                      f"({ms:.2f} ms, SM {mhz} MHz)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
