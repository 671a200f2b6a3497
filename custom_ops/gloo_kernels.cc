// paddle_hybrid: CPU kernels over gloo for the collectives Paddle's CPU build has
// none for, and the CPU answer of `phi::distributed::GetDefaultPlace()`.
//
// Paddle 3.3's CPU kernels `ReduceScatterKernel`, `AllToAllKernel`, `PSendKernel`
// and `PRecvKernel` only throw, and `GetDefaultPlace()` of a wheel built with
// custom-device support indexes the first custom device type of an empty list.
// Each is called through `libphi_core.so`'s own procedure linkage table (the
// reshard functions, the ops' kernel wrappers): `paddle_hybrid.gloo.kernels`
// points those table entries at the functions below while the plugin is
// installed, and back at Paddle's at `uninstall()`.  This file only provides the
// functions, by name, through the C entry points at its end.
//
// Per call: a gloo comm context on the device context gets the gloo work; any
// other context gets Paddle's original function, unchanged (the device rule).
//
// How each moves bytes (every byte of a reduce_scatter is reduced once):
// * reduce_scatter: a ring.  In step s rank r sends its partial sum of chunk
//   (r - s - 1) to r + 1 and receives the partial of chunk (r - s - 2) from
//   r - 1, adding its own part; after n - 1 steps it holds chunk r, summed over
//   every rank.  Each rank sends (n - 1) / n of its input, half an all_reduce.
// * all_to_all: pairwise rounds of the circle method (n - 1 rounds for an even
//   n, n rounds with one rank idle per round for an odd n); each part crosses
//   once.
// * send/recv: one gloo message each (a shape message first when the shape is
//   dynamic).
// Gloo's send waits until its peer posts the matching receive, so in every
// exchange the even (or lower) rank sends first and its partner receives first.

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "paddle/extension.h"
#include "paddle/phi/backends/cpu/cpu_context.h"
#include "paddle/phi/common/bfloat16.h"
#include "paddle/phi/common/float16.h"
#include "paddle/phi/common/place.h"
#include "paddle/phi/core/allocator.h"
#include "paddle/phi/core/dense_tensor.h"
#include "paddle/phi/core/distributed/comm_context.h"
#include "paddle/phi/core/distributed/comm_context_manager.h"
#include "paddle/phi/api/include/context_pool.h"
#include "paddle/phi/core/enforce.h"

#include "fake_comm.h"

// Paddle's wheel ships `gloo_comm_context.h` but not the gloo headers it includes,
// so the two members used here are declared as Paddle defines them (exported by
// libphi_core.so).  Whether a context is one is asked of its vtable, the one
// `libphi_core.so` exports (`ph_gloo_set_vtable`), not through this declaration.
namespace phi {
namespace distributed {
class GlooCommContext final : public CommContext {
 public:
  void Send(const phi::DenseTensor& in_tensor, int dst, uint32_t tag = 0);
  void Recv(phi::DenseTensor* out_tensor, int src, uint32_t tag = 0);
};
}  // namespace distributed
}  // namespace phi

