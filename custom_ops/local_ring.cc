// Same-host collectives over shared memory for gloo groups whose ranks share one machine
// (paddle_hybrid/gloo/local_ring.py says when they are used and why).
//
// One POSIX shared-memory segment per group: a header (each rank's operation counter, its pid,
// a futex word) and, per parity of the operation counter, one slot per rank.  An operation with
// number g: every rank copies its part into slot [g % 2][rank], publishes g (release), and waits
// until every rank has published g (acquire); then it reads what it needs from the slots.  A
// rank writes parity p again only at g + 2, after every rank published g + 1, which each does
// only once it finished reading g: no slot is overwritten while read.  Every rank reduces the
// slots in rank order, so all ranks hold bitwise the same result.
//
// Waiting: a short spin when the caller allows it (ranks <= cores), then a futex wait on a shared
// word every arrival bumps, in slices of 50 ms; between slices the ranks not arrived are checked
// for life (kill(pid, 0)) and the deadline is checked.  Plain C ABI, loaded with ctypes.
//
// Point to point (ph_lp_*): one segment per pair of ranks of a group, holding two lanes, one per
// direction, each a single-producer single-consumer byte ring.  A message is its length (8 bytes)
// then its bytes; the writer copies as much as there is room for and publishes its head
// (release), the reader copies out what is published and publishes its tail.  A send therefore
// returns once its bytes are in the lane (buffered), where gloo's send waits for the receive to
// be posted: every program that completes on gloo completes here.  Waits as above, on the lane's
// own futex word, bumped by both ends.
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <new>

namespace {

constexpr uint32_t kMagic = 0x50484c52;  // "PHLR"
constexpr int kMaxRanks = 64;

struct alignas(64) RankState {
  std::atomic<uint64_t> published;  // number of the last operation this rank entered
  std::atomic<int32_t> pid;
};

struct Header {
  std::atomic<uint32_t> magic;
  int32_t nranks;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> epoch;     // bumped by every arrival: the futex word
  alignas(64) std::atomic<int32_t> sleepers;   // ranks inside a futex wait
  RankState ranks[kMaxRanks];
};

struct Ring {
  Header* header;
  char* data;
  size_t mapped;
  int nranks;
  int rank;
  uint64_t slot_bytes;
  uint64_t op;  // this rank's operation counter
};

size_t DataOffset() { return (sizeof(Header) + 4095) & ~size_t(4095); }

char* Slot(Ring* ring, uint64_t op, int rank) {
  return ring->data + ((op % 2) * ring->nranks + rank) * ring->slot_bytes;
}

double Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The first rank that has not published `op`, or -1 when all have.
int FirstMissing(Ring* ring, uint64_t op) {
  for (int r = 0; r < ring->nranks; ++r) {
    if (ring->header->ranks[r].published.load(std::memory_order_seq_cst) < op) return r;
  }
  return -1;
}

void Arrive(Ring* ring, uint64_t op) {
  Header* h = ring->header;
  h->ranks[ring->rank].published.store(op, std::memory_order_seq_cst);
  h->epoch.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->epoch), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

// 0: every rank published `op`.  -1: the deadline passed; -2: a rank's process is gone.
// *missing: the rank waited for.
int WaitAll(Ring* ring, uint64_t op, double timeout_s, double spin_s, int* missing) {
  Header* h = ring->header;
  const double start = Now();
  int waiting = FirstMissing(ring, op);
  if (waiting < 0) return 0;
  while (spin_s > 0 && Now() - start < spin_s) {
    for (int i = 0; i < 64; ++i) CpuRelax();
    waiting = FirstMissing(ring, op);
    if (waiting < 0) return 0;
  }
  for (;;) {
    const uint32_t seen = h->epoch.load(std::memory_order_seq_cst);
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    waiting = FirstMissing(ring, op);
    if (waiting < 0) {
      h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      return 0;
    }
    timespec slice{0, 50 * 1000 * 1000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->epoch), FUTEX_WAIT, seen, &slice, nullptr, 0);
    h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    waiting = FirstMissing(ring, op);
    if (waiting < 0) return 0;
    const int32_t pid = h->ranks[waiting].pid.load(std::memory_order_seq_cst);
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
      *missing = waiting;
      return -2;
    }
    if (Now() - start > timeout_s) {
      *missing = waiting;
      return -1;
    }
  }
}

