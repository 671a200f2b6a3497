// paddle_hybrid: comm contexts of the fake world (the dry run), and a log of every collective
// Paddle's C++ makes on a gloo comm context.
//
// The semi-auto API's reshards and a static program's collectives run in C++: they find a
// comm context in `CommContextManager` (made by `CommContextManager::CreateGlooCommContext`,
// a gloo rendezvous with every peer) and call `GlooCommContext::AllReduce`, `AllGather`, ...
// on it.  In a fake world no peer exists, so the rendezvous would wait for ever.
//
// `paddle_hybrid.gloo.fake_contexts` points the PLT slots of `libphi_core.so` and
// `libpaddle.so` for those functions at the ones below:
// * CreateGlooCommContext: in a fake world, a `FakeCommContext` of the same rank, size and
//   key, made at once; otherwise Paddle's (the context is remembered by key for the log).
// * each GlooCommContext method: on a fake context, the fake world's answer; on a real one,
//   Paddle's.  Either way the call is logged while logging is on.
// The plugin's own kernels (`gloo_kernels.cc`) ask `IsFake` and log their calls here too, so
// one log holds every C++ collective in call order; Python's collectives take sequence numbers
// from the same counter (`ph_comm_next_seq`), so the two logs merge in order.

#include "fake_comm.h"

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "paddle/extension.h"
#include "paddle/phi/api/include/context_pool.h"
#include "paddle/phi/backends/cpu/cpu_context.h"
#include "paddle/phi/common/bfloat16.h"
#include "paddle/phi/common/float16.h"
#include "paddle/phi/core/distributed/comm_context_manager.h"
#include "paddle/phi/core/distributed/store/tcp_store.h"

namespace ph_fake {

using phi::DenseTensor;
using phi::distributed::CommContext;

namespace {

class FakeCommContext final : public CommContext {
 public:
  FakeCommContext(int rank, int size, std::string key) : CommContext(rank, size), key_(std::move(key)) {}
  const std::string& key() const { return key_; }