namespace {

using phi::CPUContext;
using phi::DenseTensor;
using phi::distributed::GlooCommContext;

// -- bookkeeping ------------------------------------------------------------------------

std::map<std::string, void*>& Originals() {
  static std::map<std::string, void*> originals;
  return originals;
}

std::map<std::string, std::atomic<long long>>& Calls() {
  static std::map<std::string, std::atomic<long long>> calls;
  return calls;
}

template <typename T>
struct TypeName;
#define PH_TYPE_NAME(T, NAME)                   \
  template <>                                   \
  struct TypeName<T> {                          \
    static constexpr const char* value = NAME;  \
  };
PH_TYPE_NAME(float, "float")
PH_TYPE_NAME(double, "double")
PH_TYPE_NAME(int, "int")
PH_TYPE_NAME(long, "long")  // NOLINT
PH_TYPE_NAME(short, "short")  // NOLINT
PH_TYPE_NAME(signed char, "signed char")
PH_TYPE_NAME(unsigned char, "unsigned char")
PH_TYPE_NAME(bool, "bool")
PH_TYPE_NAME(phi::dtype::float16, "phi::dtype::float16")
PH_TYPE_NAME(phi::dtype::bfloat16, "phi::dtype::bfloat16")
#undef PH_TYPE_NAME

template <typename Fn>
Fn Original(const char* kernel, const char* type) {
  auto it = Originals().find(std::string(kernel) + "|" + type);
  PADDLE_ENFORCE_EQ(it != Originals().end(), true,
                    common::errors::PreconditionNotMet(
                        "paddle_hybrid: no original %s<%s> recorded; the plugin's gloo "
                        "kernels were installed without it.", kernel, type));
  return reinterpret_cast<Fn>(it->second);
}

void Count(const char* kernel) { Calls()[kernel]++; }

const void* gloo_vtable = nullptr;  // where a GlooCommContext's vtable pointer points

// The gloo comm context on `dev_ctx`, or null (then Paddle's original runs).
GlooCommContext* GlooOf(const CPUContext& dev_ctx) {
  phi::distributed::CommContext* ctx = dev_ctx.GetCommContext();
  if (ctx == nullptr || gloo_vtable == nullptr) return nullptr;
  const void* vptr = *reinterpret_cast<const void* const*>(ctx);
  return vptr == gloo_vtable ? static_cast<GlooCommContext*>(ctx) : nullptr;
}

int64_t Rows(const DenseTensor& t) { return t.dims().size() == 0 ? 1 : t.dims()[0]; }

template <typename T>
T Sum(T a, T b) {
  return static_cast<T>(a + b);
}
template <>
bool Sum<bool>(bool a, bool b) {
  return a || b;
}

// out[i] = a[i] + b[i] for `n` elements.
template <typename T>
void Add(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Sum<T>(a[i], b[i]);
}

// One exchange with two peers: send `send` to `to`, receive `recv` from `from`,
// in the order that cannot deadlock on gloo's rendezvous send (see the top).
void SendRecv(GlooCommContext* comm, bool send_first, const DenseTensor& send, int to,
              DenseTensor* recv, int from) {
  if (send_first) {
    comm->Send(send, to);
    comm->Recv(recv, from);
  } else {
    comm->Recv(recv, from);
    comm->Send(send, to);
  }
}

// A tensor of `rows` rows shaped like `like`'s rows, in host memory.  (Kernels here copy
// parts into buffers of their own instead of making views: the view API of DenseTensor is not
// declared to custom ops in every Paddle version.)
template <typename T>
DenseTensor Buffer(const CPUContext& dev_ctx, const DenseTensor& like, int64_t rows) {
  DenseTensor t;
  auto dims = like.dims();
  dims[0] = rows;
  t.Resize(dims);
  dev_ctx.template Alloc<T>(&t);
  return t;
}

template <typename T>
void Copy(T* to, const T* from, int64_t n) {
  if (n > 0) std::memcpy(to, from, sizeof(T) * n);
}

// `n` elements at `data` as a uint8 tensor that does not own them: what is sent is read
// straight from an input and what arrives is written straight into an output, no copies.
// (Every send and receive of these kernels goes through this, so both sides of a message
// count it in bytes.)
DenseTensor Wrap(const char* data, int64_t bytes) {
  auto holder = std::make_shared<phi::Allocation>(const_cast<char*>(data), static_cast<size_t>(bytes),
                                                  phi::CPUPlace());
  return DenseTensor(holder, phi::DenseTensorMeta(phi::DataType::UINT8, common::make_ddim({bytes})));
}

template <typename T>
DenseTensor Wrap(const T* data, int64_t n) {
  return Wrap(reinterpret_cast<const char*>(data), n * static_cast<int64_t>(sizeof(T)));
}

// -- reduce_scatter -----------------------------------------------------------------------

template <typename T>
void ReduceScatter(const CPUContext& dev_ctx, const DenseTensor& x, int nranks, DenseTensor* out) {
  using Fn = void (*)(const CPUContext&, const DenseTensor&, int, DenseTensor*);
  if (ph_fake::IsFake(dev_ctx.GetCommContext())) {
    ph_fake::FakeReduceScatter(dev_ctx.GetCommContext(), x, out);
    return ph_fake::Log("reduce_scatter", dev_ctx.GetCommContext(), ph_fake::Bytes(*out));
  }
  GlooCommContext* comm = GlooOf(dev_ctx);
  if (comm == nullptr) {
    return Original<Fn>("ReduceScatterKernel", TypeName<T>::value)(dev_ctx, x, nranks, out);
  }
  Count("ReduceScatterKernel");
  const int n = comm->GetSize(), r = comm->GetRank();
  ph_fake::Log("reduce_scatter", comm, n > 0 ? ph_fake::Bytes(x) / n : 0);
  PADDLE_ENFORCE_EQ(nranks, n, common::errors::InvalidArgument(
      "paddle_hybrid reduce_scatter: nranks is %d, the gloo group has %d ranks.", nranks, n));
  PADDLE_ENFORCE_EQ(x.dims().size() > 0 && Rows(x) % n == 0, true, common::errors::InvalidArgument(
      "paddle_hybrid reduce_scatter: the first dimension of the input (%s) must divide by the %d ranks.",
      x.dims().to_str(), n));
  const int64_t rows = Rows(x) / n;
  dev_ctx.template Alloc<T>(out);
  if (n == 1 || x.numel() == 0) {
    if (x.numel() > 0) std::memcpy(out->data<T>(), x.data<T>(), sizeof(T) * x.numel());
    return;
  }
  const int64_t c = x.numel() / n;  // elements of one chunk
  const T* in = x.data<T>();
  // `partial` holds the running sum this rank passes on (from step 1: step 0 sends its own
  // chunk straight from the input); `received` what comes from the previous rank.
  DenseTensor partial = Buffer<T>(dev_ctx, x, n > 2 ? rows : 0), received = Buffer<T>(dev_ctx, x, rows);
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int s = 0; s + 1 < n; ++s) {
    const int send_k = ((r - s - 1) % n + n) % n, recv_k = ((r - s - 2) % n + n) % n;
    const T* to_send = s == 0 ? in + send_k * c : partial.data<T>();
    DenseTensor in_flight = Wrap<T>(received.data<T>(), c);
    SendRecv(comm, r % 2 == 0, Wrap<T>(to_send, c), next, &in_flight, prev);
    // The last step's chunk is this rank's own: its sum goes straight to `out`.
    T* sum = s + 2 == n ? out->data<T>() : partial.data<T>();
    Add<T>(received.data<T>(), in + recv_k * c, sum, c);
  }
}

