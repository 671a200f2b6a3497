// paddle_hybrid: `ph_uncoalesce_tensor`, the inverse copy of
// `ph_coalesce_tensor`: writes each tensor's slice of a fused buffer back into
// the tensor, in place.
//
// Where `ph_coalesce_tensor`'s outputs alias the fused buffer (dygraph, legacy
// static) they already hold the values and the copy is skipped (same
// address).  Where they cannot alias (PIR: a custom op's outputs never alias
// another buffer) this one op replaces a `split` + N `reshape2` copy-back, so
// readers of the tensors get a data dependency on the fused buffer.
//
// Offsets are those of `ph_coalesce_tensor` with the same `use_align` /
// `align_size` and the fused buffer's dtype.

#include <cstring>
#include <memory>
#include <vector>

#include "coalesce_tensor.h"
#include "layout.h"
#include "paddle/extension.h"
#include "paddle/phi/backends/device_memory_alignment.h"
#include "paddle/phi/common/data_type.h"
#include "paddle/phi/core/dense_tensor.h"

void PhUncoalesceTensorKernel(std::vector<paddle::Tensor>& xs,  // NOLINT: in place as Out
                              const paddle::Tensor& fused, bool use_align, int align_size) {
  PD_CHECK(!xs.empty(), "ph_uncoalesce_tensor: got no tensors to write; pass at least one.");
  PD_CHECK(fused.initialized(), "ph_uncoalesce_tensor: the fused buffer is not initialised.");
  auto fused_dense = std::dynamic_pointer_cast<phi::DenseTensor>(fused.impl());
  PD_CHECK(fused_dense != nullptr, "ph_uncoalesce_tensor: the fused buffer is not a dense tensor.");
  const paddle::DataType dtype = fused.dtype();
  const size_t elem = phi::SizeOf(dtype);
  PD_CHECK(align_size == -1 || (align_size > 0 && align_size % elem == 0),
           "ph_uncoalesce_tensor: align_size=", align_size,
           " is not a positive multiple of the element size (", elem,
           " bytes); use -1 for the device default or a multiple of ", elem, ".");
  const phi::Place place = fused.place();
  const char* base = static_cast<const char*>(fused_dense->data());
  const size_t total = static_cast<size_t>(fused.numel());
  size_t offset = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto dense = std::dynamic_pointer_cast<phi::DenseTensor>(xs[i].impl());
    PD_CHECK(dense != nullptr, "ph_uncoalesce_tensor: tensor ", i, " is not a dense tensor.");
    const size_t len = static_cast<size_t>(dense->numel());
    if (len == 0) continue;
    PD_CHECK(xs[i].initialized(), "ph_uncoalesce_tensor: tensor ", i,
             " is not initialised; it must already have its storage.");
    PD_CHECK(xs[i].dtype() == dtype, "ph_uncoalesce_tensor: tensor ", i, " has dtype ",
             phi::DataTypeToString(xs[i].dtype()), " but the fused buffer is ",
             phi::DataTypeToString(dtype), ".");
    PD_CHECK(xs[i].place() == place, "ph_uncoalesce_tensor: tensor ", i, " is on ",
             xs[i].place().DebugString(), " but the fused buffer is on ", place.DebugString(), ".");
    PD_CHECK(offset + len <= total, "ph_uncoalesce_tensor: tensor ", i, " ends at element ",
             offset + len, " past the fused buffer's ", total,
             "; pass the same tensors and alignment as to ph_coalesce_tensor.");
    const char* src = base + offset * elem;
    char* dst = static_cast<char*>(dense->data());
    if (dst != src) {
      if (place.GetType() == phi::AllocationType::CPU) {
        std::memcpy(dst, src, len * elem);
      } else {
#ifdef PADDLE_HYBRID_WITH_CUDA
        const char* err = paddle_hybrid::CudaCopyBytes(dst, src, len * elem, fused.stream());
        PD_CHECK(err == nullptr, "ph_uncoalesce_tensor: CUDA error: ", err ? err : "");
#else
        PD_THROW("ph_uncoalesce_tensor: tensor on a GPU place but paddle_hybrid's ops were built "
                 "without CUDA kernels; rebuild them with a CUDA build of Paddle.");
#endif
      }
    }
    offset += paddle_hybrid::SpanElems(static_cast<int64_t>(len), elem, place, use_align, align_size);
  }
}

// Every output is in place: nothing to infer.
std::vector<std::vector<int64_t>> PhUncoalesceTensorInferShape(
    const std::vector<std::vector<int64_t>>& x_shapes, const std::vector<int64_t>& fused_shape,
    bool use_align, int align_size) {
  return {};
}

std::vector<paddle::DataType> PhUncoalesceTensorInferDtype(
    const std::vector<paddle::DataType>& x_dtypes, const paddle::DataType& fused_dtype) {
  return {};
}

PD_BUILD_OP(ph_uncoalesce_tensor)
    .Inputs({paddle::Vec("X"), "Fused"})
    .Outputs({paddle::Vec("Out")})
    .Attrs({"use_align: bool", "align_size: int"})
    .SetInplaceMap({{paddle::Vec("X"), paddle::Vec("Out")}})
    .SetKernelFn(PD_KERNEL(PhUncoalesceTensorKernel))
    .SetInferShapeFn(PD_INFER_SHAPE(PhUncoalesceTensorInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PhUncoalesceTensorInferDtype));
