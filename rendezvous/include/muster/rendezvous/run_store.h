// Where a rendezvous server keeps its runs' durable state (RunRecord, one per run) so that it
// can be killed and restarted without restarting any worker (docs/rendezvous.md, "Restarting
// the server without restarting workers").
//
// The server writes the records a decision changed before it sends that decision's messages
// (write-ahead): what an agent was told is never ahead of what a restarted server knows. A
// store is used from the server's io thread only. The state machine decides; a store only
// keeps what it is given.
//
// Backends: files in a folder (rdzvd --state_dir, below). Per-run records, not one blob, so a
// replicated backend (etcd, issue 13) can keep one key per run, or per member.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous {

class RunStore {
 public:
  virtual ~RunStore() = default;

  struct Loaded {
    std::vector<v1::RunRecord> records;  // by run id
    std::vector<std::string> skipped;    // one line per record that could not be read, why
  };
  // Every record kept. An error only when the store as a whole cannot be read.
  virtual absl::StatusOr<Loaded> load_all() = 0;

  // Replaces the record of record.run_id(), atomically: a reader (a restarted server) finds
  // the old record or the new one, never a mix.
  virtual absl::Status put(const v1::RunRecord& record) = 0;
  // Drops the run's record; a run without one is not an error.
  virtual absl::Status erase(const std::string& run_id) = 0;
};

struct FileRunStoreOptions {
  std::string dir;  // must exist and be writable
  // Also flush each record to the disk (fsync of the file and the folder) before the server
  // goes on: a record then survives a power loss or a kernel crash, at the cost of a disk
  // flush per decision on the server's io thread. Without it a record survives the server's
  // own crash or kill -9 (the kernel has it), which is what a crash restart needs.
  bool fsync = false;
};

// One file per run under `dir`, "run-<16 hex digits>.rec" (a stable 64-bit hash of the run
// id; the id itself is inside), written to a temporary file and renamed over the old one.
// A file holds a header (magic, length, checksum) and the serialized record, at most
// limits::kMaxRunRecordBytes; at most limits::kMaxRuns are loaded. A file that cannot be read
// back (bad header, checksum, record, or too large) is skipped and renamed to
// "<name>.corrupt" for a person to look at; leftover temporary files of a write that never
// finished are removed. The folder is locked (flock on "<dir>/lock") for as long as the
// store is open: a second server on the same folder is refused.
absl::StatusOr<std::unique_ptr<RunStore>> open_file_run_store(const FileRunStoreOptions& options);

}  // namespace muster::rendezvous