// -- all_to_all -----------------------------------------------------------------------------

// Partner of `rank` in round `k` of the circle method on `m` (even) seats; a partner
// >= the group size is the empty seat of an odd group: that rank idles this round.
int Partner(int rank, int k, int m) {
  const int last = m - 1;
  if (rank == last) return k;
  if (rank == k) return last;
  return ((2 * k - rank) % last + last) % last;
}

template <typename T>
void AllToAll(const CPUContext& dev_ctx, const DenseTensor& x, DenseTensor* out) {
  using Fn = void (*)(const CPUContext&, const DenseTensor&, DenseTensor*);
  if (ph_fake::IsFake(dev_ctx.GetCommContext())) {
    ph_fake::Log("all_to_all", dev_ctx.GetCommContext(), ph_fake::Bytes(x));
    return ph_fake::FakeAllToAll(dev_ctx.GetCommContext(), x, out);
  }
  GlooCommContext* comm = GlooOf(dev_ctx);
  if (comm == nullptr) {
    return Original<Fn>("AllToAllKernel", TypeName<T>::value)(dev_ctx, x, out);
  }
  Count("AllToAllKernel");
  ph_fake::Log("all_to_all", comm, ph_fake::Bytes(x));
  const int n = comm->GetSize(), r = comm->GetRank();
  PADDLE_ENFORCE_EQ(x.dims().size() > 0 && Rows(x) % n == 0, true, common::errors::InvalidArgument(
      "paddle_hybrid all_to_all: the first dimension of the input (%s) must divide by the %d ranks.",
      x.dims().to_str(), n));
  const int64_t rows = Rows(x) / n;
  out->Resize(x.dims());
  dev_ctx.template Alloc<T>(out);
  if (x.numel() == 0) return;
  const int64_t c = x.numel() / n;  // elements of one part
  const T* in = x.data<T>();
  T* result = out->data<T>();
  Copy<T>(result + r * c, in + r * c, c);
  const int seats = n % 2 == 0 ? n : n + 1;
  for (int k = 0; k + 1 < seats; ++k) {
    const int peer = Partner(r, k, seats);
    if (peer >= n) continue;  // the empty seat: no exchange this round
    DenseTensor arriving = Wrap<T>(result + peer * c, c);
    SendRecv(comm, r < peer, Wrap<T>(in + peer * c, c), peer, &arriving, peer);
  }
}

