// paddle_hybrid: `ph_use_ring`, the comm context a static program's next collective runs on (CPU).
//
// A collective op of a static program names its group by `ring_id`; its CPU kernel takes the
// comm context from the device context it is given.  On CPU every instruction is given the one
// shared CPU device context, and Paddle's executor sets that context's comm context only while
// it has none (`SetDeviceCommContext`): the first group a program uses would serve every later
// collective, whatever its ring.  `paddle_hybrid.gloo.comm_contexts` puts a `ph_use_ring` before
// each collective; it points the shared CPU context at the comm context of its `ring_id` (the one
// `CommContextManager` holds under that key), right before the collective runs.  It carries a
// `ring_id` attribute, so Paddle's executor orders it among the communication ops in program
// order: nothing runs between it and its collective that could move the context.
//
// The kernel is in place and reads no data: its input only anchors it in the program.  For a ring
// this process holds no comm context for (an op that names a ring but communicates nothing), the
// shared context is left with none: a collective that needs one then fails loudly instead of
// running on the previous collective's group.
//
// `ph_comm_context_has` answers from Python whether a key is taken (Paddle's Python binding of
// the manager has no such call): a group made twice under one key raises AlreadyExists.
// `ph_comm_context` gives a context's address (its gloo deadline is set through it).

#include <cstdio>
#include <string>
#include <vector>

#include "paddle/extension.h"
#include "paddle/phi/core/distributed/comm_context_manager.h"
#include "paddle/phi/api/include/context_pool.h"
#include "paddle/phi/core/device_context.h"

namespace {

void UseRing(const paddle::Tensor& x, int ring_id) {
  PD_CHECK(x.is_cpu(), "ph_use_ring: runs on CPU only (got a tensor on another place).");
  auto& manager = phi::distributed::CommContextManager::GetInstance();
  const std::string key = std::to_string(ring_id);
  phi::DeviceContext* shared = paddle::experimental::DeviceContextPool::Instance().GetMutable(phi::CPUPlace());
  shared->SetCommContext(manager.Has(key) ? manager.Get(key) : nullptr);
}

void PhUseRingKernel(paddle::Tensor& x, int ring_id) {  // NOLINT
  // Paddle's PIR executor reports a custom op's exception without its message: say it here too.
  try {
    UseRing(x, ring_id);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "paddle_hybrid: ph_use_ring failed: %s\n", e.what());
    std::fflush(stderr);
    throw;
  }
}

std::vector<std::vector<int64_t>> PhUseRingInferShape(const std::vector<int64_t>& x_shape) { return {}; }

std::vector<paddle::DataType> PhUseRingInferDtype(const paddle::DataType& x_dtype) { return {}; }

}  // namespace

PD_BUILD_OP(ph_use_ring)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int"})
    .SetInplaceMap({{"X", "Out"}})
    .SetKernelFn(PD_KERNEL(PhUseRingKernel))
    .SetInferShapeFn(PD_INFER_SHAPE(PhUseRingInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PhUseRingInferDtype));

extern "C" {

// Whether the process's comm-context manager holds `key`.
int ph_comm_context_has(const char* key) {
  return phi::distributed::CommContextManager::GetInstance().Has(key) ? 1 : 0;
}

// The comm context the manager holds under `key`, or null.
void* ph_comm_context(const char* key) {
  auto& manager = phi::distributed::CommContextManager::GetInstance();
  return manager.Has(key) ? static_cast<void*>(manager.Get(key)) : nullptr;
}

}  // extern "C"
