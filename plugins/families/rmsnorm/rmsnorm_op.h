// The RMSNorm family's ORT glue: op types Rmsnorm_f32 / Rmsnorm_f16 / Rmsnorm_bf16.
//
// RMSNorm is LayerNorm without the mean: y = (a [+ b]) / sqrt(mean((a [+ b])^2) + eps) [* gamma]. Its op is
// LayerNorm's without CENTER (layernorm/layernorm_op.h): the same attributes (epsilon, axis, hidden, residual,
// affine; form, which the op does not read), checks and CPU kernel (layernorm/layernorm_ref.h), and on the device
// the node's instance of LayerNorm's kernel built without the mean (layernorm/layernorm.cuh, CENTER false). Its roles
// are LayerNorm's first three: a, b, gamma; out y, sum.
#pragma once

#include "layernorm/layernorm_op.h"

namespace gtco {

struct RmsNorm : NormGlue<false> {};

}  // namespace gtco