// -- all_to_all with a size per part (expert parallel's all_to_all_single) ---------------------

// Part p of `send` goes to rank p, part p of `recv` comes from rank p; parts lie one after
// another, their sizes in bytes given by each side (the sizes two ranks give a pair must agree,
// as for every all_to_all_single).  The same pairwise rounds as AllToAll; a part of no bytes is
// not sent (its receiver expects none).
void AllToAllV(GlooCommContext* comm, const char* send, const int64_t* send_bytes, char* recv,
               const int64_t* recv_bytes) {
  const int n = comm->GetSize(), r = comm->GetRank();
  std::vector<int64_t> send_at(n + 1, 0), recv_at(n + 1, 0);
  for (int p = 0; p < n; ++p) {
    send_at[p + 1] = send_at[p] + send_bytes[p];
    recv_at[p + 1] = recv_at[p] + recv_bytes[p];
  }
  PADDLE_ENFORCE_EQ(send_bytes[r], recv_bytes[r], common::errors::InvalidArgument(
      "paddle_hybrid all_to_all: this rank sends itself %d bytes but expects %d.", send_bytes[r], recv_bytes[r]));
  Copy<char>(recv + recv_at[r], send + send_at[r], send_bytes[r]);
  const int seats = n % 2 == 0 ? n : n + 1;
  for (int k = 0; k + 1 < seats; ++k) {
    const int peer = Partner(r, k, seats);
    if (peer >= n) continue;
    const bool sends = send_bytes[peer] > 0, receives = recv_bytes[peer] > 0;
    DenseTensor out = Wrap(recv + recv_at[peer], recv_bytes[peer]);
    if (r < peer && sends) comm->Send(Wrap(send + send_at[peer], send_bytes[peer]), peer);
    if (receives) comm->Recv(&out, peer);
    if (r > peer && sends) comm->Send(Wrap(send + send_at[peer], send_bytes[peer]), peer);
  }
}

// -- send / recv ----------------------------------------------------------------------------

// One message of `x` to `peer` (a shape message first when `dynamic_shape`).
void GlooSend(GlooCommContext* comm, const CPUContext& dev_ctx, const DenseTensor& x, int peer,
              bool dynamic_shape) {
  if (dynamic_shape) {
    DenseTensor rank_only, shape;
    rank_only.Resize({1});
    dev_ctx.template Alloc<int64_t>(&rank_only)[0] = x.dims().size();
    shape.Resize({x.dims().size() + 1});
    int64_t* s = dev_ctx.template Alloc<int64_t>(&shape);
    s[0] = x.dims().size();
    for (int i = 0; i < x.dims().size(); ++i) s[i + 1] = x.dims()[i];
    comm->Send(rank_only, peer);  // the receiver learns how many dims follow
    comm->Send(shape, peer);
  }
  if (x.numel() > 0) comm->Send(x, peer);
}

