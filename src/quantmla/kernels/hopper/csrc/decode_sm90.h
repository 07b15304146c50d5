// The launch parameters of quantmla's sm_90a decode kernel (decode_sm90.cu), shared with its torch binding.
#pragma once
#include <cstdint>

namespace quantmla_sm90 {

struct Params {
  const uint16_t* q;   // q_lat (bf16 bits), [B, S, H, 512] with strides
  const uint16_t* qr;  // q_pe (bf16 bits), [B, S, H, 64]
  long long sqb, sqt, sqh, srb, srt, srh;  // element strides
  const uint8_t* cw;   // content code words of page 0 (field view base)
  const uint8_t* csm;  // content scale|minimum words
  const uint8_t* rw;   // RoPE code words
  const uint8_t* rsm;  // RoPE scale|minimum words
  long long cw_ps, csm_ps, rw_ps, rsm_ps;  // page strides in bytes
  const int* bt;       // block table [B, maxp]
  const int* npaged;   // tokens a sequence (its whole length with windows)
  const int* kstart;   // left padding: paged tokens before this are masked (no windows)
  void* op;            // partial outputs [B, nsp, R, 512] (fp32 or fp16)
  float* lp;           // partial log-sum-exps [B, nsp, R]
  int* nused;          // page splits with tokens, a sequence
  int B, H, QT, R, maxp, ns, nsp, page, ws, wr, plan, sms, maxs;
  float scale_log2;
};

}  // namespace quantmla_sm90

extern "C" int quantmla_sm90_decode(const quantmla_sm90::Params* p, int cbits, int half_out, void* stream);
extern "C" int quantmla_sm90_smem_bytes();