 private:
  std::string key_;
};

const void* VtableOf(const CommContext* ctx) { return *reinterpret_cast<const void* const*>(ctx); }

const void* FakeVtable() {
  static const void* vtable = [] {
    FakeCommContext probe(0, 1, "");
    return VtableOf(&probe);
  }();
  return vtable;
}

std::string KeyOf(const CommContext* ctx);

struct Entry {
  long long seq;  // NOLINT
  std::string op, key;
  int rank, size, peer;
  long long bytes;  // NOLINT
};

std::atomic<long long> next_seq{0};  // NOLINT
std::atomic<int> logging{0}, paused{0}, fake_world{0}, store_port{0}, store_timeout{900};
std::mutex log_mutex;
std::vector<Entry>& Entries() {
  static std::vector<Entry> entries;
  return entries;
}
// Key of each real context made while this library was watching (a fake one knows its own).
std::map<const CommContext*, std::string>& Keys() {
  static std::map<const CommContext*, std::string> keys;
  return keys;
}
// Point-to-point shapes of the fake world, by "<context key>|<sender's rank>-><receiver's rank>" (ranks
// within the context): what this process sent (for the ranks run after it) and what earlier runs
// sent it (the replay), with how many of each pair were received so far.
struct Shape {
  std::vector<int64_t> dims;
  int dtype;
};
std::map<std::string, std::vector<Shape>>& Sent() {
  static std::map<std::string, std::vector<Shape>> sent;
  return sent;
}
std::map<std::string, std::vector<Shape>>& Replay() {
  static std::map<std::string, std::vector<Shape>> replay;
  return replay;
}
// Receives whose shape was taken from this rank's own send the other way (pair, index, shape).
struct Assumed {
  std::string pair;
  size_t index;
  Shape shape;
};
std::vector<Assumed>& AssumedShapes() {
  static std::vector<Assumed> assumed;
  return assumed;
}
std::map<std::string, size_t>& Received() {
  static std::map<std::string, size_t> received;
  return received;
}
std::string PairOf(const CommContext* ctx, int from, int to) {
  return KeyOf(ctx) + "|" + std::to_string(from) + "->" + std::to_string(to);
}

std::map<std::string, void*>& Originals() {
  static std::map<std::string, void*> originals;
  return originals;
}

template <typename Fn>
Fn Original(const char* name) {
  auto it = Originals().find(name);
  PADDLE_ENFORCE_EQ(it != Originals().end(), true,
                    common::errors::PreconditionNotMet(
                        "paddle_hybrid: no original %s recorded for the fake comm contexts.", name));
  return reinterpret_cast<Fn>(it->second);
}

std::string KeyOf(const CommContext* ctx) {
  if (IsFake(ctx)) return static_cast<const FakeCommContext*>(ctx)->key();
  std::lock_guard<std::mutex> lock(log_mutex);
  auto it = Keys().find(ctx);
  return it == Keys().end() ? std::string() : it->second;
}

const phi::CPUContext& CpuContext() {
  return *static_cast<const phi::CPUContext*>(
      paddle::experimental::DeviceContextPool::Instance().Get(phi::CPUPlace()));
}

char* DataOf(DenseTensor* t) { return static_cast<char*>(t->data()); }
const char* DataOf(const DenseTensor& t) { return static_cast<const char*>(t.data()); }

// `out` allocated with `in`'s dtype; shaped as `in` with its first dimension x `rows_times` /
// `rows_divide` unless its shape already holds that many bytes (a caller's own shape).
void AllocLike(DenseTensor* out, const DenseTensor& in, int64_t rows_times = 1, int64_t rows_divide = 1) {
  const int64_t want = Bytes(in) * rows_times / rows_divide;
  if (!out->initialized() || out->numel() * static_cast<int64_t>(phi::SizeOf(in.dtype())) != want) {
    auto dims = in.dims();
    if (dims.size() > 0) dims[0] = dims[0] * rows_times / rows_divide;
    out->Resize(dims);
  }
  CpuContext().Alloc(out, in.dtype());  // a no-op where the holder is large enough
}

void CopyBytes(char* to, const char* from, int64_t n) {
  if (n > 0 && to != from) std::memcpy(to, from, static_cast<size_t>(n));
}

// A floating tensor of ones, any other of zeros: what a receive from no recorded peer gives
// (as the Python fake world's floating receives).
void FillArrived(DenseTensor* out) {
  const int64_t n = out->numel();
  switch (out->dtype()) {
    case phi::DataType::FLOAT32: std::fill_n(out->data<float>(), n, 1.0f); return;
    case phi::DataType::FLOAT64: std::fill_n(out->data<double>(), n, 1.0); return;
    case phi::DataType::FLOAT16:
      std::fill_n(out->data<phi::dtype::float16>(), n, phi::dtype::float16(1.0f)); return;
    case phi::DataType::BFLOAT16:
      std::fill_n(out->data<phi::dtype::bfloat16>(), n, phi::dtype::bfloat16(1.0f)); return;
    default: std::memset(out->data(), 0, static_cast<size_t>(Bytes(*out)));
  }
}

// `in` in each of the context's `size` slots of `out` (an all_gather of ranks that hold alike).
void Tile(const CommContext* ctx, DenseTensor* out, const DenseTensor& in) {
  AllocLike(out, in, ctx->GetSize());
  const int64_t b = Bytes(in);
  PADDLE_ENFORCE_EQ(Bytes(*out), b * ctx->GetSize(), common::errors::InvalidArgument(
      "paddle_hybrid fake world: an all_gather's output holds %d bytes, not %d ranks x %d.",
      Bytes(*out), ctx->GetSize(), b));
  for (int i = 0; i < ctx->GetSize(); ++i) CopyBytes(DataOf(out) + i * b, DataOf(in), b);
}

// -- the replacements of Paddle's functions ----------------------------------------------------

// The fake world's global store: one that serves this process alone (Paddle's would wait for
// every worker of the world to connect).  Made on the port the Python side chose.
std::shared_ptr<phi::distributed::TCPStore> PhGlobalStore() {
  static std::shared_ptr<phi::distributed::TCPStore> store = std::make_shared<phi::distributed::TCPStore>(
      "127.0.0.1", static_cast<uint16_t>(store_port.load()), true, 1, store_timeout.load());
  return store;
}

using Self = CommContext;

void PhCreateGloo(const std::shared_ptr<phi::distributed::Store>& store, const std::string& key, int rank,
                  int size) {
  auto& manager = phi::distributed::CommContextManager::GetInstance();
  if (fake_world.load()) {
    manager.Emplace(key, std::unique_ptr<CommContext>(new FakeCommContext(rank, size, key)));
    return;
  }
  using Fn = void (*)(const std::shared_ptr<phi::distributed::Store>&, const std::string&, int, int);
  Original<Fn>("CreateGlooCommContext")(store, key, rank, size);
  std::lock_guard<std::mutex> lock(log_mutex);
  Keys()[manager.Get(key)] = key;
}

void PhAllReduce(Self* self, DenseTensor* out, const DenseTensor& in, int reduce_type, uint32_t tag) {
  Log("all_reduce", self, Bytes(in));
  if (!IsFake(self)) {
    return Original<void (*)(Self*, DenseTensor*, const DenseTensor&, int, uint32_t)>("AllReduce")(
        self, out, in, reduce_type, tag);
  }
  AllocLike(out, in);
  CopyBytes(DataOf(out), DataOf(in), Bytes(in));
}

void PhReduce(Self* self, DenseTensor* out, const DenseTensor& in, int reduce_type, int root, uint32_t tag) {
  Log("reduce", self, Bytes(in));
  if (!IsFake(self)) {
    return Original<void (*)(Self*, DenseTensor*, const DenseTensor&, int, int, uint32_t)>("Reduce")(
        self, out, in, reduce_type, root, tag);
  }
  AllocLike(out, in);
  CopyBytes(DataOf(out), DataOf(in), Bytes(in));
}

void PhBroadcast(Self* self, DenseTensor* out, const DenseTensor& in, int root, uint32_t tag) {
  Log("broadcast", self, Bytes(in));
  if (!IsFake(self)) {
    return Original<void (*)(Self*, DenseTensor*, const DenseTensor&, int, uint32_t)>("Broadcast")(
        self, out, in, root, tag);
  }
  AllocLike(out, in);  // the root is taken to hold what this rank holds
  CopyBytes(DataOf(out), DataOf(in), Bytes(in));
}

void PhAllGather(Self* self, DenseTensor* out, const DenseTensor& in, uint32_t tag) {
  Log("all_gather", self, Bytes(in));
  if (!IsFake(self)) {
    return Original<void (*)(Self*, DenseTensor*, const DenseTensor&, uint32_t)>("AllGather")(self, out, in, tag);
  }
  Tile(self, out, in);
}

void PhGather(Self* self, DenseTensor* out, const DenseTensor& in, int src, uint32_t tag) {
  Log("gather", self, Bytes(in));
  if (!IsFake(self)) {
    return Original<void (*)(Self*, DenseTensor*, const DenseTensor&, int, uint32_t)>("Gather")(
        self, out, in, src, tag);
  }
  if (self->GetRank() == src) Tile(self, out, in);
}

void PhScatter(Self* self, DenseTensor* out, const DenseTensor& in, int src, int size, uint32_t tag) {
  Log("scatter", self, Bytes(*out));
  if (!IsFake(self)) {
    return Original<void (*)(Self*, DenseTensor*, const DenseTensor&, int, int, uint32_t)>("Scatter")(
        self, out, in, src, size, tag);
  }
  if (out->numel() > 0) CpuContext().Alloc(out, out->dtype());
  const int64_t b = Bytes(*out), at = b * self->GetRank();
  if (Bytes(in) >= at + b) {
    CopyBytes(DataOf(out), DataOf(in) + at, b);  // this rank's slot of what it holds
  } else {
    FillArrived(out);
  }
}

void PhBarrier(Self* self) {
  Log("barrier", self, 0);
  if (!IsFake(self)) return Original<void (*)(Self*)>("Barrier")(self);
}

void PhSend(Self* self, const DenseTensor& in, int dst, uint32_t tag) {
  Log("send", self, Bytes(in), dst);
  if (!IsFake(self)) {
    return Original<void (*)(Self*, const DenseTensor&, int, uint32_t)>("Send")(self, in, dst, tag);
  }
  FakeSend(self, in, dst);
}

void PhRecv(Self* self, DenseTensor* out, int src, uint32_t tag) {
  if (!IsFake(self)) {
    Log("recv", self, Bytes(*out), src);
    return Original<void (*)(Self*, DenseTensor*, int, uint32_t)>("Recv")(self, out, src, tag);
  }
  FakeRecv(self, out, src);
}

}  // namespace

// -- shared with the plugin's kernels -----------------------------------------------------------

bool IsFake(const CommContext* ctx) { return ctx != nullptr && VtableOf(ctx) == FakeVtable(); }

int64_t Bytes(const DenseTensor& t) {
  return t.initialized() && t.numel() > 0 ? t.numel() * static_cast<int64_t>(phi::SizeOf(t.dtype())) : 0;
}

void Log(const char* op, const CommContext* ctx, int64_t bytes, int peer) {
  if (ctx == nullptr || !logging.load() || paused.load() > 0) return;
  Entry entry{++next_seq, op, KeyOf(ctx), ctx->GetRank(), ctx->GetSize(), peer, bytes};
  std::lock_guard<std::mutex> lock(log_mutex);
  Entries().push_back(std::move(entry));
}

void FakeReduceScatter(const CommContext* ctx, const DenseTensor& x, DenseTensor* out) {
  const int n = ctx->GetSize();
  PADDLE_ENFORCE_EQ(x.dims().size() > 0 && x.dims()[0] % n == 0, true, common::errors::InvalidArgument(
      "paddle_hybrid reduce_scatter: the first dimension of the input (%s) must divide by the %d ranks.",
      x.dims().to_str(), n));
  AllocLike(out, x, 1, n);
  const int64_t b = Bytes(*out);
  CopyBytes(DataOf(out), DataOf(x) + b * ctx->GetRank(), b);  // this rank's slot of its own input
}

void FakeAllToAll(const CommContext* ctx, const DenseTensor& x, DenseTensor* out) {
  const int n = ctx->GetSize();
  PADDLE_ENFORCE_EQ(x.dims().size() > 0 && x.dims()[0] % n == 0, true, common::errors::InvalidArgument(
      "paddle_hybrid all_to_all: the first dimension of the input (%s) must divide by the %d ranks.",
      x.dims().to_str(), n));
  AllocLike(out, x);
  const int64_t part = Bytes(x) / n;
  // As if every peer held what this rank holds: part p from rank p is this rank's own part.
  for (int p = 0; p < n; ++p) CopyBytes(DataOf(out) + p * part, DataOf(x) + ctx->GetRank() * part, part);
}

void FakeSend(const CommContext* ctx, const DenseTensor& x, int peer) {
  std::vector<int64_t> dims(x.dims().size());
  for (int i = 0; i < x.dims().size(); ++i) dims[i] = x.dims()[i];
  const std::string pair = PairOf(ctx, ctx->GetRank(), peer);
  std::lock_guard<std::mutex> lock(log_mutex);
  Sent()[pair].push_back(Shape{dims, static_cast<int>(x.dtype())});
}

void FakeRecvShape(const CommContext* ctx, int peer, DenseTensor* out) {
  const std::string pair = PairOf(ctx, peer, ctx->GetRank()), back = PairOf(ctx, ctx->GetRank(), peer);
  std::lock_guard<std::mutex> lock(log_mutex);
  const size_t index = Received()[pair]++;
  const Shape* shape = nullptr;
  auto it = Replay().find(pair);
  if (it != Replay().end() && index < it->second.size()) {
    shape = &it->second[index];  // what the peer's earlier run sent
  } else {
    // A pipeline's gradient has the shape of the activation this rank sent that peer: message
    // `index` back is taken to be shaped as message `index` out (checked against the peer's own
    // record once it has run: paddle_hybrid.dryrun compares the two).
    auto out_it = Sent().find(back);
    if (out_it != Sent().end() && index < out_it->second.size()) {
      shape = &out_it->second[index];
      AssumedShapes().push_back(Assumed{pair, index, *shape});
    }
  }
  PADDLE_ENFORCE_EQ(shape != nullptr, true, common::errors::PreconditionNotMet(
      "paddle_hybrid.dryrun: rank %d of comm context \"%s\" receives message %d of a dynamic shape from its rank "
      "%d, whose run was not recorded before this one; its shape is the sender's. Dry-run the sending rank's "
      "class first (pipeline stages in order) or with --ranks all.",
      ctx->GetRank(), KeyOf(ctx), static_cast<int>(index), peer));
  PADDLE_ENFORCE_EQ(static_cast<int>(out->dtype()) == shape->dtype || out->dtype() == phi::DataType::UNDEFINED, true,
                    common::errors::InvalidArgument(
                        "paddle_hybrid.dryrun: a dynamic-shape receive from rank %d of comm context \"%s\" expects "
                        "dtype %d, its sender sent %d.", peer, KeyOf(ctx), static_cast<int>(out->dtype()),
                        shape->dtype));
  out->Resize(common::make_ddim(shape->dims));
}

void FakeRecv(const CommContext* ctx, DenseTensor* out, int peer) {
  if (out->numel() > 0) CpuContext().Alloc(out, out->dtype());
  PADDLE_ENFORCE_EQ(out->initialized() && out->numel() >= 0, true, common::errors::PreconditionNotMet(
      "paddle_hybrid fake world: a receive from rank %d of a group of %d has no shape (a dynamic-shape "
      "receive): the fake world cannot know what the peer would send.", peer, ctx->GetSize()));
  Log("recv", ctx, Bytes(*out), peer);
  FillArrived(out);
}

}  // namespace ph_fake