// The message GlooSend sent, into `out` (of `dtype`; shaped `out_shape` unless `dynamic_shape`).
void GlooRecv(GlooCommContext* comm, const CPUContext& dev_ctx, int peer, phi::DataType dtype,
              const std::vector<int>& out_shape, bool dynamic_shape, DenseTensor* out) {
  if (dynamic_shape) {
    DenseTensor rank_only;
    rank_only.Resize({1});
    int64_t* nd = dev_ctx.template Alloc<int64_t>(&rank_only);
    comm->Recv(&rank_only, peer);
    DenseTensor shape;
    shape.Resize({nd[0] + 1});
    const int64_t* s = dev_ctx.template Alloc<int64_t>(&shape);
    comm->Recv(&shape, peer);
    std::vector<int64_t> dims(s + 1, s + 1 + nd[0]);
    out->Resize(common::make_ddim(dims));
  } else {
    out->Resize(common::make_ddim(std::vector<int64_t>(out_shape.begin(), out_shape.end())));
  }
  dev_ctx.Alloc(out, dtype);
  if (out->numel() > 0) comm->Recv(out, peer);
}

template <typename T>
void PSend(const CPUContext& dev_ctx, const DenseTensor& x, int peer, bool dynamic_shape) {
  using Fn = void (*)(const CPUContext&, const DenseTensor&, int, bool);
  if (ph_fake::IsFake(dev_ctx.GetCommContext()) || GlooOf(dev_ctx) != nullptr) {
    ph_fake::Log("send", dev_ctx.GetCommContext(), ph_fake::Bytes(x), peer);
  }
  if (ph_fake::IsFake(dev_ctx.GetCommContext())) return ph_fake::FakeSend(dev_ctx.GetCommContext(), x, peer);
  GlooCommContext* comm = GlooOf(dev_ctx);
  if (comm == nullptr) {
    return Original<Fn>("PSendKernel", TypeName<T>::value)(dev_ctx, x, peer, dynamic_shape);
  }
  Count("PSendKernel");
  GlooSend(comm, dev_ctx, x, peer, dynamic_shape);
}

template <typename T>
void PRecv(const CPUContext& dev_ctx, int peer, phi::DataType dtype, const std::vector<int>& out_shape,
           bool dynamic_shape, DenseTensor* out) {
  using Fn = void (*)(const CPUContext&, int, phi::DataType, const std::vector<int>&, bool, DenseTensor*);
  if (ph_fake::IsFake(dev_ctx.GetCommContext())) {
    if (dynamic_shape) {
      ph_fake::FakeRecvShape(dev_ctx.GetCommContext(), peer, out);
    } else {
      out->Resize(common::make_ddim(std::vector<int64_t>(out_shape.begin(), out_shape.end())));
    }
    dev_ctx.Alloc(out, phi::CppTypeToDataType<T>::Type());
    return ph_fake::FakeRecv(dev_ctx.GetCommContext(), out, peer);
  }
  GlooCommContext* comm = GlooOf(dev_ctx);
  if (comm == nullptr) {
    return Original<Fn>("PRecvKernel", TypeName<T>::value)(dev_ctx, peer, dtype, out_shape, dynamic_shape, out);
  }
  Count("PRecvKernel");
  GlooRecv(comm, dev_ctx, peer, phi::CppTypeToDataType<T>::Type(), out_shape, dynamic_shape, out);
  ph_fake::Log("recv", comm, ph_fake::Bytes(*out), peer);
}

// -- send_v2 / recv_v2 of static programs ---------------------------------------------------
//
// The CPU kernels of the legacy operators `send_v2` / `recv_v2` (what a PIR pipeline's
// stages exchange) only throw, and no call of Paddle's reaches them through a table the
// plugin can point elsewhere.  `paddle_hybrid.gloo.comm_contexts` replaces each in the
// executor's copy of a CPU program by `ph_send_v2` / `ph_recv_v2` (same attributes), which
// send on ring `ring_id`'s gloo comm context as p_send / p_recv do.

GlooCommContext* RingGloo(int ring_id, const char* op) {
  auto& manager = phi::distributed::CommContextManager::GetInstance();
  const std::string key = std::to_string(ring_id);
  PD_CHECK(manager.Has(key), op, ": no comm context for ring ", ring_id,
           " in this process (its process group was not created with paddle_hybrid installed).");
  phi::distributed::CommContext* ctx = manager.Get(key);
  PD_CHECK(gloo_vtable != nullptr && *reinterpret_cast<const void* const*>(ctx) == gloo_vtable, op,
           ": the comm context of ring ", ring_id, " is not a gloo one.");
  return static_cast<GlooCommContext*>(ctx);
}

