// paddle_hybrid: `ph_coalesce_tensor`, the layout of Paddle's built-in
// `coalesce_tensor` in a custom op that coexists with it.
//
// Registered as `ph_coalesce_tensor` (not `coalesce_tensor`): a custom op that
// shares a built-in op's name replaces the built-in for the whole process.
//
// Inputs `Input` (vector, in place as `Output`), attributes as the built-in op
// minus the ones the plugin never needs (`persist_output`, `size_of_dtype`,
// `concated_shapes`, `concated_ranks`).  Output `FusedOutput` is one 1-D buffer
// of dtype `dtype`; every `Output[i]` becomes a view of `FusedOutput` at the
// same offset the built-in op would use:
//   offset[i+1] = offset[i] + (use_align ? Alignment(numel_i * elem, place,
//                                                    align_size) / elem
//                                         : numel_i)
// where Alignment rounds up to `align_size` bytes (or to the allocator's
// minimum chunk, 4 KiB on CPU / 256 B on GPU, when align_size == -1).
//
// Differences from the built-in (documented in README):
//   * empty inputs (numel 0) are allowed and take no space (built-in: error);
//   * padding between tensors is zero-filled when copy_data is set (built-in:
//     left uninitialised), so a reduction over the fused buffer reads no
//     garbage;
//   * every dtype Paddle trains with is supported on CPU and GPU.
//
// Aliasing holds in dygraph and in legacy static programs.  Under PIR a custom
// op cannot make its outputs alias (see paddle_hybrid/ops.py for the documented
// behaviour there).

#include "coalesce_tensor.h"
#include "layout.h"

#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "paddle/extension.h"
#include "paddle/phi/backends/device_memory_alignment.h"
#include "paddle/phi/common/data_type.h"
#include "paddle/phi/core/dense_tensor.h"

