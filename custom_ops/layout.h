// paddle_hybrid: the fused-buffer layout shared by ph_coalesce_tensor and
// ph_uncoalesce_tensor (host code only; includes Paddle headers).
#pragma once

#include <cstddef>
#include <cstdint>

#include "paddle/phi/backends/device_memory_alignment.h"

namespace paddle_hybrid {

// Elements a tensor of `numel` elements of `elem` bytes takes in the fused
// buffer: Paddle's built-in coalesce_tensor rounds each tensor up to
// `align_size` bytes (or the place's minimum chunk when align_size == -1) when
// `use_align`; an empty tensor takes nothing.
inline size_t SpanElems(int64_t numel, size_t elem, const phi::Place& place, bool use_align,
                        int align_size) {
  const size_t len = static_cast<size_t>(numel);
  if (!use_align || len == 0) return len;
  return phi::Alignment(len * elem, place, align_size) / elem;
}

}  // namespace paddle_hybrid
