// paddle_hybrid: `ph_unbacked`, a tensor of a shape whose holder says it has the bytes and owns none.
//
// What it is for: the dry run's probe counts what is saved for backward through Paddle's
// saved-tensor hooks.  On a rank outside the mesh of a semi-auto op (a pipeline's other stages)
// the op saves DistTensors whose local value has a 0-byte holder, and Paddle 3.2-3.3's
// `TensorWrapper::recover` puts the unpacked holder into a tensor of the saved shape after
// checking that the holder is large enough: every backward of such a rank fails once any hook is
// registered.  The probe unpacks those as this op's output instead.  No kernel reads it there
// (that rank runs none for the op), and it allocates nothing, so the allocator's figures stay
// what they are without the probe.  Reading its data is an error of the caller (the pointer is
// null).

#include <vector>

#include "paddle/extension.h"
#include "paddle/phi/core/allocator.h"
#include "paddle/phi/core/dense_tensor.h"

std::vector<paddle::Tensor> PhUnbackedKernel(const paddle::Tensor& like, const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    PD_CHECK(d >= 0, "ph_unbacked: a negative dimension in the shape.");
    numel *= d;
  }
  const auto bytes = static_cast<size_t>(numel) * phi::SizeOf(like.dtype());
  auto holder = std::make_shared<phi::Allocation>(nullptr, bytes, phi::CPUPlace());
  phi::DenseTensorMeta meta(like.dtype(), common::make_ddim(shape));
  return {paddle::Tensor(std::make_shared<phi::DenseTensor>(holder, meta))};
}

std::vector<std::vector<int64_t>> PhUnbackedInferShape(const std::vector<int64_t>& like_shape,
                                                       const std::vector<int64_t>& shape) {
  return {shape};
}

std::vector<paddle::DataType> PhUnbackedInferDtype(const paddle::DataType& like_dtype) { return {like_dtype}; }

PD_BUILD_OP(ph_unbacked)
    .Inputs({"Like"})
    .Outputs({"Out"})
    .Attrs({"shape: std::vector<int64_t>"})
    .SetKernelFn(PD_KERNEL(PhUnbackedKernel))
    .SetInferShapeFn(PD_INFER_SHAPE(PhUnbackedInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PhUnbackedInferDtype));