namespace {

paddle::DataType ParseDtype(const std::string& name) {
  static const std::pair<const char*, paddle::DataType> kTable[] = {
      {"float16", paddle::DataType::FLOAT16},
      {"bfloat16", paddle::DataType::BFLOAT16},
      {"float32", paddle::DataType::FLOAT32},
      {"float64", paddle::DataType::FLOAT64},
      {"int8", paddle::DataType::INT8},
      {"uint8", paddle::DataType::UINT8},
      {"int16", paddle::DataType::INT16},
      {"int32", paddle::DataType::INT32},
      {"int64", paddle::DataType::INT64},
      {"bool", paddle::DataType::BOOL},
  };
  for (const auto& kv : kTable) {
    if (name == kv.first) return kv.second;
  }
  PD_THROW("ph_coalesce_tensor: unsupported dtype '", name,
           "'. Use one of float16, bfloat16, float32, float64, int8, uint8, "
           "int16, int32, int64, bool.");
}

std::shared_ptr<phi::DenseTensor> Dense(const paddle::Tensor& t, size_t i) {
  auto dense = std::dynamic_pointer_cast<phi::DenseTensor>(t.impl());
  PD_CHECK(dense != nullptr, "ph_coalesce_tensor: input ", i,
           " is not a dense tensor; only dense tensors can be coalesced "
           "(convert sparse or selected-rows gradients to dense first).");
  return dense;
}

// Bit pattern of `value` converted to `dtype`, in the low SizeOf(dtype) bytes.
template <typename T>
uint64_t Bits(float value) {
  T v = static_cast<T>(value);
  uint64_t out = 0;
  std::memcpy(&out, &v, sizeof(T));
  return out;
}

uint64_t ConstantPattern(paddle::DataType dtype, float value) {
  switch (dtype) {
    case paddle::DataType::FLOAT16:
      return Bits<paddle::float16>(value);
    case paddle::DataType::BFLOAT16:
      return Bits<paddle::bfloat16>(value);
    case paddle::DataType::FLOAT32:
      return Bits<float>(value);
    case paddle::DataType::FLOAT64:
      return Bits<double>(value);
    case paddle::DataType::INT8:
      return Bits<int8_t>(value);
    case paddle::DataType::UINT8:
      return Bits<uint8_t>(value);
    case paddle::DataType::INT16:
      return Bits<int16_t>(value);
    case paddle::DataType::INT32:
      return Bits<int32_t>(value);
    case paddle::DataType::INT64:
      return Bits<int64_t>(value);
    case paddle::DataType::BOOL:
      return Bits<bool>(value != 0.0f);
    default:
      PD_THROW("ph_coalesce_tensor: set_constant does not support this dtype.");
  }
}

template <typename U>
void FillHost(void* dst, int64_t numel, uint64_t pattern) {
  const U v = static_cast<U>(pattern);
  U* p = static_cast<U*>(dst);
  for (int64_t i = 0; i < numel; ++i) p[i] = v;
}

#ifdef PADDLE_HYBRID_WITH_CUDA
void CheckCuda(const char* err) {
  PD_CHECK(err == nullptr, "ph_coalesce_tensor: CUDA error: ", err ? err : "");
}
#endif

[[noreturn]] void NoCudaKernels() {
  PD_THROW("ph_coalesce_tensor: tensor on a GPU place but paddle_hybrid's ops were "
           "built without CUDA kernels; rebuild them with a CUDA build of Paddle "
           "(pip install --no-build-isolation --use-pep517 -e .).");
}

void CopyBytes(const phi::Place& place, void* dst, const void* src, size_t bytes,
               const paddle::Tensor& on_stream_of) {
  if (bytes == 0) return;
  if (place.GetType() == phi::AllocationType::CPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef PADDLE_HYBRID_WITH_CUDA
  CheckCuda(paddle_hybrid::CudaCopyBytes(dst, src, bytes, on_stream_of.stream()));
#else
  NoCudaKernels();
#endif
}

void FillConstant(const phi::Place& place, void* dst, int64_t numel,
                  paddle::DataType dtype, float value,
                  const paddle::Tensor& on_stream_of) {
  if (numel == 0) return;
  const uint64_t pattern = ConstantPattern(dtype, value);
  const size_t elem = phi::SizeOf(dtype);
  if (place.GetType() == phi::AllocationType::CPU) {
    switch (elem) {
      case 1: return FillHost<uint8_t>(dst, numel, pattern);
      case 2: return FillHost<uint16_t>(dst, numel, pattern);
      case 4: return FillHost<uint32_t>(dst, numel, pattern);
      case 8: return FillHost<uint64_t>(dst, numel, pattern);
      default: PD_THROW("ph_coalesce_tensor: unsupported element size ", elem);
    }
  }
#ifdef PADDLE_HYBRID_WITH_CUDA
  CheckCuda(paddle_hybrid::CudaFillPattern(dst, numel, static_cast<int>(elem), pattern,
                                           on_stream_of.stream()));
#else
  NoCudaKernels();
#endif
}


// A slice of the fused buffer as a phi::Allocation.  It holds a shallow copy
// of the fused DenseTensor, so the fused allocation lives as long as any view
// (as with a shared holder); freeing the slice frees nothing else.
class FusedSlice : public phi::Allocation {
 public:
  FusedSlice(const phi::DenseTensor& fused, void* ptr, size_t bytes)
      : phi::Allocation(ptr, bytes, fused.place()), fused_(fused) {}

 private:
  phi::DenseTensor fused_;
};

// Hands out exactly one slice: [byte_offset, byte_offset + bytes) of `fused`.
class FusedSliceAllocator : public phi::Allocator {
 public:
  FusedSliceAllocator(const phi::DenseTensor& fused, size_t byte_offset, size_t bytes)
      : fused_(fused), byte_offset_(byte_offset), bytes_(bytes) {}

  AllocationPtr Allocate(size_t bytes_size) override {
    PD_CHECK(bytes_size <= bytes_, "ph_coalesce_tensor: asked for ", bytes_size,
             " bytes of a ", bytes_, "-byte slice of the fused buffer.");
    PD_CHECK(byte_offset_ + bytes_ <= fused_.numel() * phi::SizeOf(fused_.dtype()),
             "ph_coalesce_tensor: slice past the end of the fused buffer.");
    char* ptr = static_cast<char*>(const_cast<phi::DenseTensor&>(fused_).data()) + byte_offset_;
    return AllocationPtr(new FusedSlice(fused_, ptr, bytes_),
                         [](phi::Allocation* a) { delete a; });
  }

 private:
  const phi::DenseTensor& fused_;
  size_t byte_offset_;
  size_t bytes_;
};

paddle::Place PickPlace(const std::vector<paddle::Tensor>& inputs) {
  for (const auto& t : inputs) {
    if (t.initialized()) return t.place();
  }
  // No input holds memory yet (copy_data == false on not-yet-computed
  // variables): use the device Paddle computes on.
#ifdef PADDLE_HYBRID_WITH_CUDA
  return paddle::GPUPlace(phi::backends::gpu::GetCurrentDeviceId());
#else
  return paddle::CPUPlace();
#endif
}

}  // namespace

std::vector<paddle::Tensor> PhCoalesceTensorKernel(
    std::vector<paddle::Tensor>& inputs,  // NOLINT: in place as Output
    const std::string& dtype_name, bool copy_data, bool set_constant,
    float constant, bool use_align, int align_size) {
  PD_CHECK(!inputs.empty(),
           "ph_coalesce_tensor: got no input tensors; pass at least one.");
  std::vector<std::shared_ptr<phi::DenseTensor>> dense;
  dense.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) dense.push_back(Dense(inputs[i], i));