extern "C" {

// The replacement of `name` (a GlooCommContext method, or "CreateGlooCommContext"), or null.
void* ph_fake_replacement(const char* name) {
  static const std::map<std::string, void*> table = {
      {"CreateGlooCommContext", reinterpret_cast<void*>(&ph_fake::PhCreateGloo)},
      {"CreateOrGetGlobalTCPStore", reinterpret_cast<void*>(&ph_fake::PhGlobalStore)},
      {"AllReduce", reinterpret_cast<void*>(&ph_fake::PhAllReduce)},
      {"Reduce", reinterpret_cast<void*>(&ph_fake::PhReduce)},
      {"Broadcast", reinterpret_cast<void*>(&ph_fake::PhBroadcast)},
      {"AllGather", reinterpret_cast<void*>(&ph_fake::PhAllGather)},
      {"Gather", reinterpret_cast<void*>(&ph_fake::PhGather)},
      {"Scatter", reinterpret_cast<void*>(&ph_fake::PhScatter)},
      {"Barrier", reinterpret_cast<void*>(&ph_fake::PhBarrier)},
      {"Send", reinterpret_cast<void*>(&ph_fake::PhSend)},
      {"Recv", reinterpret_cast<void*>(&ph_fake::PhRecv)},
  };
  auto it = table.find(name);
  return it == table.end() ? nullptr : it->second;
}

// A fake comm context under `key` (rank `rank` of `size`), as CreateGlooCommContext makes in a fake
// world.  Python's `CommContextManager.create_gloo_comm_context` takes the function's address (a GOT
// entry, not the PLT slot replaced), so a static program's ring is made here instead.  0: made;
// -1: not a fake world (nothing made).
int ph_fake_comm_context(const char* key, int rank, int size) {
  if (!ph_fake::fake_world.load()) return -1;
  ph_fake::PhCreateGloo(nullptr, key, rank, size);
  return 0;
}

// The log names the context under `key` by that key: one Python made through Paddle's own
// CreateGlooCommContext (its address, not the slot replaced), as PhCreateGloo names those it makes.
// 0: named; -1: no context under `key`.
int ph_comm_log_name(const char* key) {
  auto& manager = phi::distributed::CommContextManager::GetInstance();
  if (!manager.Has(key)) return -1;
  std::lock_guard<std::mutex> lock(ph_fake::log_mutex);
  ph_fake::Keys()[manager.Get(key)] = key;
  return 0;
}

void ph_fake_set_original(const char* name, void* fn) { ph_fake::Originals()[name] = fn; }

// 1: CreateGlooCommContext makes fake contexts (the fake world); 0: Paddle's.  The global store
// (CreateOrGetGlobalTCPStore, pointed here in a fake world only) serves on `port`, waits `timeout` s.
void ph_fake_world(int on, int port, int timeout) {
  ph_fake::fake_world = on;
  ph_fake::store_port = port;
  ph_fake::store_timeout = timeout;
}

// 1: every C++ collective is logged; 0: none.
void ph_comm_log_enable(int on) { ph_fake::logging = on; }

// +1 / -1: while above 0, nothing is logged here (a Python wrapper logs the call it makes).
void ph_comm_log_pause(int delta) { ph_fake::paused += delta; }

// The next sequence number of the shared order (Python's collectives take theirs here).
long long ph_comm_next_seq() { return ++ph_fake::next_seq; }  // NOLINT

// How many collectives the log holds.
long long ph_comm_log_count() {  // NOLINT
  std::lock_guard<std::mutex> lock(ph_fake::log_mutex);
  return static_cast<long long>(ph_fake::Entries().size());  // NOLINT
}

// The log as JSON lines (one object a line), valid until the next call.
const char* ph_comm_log_json() {
  static std::string out;
  std::lock_guard<std::mutex> lock(ph_fake::log_mutex);
  out.clear();
  for (const auto& e : ph_fake::Entries()) {
    out += "{\"seq\": " + std::to_string(e.seq) + ", \"op\": \"" + e.op + "\", \"key\": \"" + e.key +
           "\", \"rank\": " + std::to_string(e.rank) + ", \"size\": " + std::to_string(e.size) +
           ", \"peer\": " + std::to_string(e.peer) + ", \"bytes\": " + std::to_string(e.bytes) + "}\n";
  }
  return out.c_str();
}

// What this process sent point to point on fake contexts, as JSON lines {"pair", "dims", "dtype"}.
const char* ph_fake_sent_json() {
  static std::string out;
  std::lock_guard<std::mutex> lock(ph_fake::log_mutex);
  out.clear();
  for (const auto& item : ph_fake::Sent()) {
    for (const auto& shape : item.second) {
      out += "{\"pair\": \"" + item.first + "\", \"dims\": [";
      for (size_t i = 0; i < shape.dims.size(); ++i) out += (i ? ", " : "") + std::to_string(shape.dims[i]);
      out += "], \"dtype\": " + std::to_string(shape.dtype) + "}\n";
    }
  }
  return out.c_str();
}

// The receives whose shape was taken from this rank's own send the other way, as JSON lines
// {"pair", "index", "dims", "dtype"}: the dry run checks each against the peer's record.
const char* ph_fake_assumed_json() {
  static std::string out;
  std::lock_guard<std::mutex> lock(ph_fake::log_mutex);
  out.clear();
  for (const auto& a : ph_fake::AssumedShapes()) {
    out += "{\"pair\": \"" + a.pair + "\", \"index\": " + std::to_string(a.index) + ", \"dims\": [";
    for (size_t i = 0; i < a.shape.dims.size(); ++i) out += (i ? ", " : "") + std::to_string(a.shape.dims[i]);
    out += "], \"dtype\": " + std::to_string(a.shape.dtype) + "}\n";
  }
  return out.c_str();
}

// One message an earlier run sent on `pair` (in order): what a dynamic-shape receive here gets.
void ph_fake_replay_add(const char* pair, const long long* dims, int ndims, int dtype) {  // NOLINT
  std::lock_guard<std::mutex> lock(ph_fake::log_mutex);
  ph_fake::Replay()[pair].push_back(ph_fake::Shape{std::vector<int64_t>(dims, dims + ndims), dtype});
}

}  // extern "C"
