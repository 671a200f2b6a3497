// paddle_hybrid: comm contexts of the fake world, and the log of every C++ collective.
//
// What `custom_ops/fake_comm.cc` defines and the plugin's other kernels use: whether a
// comm context is a fake one (the dry run's: a rank of an N-rank world with no peer), and
// one log of every collective a C++ path made on a comm context, fake or real, in call
// order (`paddle_hybrid.gloo.fake_contexts` reads it).
#pragma once

#include <cstdint>
#include <string>

#include "paddle/phi/core/dense_tensor.h"
#include "paddle/phi/core/distributed/comm_context.h"

namespace ph_fake {

// Whether `ctx` is a fake world's comm context (made by the replaced CreateGlooCommContext).
bool IsFake(const phi::distributed::CommContext* ctx);

// Append one collective to the log while logging is on (the probe of a real run, every fake
// world): `op` as Paddle's Python names it, `ctx` the context it ran on, `bytes` of this rank's
// tensor (see the .cc), `peer` the other rank of a send or receive (-1 otherwise).
void Log(const char* op, const phi::distributed::CommContext* ctx, int64_t bytes, int peer = -1);

// Bytes of a tensor's data (0 for one not allocated).
int64_t Bytes(const phi::DenseTensor& t);

// The fake world's answers of the collectives the plugin's own kernels make (values: the
// module docstring of paddle_hybrid.gloo.fake_contexts).  `out` is allocated here when it is
// not yet.
void FakeReduceScatter(const phi::distributed::CommContext* ctx, const phi::DenseTensor& x, phi::DenseTensor* out);
void FakeAllToAll(const phi::distributed::CommContext* ctx, const phi::DenseTensor& x, phi::DenseTensor* out);
void FakeRecv(const phi::distributed::CommContext* ctx, phi::DenseTensor* out, int peer);
// A send's shape and dtype, kept for the ranks run after this one.
void FakeSend(const phi::distributed::CommContext* ctx, const phi::DenseTensor& x, int peer);
// `out` resized to what the peer's earlier run sent on this pair (the next of its messages), or the
// fake world's error that names the pair when it did not run before this one.
void FakeRecvShape(const phi::distributed::CommContext* ctx, int peer, phi::DenseTensor* out);

}  // namespace ph_fake