  paddle::DataType dtype;
  if (dtype_name.empty()) {
    dtype = inputs[0].dtype();
    for (size_t i = 1; i < inputs.size(); ++i) {
      PD_CHECK(inputs[i].dtype() == dtype, "ph_coalesce_tensor: input ", i,
               " has dtype ", phi::DataTypeToString(inputs[i].dtype()),
               " but input 0 has ", phi::DataTypeToString(dtype),
               "; pass `dtype` explicitly or coalesce each dtype separately.");
    }
  } else {
    dtype = ParseDtype(dtype_name);
  }
  const size_t elem = phi::SizeOf(dtype);
  PD_CHECK(align_size == -1 || (align_size > 0 && align_size % elem == 0),
           "ph_coalesce_tensor: align_size=", align_size,
           " is not a positive multiple of the element size (", elem,
           " bytes for ", phi::DataTypeToString(dtype),
           "); use -1 for the device default or a multiple of ", elem, ".");

  if (copy_data) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (dense[i]->numel() == 0) continue;
      PD_CHECK(dense[i]->initialized(), "ph_coalesce_tensor: input ", i,
               " is not initialised but copy_data=True; initialise it or use "
               "copy_data=False.");
      PD_CHECK(inputs[i].dtype() == dtype, "ph_coalesce_tensor: input ", i,
               " has dtype ", phi::DataTypeToString(inputs[i].dtype()),
               " but the fused dtype is ", phi::DataTypeToString(dtype),
               "; copy_data=True copies bytes, so cast the input first.");
    }
  }

  const paddle::Place place = PickPlace(inputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].initialized()) {
      PD_CHECK(inputs[i].place() == place, "ph_coalesce_tensor: input ", i,
               " is on ", inputs[i].place().DebugString(), " but input 0 is on ",
               place.DebugString(), "; move all inputs to one device.");
    }
  }

  std::vector<size_t> offsets(inputs.size() + 1, 0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    offsets[i + 1] = offsets[i] + paddle_hybrid::SpanElems(dense[i]->numel(), elem, place,
                                            use_align, align_size);
  }
  const int64_t total = static_cast<int64_t>(offsets.back());

  paddle::Tensor fused = paddle::empty({total}, dtype, place);
  auto fused_dense = std::dynamic_pointer_cast<phi::DenseTensor>(fused.impl());
  char* base = static_cast<char*>(fused_dense->data());

  if (copy_data) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const size_t len = static_cast<size_t>(dense[i]->numel());
      char* dst = base + offsets[i] * elem;
      if (len > 0) {
        CopyBytes(place, dst, dense[i]->data(), len * elem, fused);
      }
      const size_t pad = offsets[i + 1] - offsets[i] - len;
      if (pad > 0) {
        FillConstant(place, dst + len * elem, static_cast<int64_t>(pad), dtype,
                     0.0f, fused);
      }
    }
  } else if (set_constant) {
    FillConstant(place, base, total, dtype, constant, fused);
  }

  // Point every output into the fused buffer.  The view keeps its own
  // DenseTensor (and so its own inplace-version counter, like
  // DenseTensor::ShareDataWith would); only its storage is replaced by a slice
  // of the fused allocation, through public API that Paddle 3.2 and 3.3 both
  // export to custom ops: clear() drops the old storage and AllocateFrom()
  // takes the new one from an allocator that hands out that slice.
  // (ShareDataWith/Holder()/Slice are not in 3.2's custom-op headers; copy or
  // move assignment would also carry the fused tensor's version counter.)
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (dense[i]->numel() == 0) continue;  // nothing to alias
    const size_t bytes = static_cast<size_t>(dense[i]->numel()) * elem;
    FusedSliceAllocator slice(*fused_dense, offsets[i] * elem, bytes);
    phi::DenseTensorMeta meta = fused_dense->meta();
    meta.dims = dense[i]->dims();
    meta.strides = phi::DenseTensorMeta::calc_strides(meta.dims);
    meta.is_scalar = dense[i]->meta().is_scalar;
    meta.offset = 0;  // the slice's pointer already includes the offset
    dense[i]->clear();
    dense[i]->set_meta(meta);
    void* got = dense[i]->AllocateFrom(&slice, dtype, bytes);
    PD_CHECK(got == base + offsets[i] * elem,
             "ph_coalesce_tensor: output ", i, " did not take its slice of the fused buffer.");
  }
  return {fused};
}