const CPUContext& CpuContext() {
  return *static_cast<const CPUContext*>(paddle::experimental::DeviceContextPool::Instance().Get(phi::CPUPlace()));
}

// Who a failed exchange waited for, and the setting that bounds the wait (the ring's gloo context
// waits what paddle_hybrid set on it when the group was made).
std::string PeerWords(int ring_id, GlooCommContext* comm, int peer, const char* what) {
  return std::string(what) + " ring rank " + std::to_string(peer) + " of ring " + std::to_string(ring_id) +
         " (this process is ring rank " + std::to_string(comm->GetRank()) + " of " + std::to_string(comm->GetSize()) +
         "; the wait is PADDLE_HYBRID_TIMEOUT, or PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT when set)";
}

// A ring's sends, in order, on a thread of their own.  A pipeline schedule posts a send and
// goes on (on a GPU it only enqueues it on a stream): 1F1B's last stage receives microbatch i + 1
// before it sends the gradient of i, while the first stage receives that gradient before it
// sends i + 1.  A gloo send returns once its peer receives, so done in the caller both would
// wait for ever.  The bytes are copied when posted; an error of a send is raised by the next
// send on any ring, or by `ph_p2p_flush`.
class RingSender {
 public:
  RingSender(GlooCommContext* comm, int ring_id) : comm_(comm), ring_id_(ring_id), thread_([this] { Loop(); }) {}
  ~RingSender() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  void Post(const DenseTensor& x, int peer, bool dynamic_shape) {
    auto copy = std::make_unique<DenseTensor>();
    copy->Resize(x.dims());
    CpuContext().Alloc(copy.get(), x.dtype());
    if (x.numel() > 0) std::memcpy(copy->data(), x.data(), x.numel() * phi::SizeOf(x.dtype()));
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(Item{std::move(copy), peer, dynamic_shape});
    }
    wake_.notify_all();
  }

  // Wait until every posted send is done.
  void Flush() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
  }

 private:
  struct Item {
    std::unique_ptr<DenseTensor> tensor;
    int peer;
    bool dynamic_shape;
  };

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      Item item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      try {
        GlooSend(comm_, CpuContext(), *item.tensor, item.peer, item.dynamic_shape);
      } catch (const std::exception& e) {
        RecordError(PeerWords(ring_id_, comm_, item.peer, "a send to") + ": " + e.what());
      }
      item.tensor.reset();
      lock.lock();
      busy_ = false;
      idle_.notify_all();
    }
  }

  GlooCommContext* comm_;
  int ring_id_;
  std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::deque<Item> queue_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;  // last: started once the members above exist

 public:
  static void RecordError(const std::string& what) {
    std::lock_guard<std::mutex> lock(ErrorMutex());
    if (Error().empty()) Error() = what;
  }
  static void RaiseError() {
    std::lock_guard<std::mutex> lock(ErrorMutex());
    if (!Error().empty()) PD_THROW("paddle_hybrid: an earlier ph_send_v2 failed: ", Error());
  }

 private:
  static std::mutex& ErrorMutex() {
    static std::mutex mu;
    return mu;
  }
  static std::string& Error() {
    static std::string error;
    return error;
  }
};

std::mutex& SendersMutex() {
  static std::mutex mu;
  return mu;
}

std::map<GlooCommContext*, std::unique_ptr<RingSender>>& Senders() {
  static auto* senders = new std::map<GlooCommContext*, std::unique_ptr<RingSender>>();  // never destroyed:
  return *senders;  // its threads may outlive static destruction at exit
}

RingSender& SenderOf(GlooCommContext* comm, int ring_id) {
  std::lock_guard<std::mutex> lock(SendersMutex());
  auto& sender = Senders()[comm];
  if (!sender) sender = std::make_unique<RingSender>(comm, ring_id);
  return *sender;
}

// Paddle's PIR executor reports an exception of a custom op as "std::exception", without its
// message: the message goes to stderr too, where the rank's log keeps it.
template <typename Fn>
auto Reported(const char* op, Fn fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "paddle_hybrid: %s failed: %s\n", op, e.what());
    std::fflush(stderr);
    throw;
  }
}