template <typename T>
void Reduce(T* out, Ring* ring, uint64_t op, size_t count, int reduce_op) {
  const T* first = reinterpret_cast<const T*>(Slot(ring, op, 0));
  for (size_t i = 0; i < count; ++i) out[i] = first[i];
  for (int r = 1; r < ring->nranks; ++r) {
    const T* part = reinterpret_cast<const T*>(Slot(ring, op, r));
    switch (reduce_op) {
      case 0:
        for (size_t i = 0; i < count; ++i) out[i] = out[i] + part[i];
        break;
      case 1:
        for (size_t i = 0; i < count; ++i) out[i] = part[i] > out[i] ? part[i] : out[i];
        break;
      case 2:
        for (size_t i = 0; i < count; ++i) out[i] = part[i] < out[i] ? part[i] : out[i];
        break;
      default:
        for (size_t i = 0; i < count; ++i) out[i] = out[i] * part[i];
        break;
    }
  }
}

// Create (create != 0) or open the segment `name` of `size` bytes and map it; NULL with errno set.
// The memory is reserved at creation: a /dev/shm too small (a container's 64 MiB) fails here, with
// ENOSPC, instead of a SIGBUS at the first write into a page it cannot back.
void* MapSegment(const char* name, int create, size_t size) {
  const int fd = shm_open(name, create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  if (create) {
    int failed = ftruncate(fd, size) != 0 ? errno : posix_fallocate(fd, 0, size);
    if (failed != 0) {
      close(fd);
      shm_unlink(name);
      errno = failed;
      return nullptr;
    }
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int saved = errno;
  close(fd);
  if (base == MAP_FAILED) {
    errno = saved;
    return nullptr;
  }
  return base;
}

size_t ElementSize(int dtype) {
  switch (dtype) {
    case 0: return 4;  // float32
    case 1: return 8;  // float64
    case 2: return 4;  // int32
    case 3: return 8;  // int64
    case 4: return 1;  // uint8
    case 5: return 1;  // int8
    default: return 0;
  }
}

}  // namespace

extern "C" {

// Create (create != 0) or open the segment `name`; NULL with errno set on failure.
void* ph_lr_open(const char* name, int create, int nranks, int rank, uint64_t slot_bytes) {
  if (nranks < 2 || nranks > kMaxRanks || rank < 0 || rank >= nranks || slot_bytes == 0 || slot_bytes % 64) {
    errno = EINVAL;
    return nullptr;
  }
  const size_t size = DataOffset() + 2 * size_t(nranks) * slot_bytes;
  void* base = MapSegment(name, create, size);
  if (base == nullptr) return nullptr;
  Header* header = static_cast<Header*>(base);
  if (create) {
    new (header) Header();
    header->nranks = nranks;
    header->slot_bytes = slot_bytes;
    header->magic.store(kMagic, std::memory_order_release);
  } else if (header->magic.load(std::memory_order_acquire) != kMagic || header->nranks != nranks ||
             header->slot_bytes != slot_bytes) {
    munmap(base, size);
    errno = EPROTO;
    return nullptr;
  }
  header->ranks[rank].pid.store(static_cast<int32_t>(getpid()), std::memory_order_seq_cst);
  Ring* ring = new Ring{header, static_cast<char*>(base) + DataOffset(), size, nranks, rank, slot_bytes, 0};
  ring->op = header->ranks[rank].published.load(std::memory_order_seq_cst);
  return ring;
}

int ph_lr_unlink(const char* name) { return shm_unlink(name); }

void ph_lr_close(void* handle) {
  Ring* ring = static_cast<Ring*>(handle);
  if (ring == nullptr) return;
  munmap(ring->header, ring->mapped);
  delete ring;
}

}  // extern "C"

namespace {

// `count` elements of `dtype` at `ptr`, reduced with `reduce_op` (0 sum, 1 max, 2 min, 3 prod) over
// the ring into `ptr` of ring rank `root`, or of every rank when `root` is -1; the others' `ptr`
// is left as it was.  Returns 0, or the WaitAll code with *missing set.
int ReduceOver(Ring* ring, void* ptr, uint64_t count, int dtype, int reduce_op, int root, double timeout_s,
               double spin_s, int* missing) {
  const size_t element = ElementSize(dtype);
  if (element == 0 || reduce_op < 0 || reduce_op > 3 || root < -1 || root >= ring->nranks) return -3;
  const size_t per_chunk = ring->slot_bytes / element;
  char* bytes = static_cast<char*>(ptr);
  const bool keeps = root < 0 || root == ring->rank;
  for (size_t done = 0; done < count || (count == 0 && done == 0);) {
    const size_t n = count - done < per_chunk ? count - done : per_chunk;
    const uint64_t op = ++ring->op;
    std::memcpy(Slot(ring, op, ring->rank), bytes + done * element, n * element);
    Arrive(ring, op);
    const int status = WaitAll(ring, op, timeout_s, spin_s, missing);
    if (status != 0) return status;
    void* out = bytes + done * element;
    if (keeps) {
      switch (dtype) {
        case 0: Reduce(static_cast<float*>(out), ring, op, n, reduce_op); break;
        case 1: Reduce(static_cast<double*>(out), ring, op, n, reduce_op); break;
        case 2: Reduce(static_cast<int32_t*>(out), ring, op, n, reduce_op); break;
        case 3: Reduce(static_cast<int64_t*>(out), ring, op, n, reduce_op); break;
        case 4: Reduce(static_cast<uint8_t*>(out), ring, op, n, reduce_op); break;
        default: Reduce(static_cast<int8_t*>(out), ring, op, n, reduce_op); break;
      }
    }
    if (count == 0) break;
    done += n;
  }
  return 0;
}

}  // namespace

extern "C" {

// In place on every rank: see ReduceOver.
int ph_lr_all_reduce(void* handle, void* ptr, uint64_t count, int dtype, int reduce_op, double timeout_s,
                     double spin_s, int* missing) {
  return ReduceOver(static_cast<Ring*>(handle), ptr, count, dtype, reduce_op, -1, timeout_s, spin_s, missing);
}

// Into ring rank `root` only (gloo leaves scratch in the others' tensors; here they keep theirs).
int ph_lr_reduce(void* handle, void* ptr, uint64_t count, int dtype, int reduce_op, int root, double timeout_s,
                 double spin_s, int* missing) {
  if (root < 0) return -3;
  return ReduceOver(static_cast<Ring*>(handle), ptr, count, dtype, reduce_op, root, timeout_s, spin_s, missing);
}

// `nbytes` at `ptr` from ring rank `root` to every rank, in place.
int ph_lr_broadcast(void* handle, void* ptr, uint64_t nbytes, int root, double timeout_s, double spin_s,
                    int* missing) {
  Ring* ring = static_cast<Ring*>(handle);
  if (root < 0 || root >= ring->nranks) return -3;
  char* bytes = static_cast<char*>(ptr);
  for (size_t done = 0; done < nbytes || (nbytes == 0 && done == 0);) {
    const size_t n = nbytes - done < ring->slot_bytes ? nbytes - done : ring->slot_bytes;
    const uint64_t op = ++ring->op;
    if (ring->rank == root) std::memcpy(Slot(ring, op, root), bytes + done, n);
    Arrive(ring, op);
    const int status = WaitAll(ring, op, timeout_s, spin_s, missing);
    if (status != 0) return status;
    if (ring->rank != root) std::memcpy(bytes + done, Slot(ring, op, root), n);
    if (nbytes == 0) break;
    done += n;
  }
  return 0;
}

// Every rank's `nbytes` at `in` into `out` (nranks * nbytes, rank order).
int ph_lr_all_gather(void* handle, const void* in, void* out, uint64_t nbytes, double timeout_s, double spin_s,
                     int* missing) {
  Ring* ring = static_cast<Ring*>(handle);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  for (size_t done = 0; done < nbytes || (nbytes == 0 && done == 0);) {
    const size_t n = nbytes - done < ring->slot_bytes ? nbytes - done : ring->slot_bytes;
    const uint64_t op = ++ring->op;
    std::memcpy(Slot(ring, op, ring->rank), src + done, n);
    Arrive(ring, op);
    const int status = WaitAll(ring, op, timeout_s, spin_s, missing);
    if (status != 0) return status;
    for (int r = 0; r < ring->nranks; ++r) std::memcpy(dst + r * nbytes + done, Slot(ring, op, r), n);
    if (nbytes == 0) break;
    done += n;
  }
  return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Point to point: two lanes per pair of ranks (see the top of the file).

namespace {

constexpr uint32_t kPairMagic = 0x50484c50;  // "PHLP"

struct alignas(64) Lane {
  std::atomic<uint64_t> head;  // bytes the writer has published
  alignas(64) std::atomic<uint64_t> tail;  // bytes the reader has consumed
  alignas(64) std::atomic<uint32_t> seq;   // futex word: bumped at every publish of head or tail
  std::atomic<int32_t> sleepers;           // ends inside a futex wait on seq
};

struct PairHeader {
  std::atomic<uint32_t> magic;
  uint64_t lane_bytes;
  alignas(64) std::atomic<int32_t> pid[2];
  Lane lanes[2];  // lanes[e] is written by end e and read by end 1 - e
};

struct Pair {
  PairHeader* header;
  char* data;  // the bytes of lanes[0], then of lanes[1]
  size_t mapped;
  int end;
  uint64_t lane_bytes;
};

size_t PairDataOffset() { return (sizeof(PairHeader) + 4095) & ~size_t(4095); }

char* LaneData(Pair* pair, int lane) { return pair->data + size_t(lane) * pair->lane_bytes; }

void Bump(Lane* lane) {
  lane->seq.fetch_add(1, std::memory_order_seq_cst);
  if (lane->sleepers.load(std::memory_order_seq_cst) > 0) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&lane->seq), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

// Wait until ready() holds: 0; -1 the deadline (counted from `start`) passed; -2 the other end's
// process is gone.
template <typename Ready>
int WaitLane(Pair* pair, Lane* lane, Ready ready, double start, double timeout_s, double spin_s) {
  if (ready()) return 0;
  const double spin_from = Now();
  while (spin_s > 0 && Now() - spin_from < spin_s) {
    for (int i = 0; i < 64; ++i) CpuRelax();
    if (ready()) return 0;
  }
  for (;;) {
    const uint32_t seen = lane->seq.load(std::memory_order_seq_cst);
    lane->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (ready()) {
      lane->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      return 0;
    }
    timespec slice{0, 50 * 1000 * 1000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&lane->seq), FUTEX_WAIT, seen, &slice, nullptr, 0);
    lane->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) return 0;
    const int32_t pid = pair->header->pid[1 - pair->end].load(std::memory_order_seq_cst);
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) return -2;
    if (Now() - start > timeout_s) return -1;
  }
}

// Copy `n` bytes into this end's lane, waiting for room; the head is stored when the lane is full and
// at the end, and the reader woken then if `publish` (a message's length waits for its bytes).
int LaneWrite(Pair* pair, const char* src, uint64_t n, bool publish, double start, double timeout_s,
              double spin_s) {
  Lane* lane = &pair->header->lanes[pair->end];
  char* bytes = LaneData(pair, pair->end);
  const uint64_t cap = pair->lane_bytes;
  uint64_t head = lane->head.load(std::memory_order_relaxed);  // only this end writes it
  while (n > 0) {
    const uint64_t room = cap - (head - lane->tail.load(std::memory_order_acquire));
    if (room == 0) {
      lane->head.store(head, std::memory_order_release);
      Bump(lane);
      auto has_room = [&] { return head - lane->tail.load(std::memory_order_acquire) < cap; };
      const int status = WaitLane(pair, lane, has_room, start, timeout_s, spin_s);
      if (status != 0) return status;
      continue;
    }
    const uint64_t at = head % cap;
    uint64_t k = n < room ? n : room;
    if (k > cap - at) k = cap - at;
    std::memcpy(bytes + at, src, k);
    src += k;
    n -= k;
    head += k;
  }
  lane->head.store(head, std::memory_order_release);
  if (publish) Bump(lane);  // without: a sleeping reader wakes at the next write's bump
  return 0;
}

// Copy `n` bytes out of the other end's lane, waiting for them; the tail is published after each
// piece, so a writer waiting for room goes on.
int LaneRead(Pair* pair, char* dst, uint64_t n, double start, double timeout_s, double spin_s) {
  const int from = 1 - pair->end;
  Lane* lane = &pair->header->lanes[from];
  const char* bytes = LaneData(pair, from);
  const uint64_t cap = pair->lane_bytes;
  uint64_t tail = lane->tail.load(std::memory_order_relaxed);  // only this end writes it
  while (n > 0) {
    const uint64_t ready = lane->head.load(std::memory_order_acquire) - tail;
    if (ready == 0) {
      auto has_data = [&] { return lane->head.load(std::memory_order_acquire) != tail; };
      const int status = WaitLane(pair, lane, has_data, start, timeout_s, spin_s);
      if (status != 0) return status;
      continue;
    }
    const uint64_t at = tail % cap;
    uint64_t k = n < ready ? n : ready;
    if (k > cap - at) k = cap - at;
    std::memcpy(dst, bytes + at, k);
    dst += k;
    n -= k;
    tail += k;
    lane->tail.store(tail, std::memory_order_release);
    Bump(lane);
  }
  return 0;
}

}  // namespace

