// paddle_hybrid: `ph_nop`, an in-place op that does nothing.
//
// Registered as `ph_nop` (not `nop`): a custom op that shares a built-in op's
// name replaces the built-in for the whole process, and Paddle's own passes
// rely on the built-in `nop`.
//
// Its only purpose is structural: it reads its inputs and writes them back in
// place, so in a static program it keeps the variables alive up to its position
// and adds a dependency edge.  The kernel is place- and dtype-independent, so the
// same function serves CPU and GPU tensors.

#include <vector>

#include "paddle/extension.h"

void PhNopKernel(std::vector<paddle::Tensor>& x) {  // NOLINT
  for (const auto& t : x) {
    PD_CHECK(t.is_dense_tensor(),
             "ph_nop: every input must be a dense tensor (got a non-dense "
             "tensor); convert sparse/selected-rows inputs to dense first.");
  }
}

// Every output is in place, so there is nothing left to infer: Paddle expects
// the infer functions to describe only the outputs outside the inplace map.
std::vector<std::vector<int64_t>> PhNopInferShape(
    const std::vector<std::vector<int64_t>>& x_shapes) {
  return {};
}

std::vector<paddle::DataType> PhNopInferDtype(
    const std::vector<paddle::DataType>& x_dtypes) {
  return {};
}

PD_BUILD_OP(ph_nop)
    .Inputs({paddle::Vec("X")})
    .Outputs({paddle::Vec("Out")})
    .SetInplaceMap({{paddle::Vec("X"), paddle::Vec("Out")}})
    .SetKernelFn(PD_KERNEL(PhNopKernel))
    .SetInferShapeFn(PD_INFER_SHAPE(PhNopInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PhNopInferDtype));
