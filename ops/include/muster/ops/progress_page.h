// The progress page: a small file each worker maps and writes its step and phase to, and its
// agent reads on a timer to tell a hung rank from a busy one (docs/hangs.md). Header-only, no
// dependencies: the agent (reader), the worker runtime (Runtime::progress) and the Python
// module (python/muster_progress.py, which writes the same bytes) share it.
//
// The agent creates the file (kProgressPageBytes, zero-filled, magic and version set) and
// names it in the worker's environment (kProgressFileVar). Layout, little-endian, fixed
// offsets:
//
//   0  u32  magic      kProgressMagic
//   4  u32  version    kProgressVersion
//   8  u64  seq        even: stable; odd: a write is in progress (a sequence lock)
//  16  u64  step       the worker's last reported step
//  24  u64  time_ns    CLOCK_MONOTONIC of that report
//  32  u64  reports    how many reports were made (0: the worker never reported)
//  40  char phase[64]  NUL-padded name of what the worker is doing ("forward", "all_reduce")
// 104  u32  kind       the PhaseKind of that phase (phase_kind(phase))
// 108  u32  reserved
// 112  u64  kind_since CLOCK_MONOTONIC when that phase began (0: no phase yet)
// 120  u64  kind_ns[5] nanoseconds spent in each PhaseKind before kind_since, since the start
//
// A write costs a few stores and no system call: the hot path stays as it is. The time per
// kind (docs/stragglers.md) is kept by the writer on each phase change; a writer of before
// those fields leaves them zero, which a reader takes for "no phase times".
#pragma once

#include <time.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace muster::worker {

inline constexpr char kProgressFileVar[] = "MUSTER_PROGRESS_FILE";
inline constexpr std::uint32_t kProgressMagic = 0x3150504du;  // "MPP1"
inline constexpr std::uint32_t kProgressVersion = 1;
inline constexpr std::size_t kProgressPageBytes = 4096;
inline constexpr std::size_t kProgressPhaseBytes = 64;

// What a phase stands for, for telling a straggler's own work from its wait on the others
// (docs/stragglers.md). By the phase name's start, first match:
//   kData      "data", "input", "load"
//   kCompute   "forward", "compute"
//   kComm      "backward" (DDP overlaps its all-reduce with it: the wait is there),
//              "all_reduce", "allreduce", "reduce", "all_gather", "allgather", "broadcast",
//              "barrier", "collective", "comm", "sync", "wait"
//   kOptimizer "optim"
//   kOther     anything else ("checkpoint", "eval", ""; the automatic reports'
//              "between_steps", which holds data loading and whatever else a script does
//              between its steps: own work, of no known kind)
enum PhaseKind : std::uint32_t { kData = 0, kCompute, kComm, kOptimizer, kOther, kPhaseKinds };

inline constexpr const char* kPhaseKindNames[kPhaseKinds] = {"data", "compute", "comm", "optimizer",
                                                             "other"};

inline PhaseKind phase_kind(std::string_view phase) {
  struct Rule {
    const char* prefix;
    PhaseKind kind;
  };
  static constexpr Rule kRules[] = {
      {"data", kData},       {"input", kData},      {"load", kData},       {"forward", kCompute},
      {"compute", kCompute}, {"backward", kComm},   {"all_reduce", kComm}, {"allreduce", kComm},
      {"reduce", kComm},     {"all_gather", kComm}, {"allgather", kComm},  {"broadcast", kComm},
      {"barrier", kComm},    {"collective", kComm}, {"comm", kComm},       {"sync", kComm},
      {"wait", kComm},       {"optim", kOptimizer},
  };
  for (const Rule& r : kRules) {
    if (phase.substr(0, std::char_traits<char>::length(r.prefix)) == r.prefix) return r.kind;
  }
  return kOther;
}

struct ProgressPage {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint64_t seq;
  std::uint64_t step;
  std::uint64_t time_ns;
  std::uint64_t reports;
  char phase[kProgressPhaseBytes];
  std::uint32_t kind;
  std::uint32_t reserved;
  std::uint64_t kind_since;
  std::uint64_t kind_ns[kPhaseKinds];
};
static_assert(offsetof(ProgressPage, seq) == 8 && offsetof(ProgressPage, step) == 16 &&
              offsetof(ProgressPage, time_ns) == 24 && offsetof(ProgressPage, reports) == 32 &&
              offsetof(ProgressPage, phase) == 40 && offsetof(ProgressPage, kind) == 104 &&
              offsetof(ProgressPage, kind_since) == 112 && offsetof(ProgressPage, kind_ns) == 120 &&
              sizeof(ProgressPage) <= kProgressPageBytes);

inline std::uint64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000u +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

// The phase bytes, NUL-padded (`phase` longer than 63 bytes is cut); inside a write's sequence.
inline void store_phase(ProgressPage* p, std::string_view phase) {
  char buf[kProgressPhaseBytes] = {};
  std::memcpy(buf, phase.data(), std::min(phase.size(), kProgressPhaseBytes - 1));
  for (std::size_t i = 0; i < kProgressPhaseBytes; ++i) {
    __atomic_store_n(&p->phase[i], buf[i], __ATOMIC_RELAXED);
  }
}

