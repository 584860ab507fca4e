/* Which problems take the AMX attention path (attention_amx.h). */
#include "attention_amx.h"

#include "../common/cpu_features.h"

#if defined(TF_ATTN_AMX_EMULATE)
int tf_attn_amx_emulated = 0;
#endif

int tf_attn_amx_applies(const tf_attn_problem *p, const tf_attn_operand *q) {
  if (q->elem != TF_ATTN_BF16 && q->elem != TF_ATTN_E4M3) return 0;
  if (p->dropout_p > 0.0f || p->head_dim > TF_ATTN_AMX_MAX_DIM) return 0;
#if defined(TF_ATTN_AMX_EMULATE)
  return tf_attn_amx_emulated;
#elif TF_ATTN_AMX_BUILT
  return tf_cpu_isa() >= TF_ISA_AMX;
#else
  return 0;
#endif
}

int tf_attn_amx_bwd_applies(const tf_attn_problem *p, const tf_attn_operand *q,
                            const tf_attn_operand *dout) {
  return dout->elem == TF_ATTN_BF16 && tf_attn_amx_applies(p, q);
}
