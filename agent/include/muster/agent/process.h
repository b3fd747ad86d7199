// Starting one worker process.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::agent {

struct SpawnRequest {
  std::string path;               // resolved executable
  std::vector<std::string> argv;  // argv[0] included
  std::vector<std::string> envp;  // "KEY=VALUE"
  // The job cgroup's cgroup.procs (JobSupervisor), which the child writes "0" to before
  // exec, so that it and all it starts are in the job cgroup; -1: none.
  int cgroup_procs_fd = -1;
  // --numa-binding: the child sets its CPU affinity to these CPUs (sched_setaffinity; a
  // failure ends it with exit 127 and a line on stderr) and prefers this memory node
  // (set_mempolicy(MPOL_PREFERRED); best effort). Empty / -1: no binding.
  std::vector<int> cpus;
  int memory_node = -1;
  // The child's stdin: launch's own (torchrun's way), /dev/null, or a pipe whose write end
  // the caller gets (ChildProcess::in_fd).
  enum class Stdin { kInherit, kNull, kPipe };
  Stdin stdin_mode = Stdin::kInherit;
  // The worker's end of its control channel (--in_place; ops/control_channel.h), kept open
  // across exec under its own number (the caller names it in MUSTER_CONTROL_FD); -1: none.
  int control_fd = -1;
};

// A started worker. The caller owns the descriptors (all close-on-exec).
struct ChildProcess {
  pid_t pid = -1;
  int pidfd = -1;   // readable once the child has exited (pidfd_open)
  int out_fd = -1;  // read end of the child's stdout
  int err_fd = -1;  // read end of the child's stderr
  int in_fd = -1;   // write end of the child's stdin (SpawnRequest::Stdin::kPipe only)
};

// Starts the worker with clone(CLONE_VM | CLONE_VFORK) and exec, as posix_spawn does (no
// copy of the agent's address space): in its own process group (pgid == pid), in the job cgroup when
// one is given, with
// PR_SET_PDEATHSIG(SIGKILL) set in the child and the parent re-checked afterwards, bound to
// its CPUs and memory node when asked, stdout
// and stderr on pipes, SIGPIPE reset to default. Only async-signal-safe calls run between
// clone and exec; everything is prepared before the clone.
//
// REQUIRES: called from the thread that lives as long as the process (the main thread):
// PR_SET_PDEATHSIG fires when the spawning *thread* ends.
absl::StatusOr<ChildProcess> spawn_worker(const SpawnRequest& request);

}  // namespace muster::agent