// The comm context of ring `ring_id` when it is a fake one (a dry run's, `fake_comm.h`), else null.
const phi::distributed::CommContext* RingFake(int ring_id) {
  auto& manager = phi::distributed::CommContextManager::GetInstance();
  const std::string key = std::to_string(ring_id);
  if (!manager.Has(key)) return nullptr;
  const phi::distributed::CommContext* ctx = manager.Get(key);
  return ph_fake::IsFake(ctx) ? ctx : nullptr;
}

void PhSendV2Kernel(paddle::Tensor& x, int ring_id, int peer, bool dynamic_shape) {  // NOLINT
  Reported("ph_send_v2", [&] {
    PD_CHECK(x.is_cpu() && x.is_dense_tensor(), "ph_send_v2: a dense CPU tensor is needed.");
    const auto& dense = *static_cast<const DenseTensor*>(x.impl().get());
    if (const auto* fake = RingFake(ring_id)) {  // a dry run: nobody receives; the shape is recorded
      ph_fake::Log("send", fake, ph_fake::Bytes(dense), peer);
      return ph_fake::FakeSend(fake, dense, peer);
    }
    Count("SendV2");
    RingSender::RaiseError();
    GlooCommContext* comm = RingGloo(ring_id, "ph_send_v2");
    ph_fake::Log("send", comm, ph_fake::Bytes(dense), peer);
    SenderOf(comm, ring_id).Post(dense, peer, dynamic_shape);
  });
}

std::vector<paddle::Tensor> PhRecvV2Kernel(const paddle::Tensor& like, int ring_id, int peer,
                                           const std::vector<int>& out_shape, bool dynamic_shape) {
  return Reported("ph_recv_v2", [&] {
    PD_CHECK(like.is_cpu(), "ph_recv_v2: runs on CPU only.");
    auto out = std::make_shared<DenseTensor>();
    if (const auto* fake = RingFake(ring_id)) {  // a dry run: the shape asked for (or the sender's record)
      if (dynamic_shape) {
        ph_fake::FakeRecvShape(fake, peer, out.get());
      } else {
        out->Resize(common::make_ddim(std::vector<int64_t>(out_shape.begin(), out_shape.end())));
      }
      CpuContext().Alloc(out.get(), like.dtype());
      ph_fake::FakeRecv(fake, out.get(), peer);  // logs the receive
      return std::vector<paddle::Tensor>{paddle::Tensor(out)};
    }
    Count("RecvV2");
    GlooCommContext* comm = RingGloo(ring_id, "ph_recv_v2");
    try {
      GlooRecv(comm, CpuContext(), peer, like.dtype(), out_shape, dynamic_shape, out.get());
    } catch (const std::exception& e) {
      PD_THROW(PeerWords(ring_id, comm, peer, "a receive from"), ": ", e.what());
    }
    ph_fake::Log("recv", comm, ph_fake::Bytes(*out), peer);
    return std::vector<paddle::Tensor>{paddle::Tensor(out)};
  });
}

std::vector<std::vector<int64_t>> PhSendV2InferShape(const std::vector<int64_t>& x_shape, int ring_id, int peer,
                                                     bool dynamic_shape) {
  return {};
}

std::vector<paddle::DataType> PhSendV2InferDtype(const paddle::DataType& x_dtype) { return {}; }

std::vector<std::vector<int64_t>> PhRecvV2InferShape(const std::vector<int64_t>& like_shape, int ring_id, int peer,
                                                     const std::vector<int>& out_shape, bool dynamic_shape) {
  return {std::vector<int64_t>(out_shape.begin(), out_shape.end())};
}

std::vector<paddle::DataType> PhRecvV2InferDtype(const paddle::DataType& like_dtype) { return {like_dtype}; }

// -- GetDefaultPlace --------------------------------------------------------------------------

phi::Place CpuDefaultPlace() { return phi::CPUPlace(); }

// -- by name --------------------------------------------------------------------------------

