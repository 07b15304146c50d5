// torch binding of quantmla's sm_90a decode kernel (decode_sm90.cu); checks every tensor before the launch.
#include <torch/extension.h>

#include "decode_sm90.h"

namespace {

void check(const torch::Tensor& t, const char* name, torch::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_field(const torch::Tensor& t, const char* name, int64_t token_bytes) {
  check(t, name, torch::kUInt8);
  TORCH_CHECK(t.dim() == 3 && t.size(2) == token_bytes && t.stride(2) == 1 && t.stride(1) == token_bytes,
              name, " must be a field view [pages, page_size, ", token_bytes, "] with tokens back to back");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 16 == 0, name,
              " must start 16-byte aligned with a page stride of a multiple of 16 bytes");
}

}  // namespace

// Page splits of quantmla.kernels.decode.mla_decode for >= 64 query rows a sequence: writes op / lp of splits
// 0..ns-1 and nused. `stream`: the caller's current CUDA stream (torch.cuda.current_stream().cuda_stream).
void decode(torch::Tensor q_lat, torch::Tensor q_pe, torch::Tensor cw, torch::Tensor csm, torch::Tensor rw,
            torch::Tensor rsm, torch::Tensor block_table, torch::Tensor npaged, torch::Tensor kstart, torch::Tensor op,
            torch::Tensor lp, torch::Tensor nused, int64_t ns, int64_t ws, int64_t wr, bool plan, int64_t sms,
            int64_t maxs, double scale_log2, int64_t cbits, int64_t stream) {
  TORCH_CHECK(cbits == 4 || cbits == 2, "content bits must be 4 or 2, got ", cbits);
  check(q_lat, "q_lat", torch::kBFloat16);
  check(q_pe, "q_pe", torch::kBFloat16);
  TORCH_CHECK(q_lat.dim() == 4 && q_pe.dim() == 4 && q_lat.size(3) == 512 && q_pe.size(3) == 64,
              "queries must be [B, S, H, 512] and [B, S, H, 64]");
  TORCH_CHECK(q_lat.stride(3) == 1 && q_pe.stride(3) == 1, "query channels must be contiguous");
  for (int d = 0; d < 3; ++d)
    TORCH_CHECK(q_lat.stride(d) % 8 == 0 && q_pe.stride(d) % 2 == 0,
                "query strides must keep rows 16-byte (q_lat) and 4-byte (q_pe) aligned");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q_lat.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(q_pe.data_ptr()) % 4 == 0,
              "queries must start aligned (16 bytes, 4 bytes)");
  check_field(cw, "content codes", cbits == 4 ? 256 : 128);
  check_field(csm, "content scales", 32);
  check_field(rw, "RoPE codes", 32);
  check_field(rsm, "RoPE scales", 4);
  check(block_table, "block_table", torch::kInt32);
  check(npaged, "n_paged", torch::kInt32);
  check(kstart, "paged_start", torch::kInt32);
  check(nused, "used", torch::kInt32);
  check(lp, "lp", torch::kFloat32);
  TORCH_CHECK(op.is_cuda() && (op.scalar_type() == torch::kFloat32 || op.scalar_type() == torch::kFloat16),
              "op must be float32 or float16 on the GPU");
  TORCH_CHECK(block_table.is_contiguous() && op.is_contiguous() && lp.is_contiguous(),
              "block_table, op and lp must be contiguous");
  const int64_t B = q_lat.size(0), S = q_lat.size(1), H = q_lat.size(2);
  TORCH_CHECK(op.dim() == 4 && op.size(0) == B && op.size(2) == S * H && op.size(3) == 512 && op.size(1) >= ns,
              "op must be [B, nsp >= ns, S * H, 512]");
  quantmla_sm90::Params p{};
  p.q = reinterpret_cast<const uint16_t*>(q_lat.data_ptr());
  p.qr = reinterpret_cast<const uint16_t*>(q_pe.data_ptr());
  p.sqb = q_lat.stride(0);
  p.sqt = q_lat.stride(1);
  p.sqh = q_lat.stride(2);
  p.srb = q_pe.stride(0);
  p.srt = q_pe.stride(1);
  p.srh = q_pe.stride(2);
  p.cw = cw.data_ptr<uint8_t>();
  p.csm = csm.data_ptr<uint8_t>();
  p.rw = rw.data_ptr<uint8_t>();
  p.rsm = rsm.data_ptr<uint8_t>();
  p.cw_ps = cw.stride(0);
  p.csm_ps = csm.stride(0);
  p.rw_ps = rw.stride(0);
  p.rsm_ps = rsm.stride(0);
  p.bt = block_table.data_ptr<int32_t>();
  p.npaged = npaged.data_ptr<int32_t>();
  p.kstart = kstart.data_ptr<int32_t>();
  p.op = op.data_ptr();
  p.lp = lp.data_ptr<float>();
  p.nused = nused.data_ptr<int32_t>();
  p.B = static_cast<int>(B);
  p.H = static_cast<int>(H);
  p.QT = static_cast<int>(S);
  p.R = static_cast<int>(S * H);
  p.maxp = static_cast<int>(block_table.size(1));
  p.ns = static_cast<int>(ns);
  p.nsp = static_cast<int>(op.size(1));
  p.page = static_cast<int>(cw.size(1));
  p.ws = static_cast<int>(ws);
  p.wr = static_cast<int>(wr);
  p.plan = plan ? 1 : 0;
  p.sms = static_cast<int>(sms);
  p.maxs = static_cast<int>(maxs);
  p.scale_log2 = static_cast<float>(scale_log2);
  const int rc = quantmla_sm90_decode(&p, static_cast<int>(cbits), op.scalar_type() == torch::kFloat16,
                                      reinterpret_cast<void*>(stream));
  TORCH_CHECK(rc == 0, "quantmla sm_90a decode launch failed (cudaError ", rc, ")");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "quantmla sm_90a low-bit MLA decode: the page splits of 64 query rows a CTA");
  m.def("smem_bytes", &quantmla_sm90_smem_bytes, "dynamic shared memory a CTA");
}