// The phase that ends now is added to its kind's time, and `phase` begins; inside a write's
// sequence.
inline void store_kind(ProgressPage* p, std::string_view phase, std::uint64_t now) {
  const std::uint64_t since = __atomic_load_n(&p->kind_since, __ATOMIC_RELAXED);
  const std::uint32_t kind = __atomic_load_n(&p->kind, __ATOMIC_RELAXED);
  if (since != 0 && now > since && kind < kPhaseKinds) {
    __atomic_store_n(&p->kind_ns[kind],
                     __atomic_load_n(&p->kind_ns[kind], __ATOMIC_RELAXED) + (now - since),
                     __ATOMIC_RELAXED);
  }
  __atomic_store_n(&p->kind, static_cast<std::uint32_t>(phase_kind(phase)), __ATOMIC_RELAXED);
  __atomic_store_n(&p->kind_since, now, __ATOMIC_RELAXED);
}

// The worker's side: one writer per page.
inline void write_progress(ProgressPage* p, std::uint64_t step, std::string_view phase) {
  const std::uint64_t now = monotonic_ns();
  const std::uint64_t seq = __atomic_load_n(&p->seq, __ATOMIC_RELAXED);
  __atomic_store_n(&p->seq, seq | 1u, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  __atomic_store_n(&p->step, step, __ATOMIC_RELAXED);
  __atomic_store_n(&p->time_ns, now, __ATOMIC_RELAXED);
  __atomic_store_n(&p->reports, __atomic_load_n(&p->reports, __ATOMIC_RELAXED) + 1,
                   __ATOMIC_RELAXED);
  store_phase(p, phase);
  store_kind(p, phase, now);
  __atomic_store_n(&p->seq, (seq | 1u) + 1, __ATOMIC_RELEASE);
}

// Only the phase, for what not every rank does (rank 0's checkpoint): the step and the
// report count stay, so the stall rule does not take the other ranks for being behind.
inline void write_phase(ProgressPage* p, std::string_view phase) {
  const std::uint64_t now = monotonic_ns();
  const std::uint64_t seq = __atomic_load_n(&p->seq, __ATOMIC_RELAXED);
  __atomic_store_n(&p->seq, seq | 1u, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  store_phase(p, phase);
  store_kind(p, phase, now);
  __atomic_store_n(&p->seq, (seq | 1u) + 1, __ATOMIC_RELEASE);
}

struct ProgressSnapshot {
  std::uint64_t step = 0;
  std::uint64_t time_ns = 0;
  std::uint64_t reports = 0;  // 0: never reported
  std::string phase;
  std::uint32_t kind = kOther;
  std::uint64_t kind_since = 0;
  std::uint64_t kind_ns[kPhaseKinds] = {};

  // The time in each kind up to `now` (CLOCK_MONOTONIC), the phase under way included.
  void kind_totals(std::uint64_t now, std::uint64_t out[kPhaseKinds]) const {
    for (std::uint32_t k = 0; k < kPhaseKinds; ++k) out[k] = kind_ns[k];
    if (kind_since != 0 && now > kind_since && kind < kPhaseKinds) out[kind] += now - kind_since;
  }
};

// The agent's side: a consistent copy, or false when the page is not one (wrong magic or
// version) or stayed mid-write for every try.
inline bool read_progress(const ProgressPage* p, ProgressSnapshot* out) {
  if (__atomic_load_n(&p->magic, __ATOMIC_RELAXED) != kProgressMagic ||
      __atomic_load_n(&p->version, __ATOMIC_RELAXED) != kProgressVersion) {
    return false;
  }
  for (int attempt = 0; attempt < 64; ++attempt) {
    const std::uint64_t before = __atomic_load_n(&p->seq, __ATOMIC_ACQUIRE);
    if (before & 1u) continue;
    ProgressSnapshot s;
    s.step = __atomic_load_n(&p->step, __ATOMIC_RELAXED);
    s.time_ns = __atomic_load_n(&p->time_ns, __ATOMIC_RELAXED);
    s.reports = __atomic_load_n(&p->reports, __ATOMIC_RELAXED);
    char buf[kProgressPhaseBytes];
    for (std::size_t i = 0; i < kProgressPhaseBytes; ++i) {
      buf[i] = __atomic_load_n(&p->phase[i], __ATOMIC_RELAXED);
    }
    s.kind = __atomic_load_n(&p->kind, __ATOMIC_RELAXED);
    s.kind_since = __atomic_load_n(&p->kind_since, __ATOMIC_RELAXED);
    for (std::uint32_t k = 0; k < kPhaseKinds; ++k) {
      s.kind_ns[k] = __atomic_load_n(&p->kind_ns[k], __ATOMIC_RELAXED);
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&p->seq, __ATOMIC_RELAXED) != before) continue;
    buf[kProgressPhaseBytes - 1] = '\0';
    s.phase = buf;
    *out = std::move(s);
    return true;
  }
  return false;
}

}  // namespace muster::worker