template <typename T>
void* KernelFor(const std::string& kernel) {
  if (kernel == "ReduceScatterKernel") return reinterpret_cast<void*>(&ReduceScatter<T>);
  if (kernel == "AllToAllKernel") return reinterpret_cast<void*>(&AllToAll<T>);
  if (kernel == "PSendKernel") return reinterpret_cast<void*>(&PSend<T>);
  if (kernel == "PRecvKernel") return reinterpret_cast<void*>(&PRecv<T>);
  return nullptr;
}

}  // namespace

PD_BUILD_OP(ph_send_v2)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "peer: int", "dynamic_shape: bool"})
    .SetInplaceMap({{"X", "Out"}})
    .SetKernelFn(PD_KERNEL(PhSendV2Kernel))
    .SetInferShapeFn(PD_INFER_SHAPE(PhSendV2InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PhSendV2InferDtype));

PD_BUILD_OP(ph_recv_v2)
    .Inputs({"Like"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "peer: int", "out_shape: std::vector<int>", "dynamic_shape: bool"})
    .SetKernelFn(PD_KERNEL(PhRecvV2Kernel))
    .SetInferShapeFn(PD_INFER_SHAPE(PhRecvV2InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PhRecvV2InferDtype));

extern "C" {

// The plugin's function for Paddle's `phi::<kernel><type, phi::CPUContext>`, or null.
void* ph_gloo_kernel(const char* kernel, const char* type) {
  const std::string k(kernel), t(type);
  if (t == "float") return KernelFor<float>(k);
  if (t == "double") return KernelFor<double>(k);
  if (t == "int") return KernelFor<int>(k);
  if (t == "long") return KernelFor<long>(k);  // NOLINT
  if (t == "short") return KernelFor<short>(k);  // NOLINT
  if (t == "signed char") return KernelFor<signed char>(k);
  if (t == "unsigned char") return KernelFor<unsigned char>(k);
  if (t == "bool") return KernelFor<bool>(k);
  if (t == "phi::dtype::float16") return KernelFor<phi::dtype::float16>(k);
  if (t == "phi::dtype::bfloat16") return KernelFor<phi::dtype::bfloat16>(k);
  return nullptr;
}

// Paddle's own function behind one of them: what a call on a non-gloo context runs.
void ph_gloo_set_original(const char* kernel, const char* type, void* fn) {
  Originals()[std::string(kernel) + "|" + type] = fn;
}

// `libphi_core.so`'s vtable of GlooCommContext, as objects point at it (the symbol + 16).
void ph_gloo_set_vtable(const void* vtable) { gloo_vtable = vtable; }

// How many calls of `kernel` did gloo work (the tests: a C++ reshard reached it).
long long ph_gloo_calls(const char* kernel) { return Calls()[kernel].load(); }  // NOLINT

// An all_to_all with a size per part on the gloo comm context `context` (a process group's,
// `ProcessGroupGloo::GetCommContext()`); 0, or -1 with the reason in `error`.
int ph_gloo_all_to_all_v(void* context, const char* send, const int64_t* send_bytes, char* recv,
                         const int64_t* recv_bytes, char* error, int error_size) {
  try {
    PADDLE_ENFORCE_EQ(context != nullptr && gloo_vtable != nullptr &&
                          *reinterpret_cast<const void* const*>(context) == gloo_vtable,
                      true, common::errors::InvalidArgument(
                          "paddle_hybrid all_to_all: the comm context is not a GlooCommContext."));
    Count("AllToAllV");
    AllToAllV(static_cast<GlooCommContext*>(context), send, send_bytes, recv, recv_bytes);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
    return -1;
  }
}

// Wait until every send posted by ph_send_v2 is done; 0, or -1 with the first error in `error`.
int ph_p2p_flush(char* error, int error_size) {
  try {
    std::vector<RingSender*> senders;
    {
      std::lock_guard<std::mutex> lock(SendersMutex());
      for (auto& item : Senders()) senders.push_back(item.second.get());
    }
    for (RingSender* sender : senders) sender->Flush();
    RingSender::RaiseError();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
    return -1;
  }
}

// `phi::distributed::GetDefaultPlace()` for a process with no custom device.
void* ph_cpu_default_place() { return reinterpret_cast<void*>(&CpuDefaultPlace); }

}  // extern "C"