std::vector<std::vector<int64_t>> PhCoalesceTensorInferShape(
    const std::vector<std::vector<int64_t>>& input_shapes,
    const std::string& dtype_name, bool copy_data, bool set_constant,
    float constant, bool use_align, int align_size) {
  // The fused length depends on the place's default alignment when
  // align_size == -1, which is unknown here; report it as dynamic then.
  int64_t total = 0;
  for (const auto& shape : input_shapes) {
    int64_t numel = 1;
    for (int64_t d : shape) {
      if (d < 0) return {{-1}};
      numel *= d;
    }
    if (!use_align) {
      total += numel;
    } else if (align_size > 0 && !dtype_name.empty()) {
      const size_t elem = phi::SizeOf(ParseDtype(dtype_name));
      const int64_t bytes = numel * static_cast<int64_t>(elem);
      total += ((bytes + align_size - 1) / align_size) * align_size /
               static_cast<int64_t>(elem);
    } else {
      return {{-1}};
    }
  }
  return {{total}};
}

std::vector<paddle::DataType> PhCoalesceTensorInferDtype(
    const std::vector<paddle::DataType>& input_dtypes,
    const std::string& dtype_name) {
  if (dtype_name.empty()) return {input_dtypes.at(0)};
  return {ParseDtype(dtype_name)};
}

PD_BUILD_OP(ph_coalesce_tensor)
    .Inputs({paddle::Vec("Input")})
    .Outputs({paddle::Vec("Output"), "FusedOutput"})
    .Attrs({"dtype: std::string", "copy_data: bool", "set_constant: bool",
            "constant: float", "use_align: bool", "align_size: int"})
    .SetInplaceMap({{paddle::Vec("Input"), paddle::Vec("Output")}})
    .SetKernelFn(PD_KERNEL(PhCoalesceTensorKernel))
    .SetInferShapeFn(PD_INFER_SHAPE(PhCoalesceTensorInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PhCoalesceTensorInferDtype));