extern "C" {

// Create (create != 0) or open the pair segment `name`, as end 0 or 1; NULL with errno set.
void* ph_lp_open(const char* name, int create, int end, uint64_t lane_bytes) {
  if ((end != 0 && end != 1) || lane_bytes == 0 || lane_bytes % 64) {
    errno = EINVAL;
    return nullptr;
  }
  const size_t size = PairDataOffset() + 2 * lane_bytes;
  void* base = MapSegment(name, create, size);
  if (base == nullptr) return nullptr;
  PairHeader* header = static_cast<PairHeader*>(base);
  if (create) {
    new (header) PairHeader();
    header->lane_bytes = lane_bytes;
    header->magic.store(kPairMagic, std::memory_order_release);
  } else if (header->magic.load(std::memory_order_acquire) != kPairMagic || header->lane_bytes != lane_bytes) {
    munmap(base, size);
    errno = EPROTO;
    return nullptr;
  }
  header->pid[end].store(static_cast<int32_t>(getpid()), std::memory_order_seq_cst);
  return new Pair{header, static_cast<char*>(base) + PairDataOffset(), size, end, lane_bytes};
}

void ph_lp_close(void* handle) {
  Pair* pair = static_cast<Pair*>(handle);
  if (pair == nullptr) return;
  munmap(pair->header, pair->mapped);
  delete pair;
}

// One message of `nbytes` at `ptr` to the other end: its length, then its bytes.  Returns once
// they are all in the lane (0), or the WaitLane code.
int ph_lp_send(void* handle, const void* ptr, uint64_t nbytes, double timeout_s, double spin_s) {
  Pair* pair = static_cast<Pair*>(handle);
  const double start = Now();
  const int status = LaneWrite(pair, reinterpret_cast<const char*>(&nbytes), sizeof(nbytes), false, start,
                               timeout_s, spin_s);
  if (status != 0) return status;
  return LaneWrite(pair, static_cast<const char*>(ptr), nbytes, true, start, timeout_s, spin_s);
}

// The next message from the other end into `ptr`, which holds `nbytes`.  -4 when the message has
// another length (*sent: its length; the lane is then out of step and must not be used again).
int ph_lp_recv(void* handle, void* ptr, uint64_t nbytes, double timeout_s, double spin_s, uint64_t* sent) {
  Pair* pair = static_cast<Pair*>(handle);
  const double start = Now();
  uint64_t length = 0;
  int status = LaneRead(pair, reinterpret_cast<char*>(&length), sizeof(length), start, timeout_s, spin_s);
  if (status != 0) return status;
  *sent = length;
  if (length != nbytes) return -4;
  return LaneRead(pair, static_cast<char*>(ptr), nbytes, start, timeout_s, spin_s);
}

}  // extern "C"
